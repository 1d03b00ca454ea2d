"""Host overhead per unit: fullshard against torch FSDP2, over torch's fake process group.

Issues 21 and 45. On the fake backend (``FakeStore``, backend ``"fake"``) collectives move no
data, so one process plays rank 0 of N and what a step costs beyond the plain model is the
FSDP's own host work: hooks, schedule, views, DTensor wrapping, copies into and out of
collective buffers. That is the figure that decides host-bound GPU runs (small and medium
models): a GPU's kernels are queued, the host's Python is not. The model is a root module of 32
units, each ``Sequential(Linear(64, 64), GELU(), Linear(64, 64))``; each unit is
``fully_shard``-ed, then the root. One thread, a ``--batch`` x 64 input.

A step is forward, ``.sum().backward()``, then each optimizer implementation of AdamW in turn
on the same gradients (``for-loop``: ``foreach=False``, CPU's default; ``foreach``: what torch
picks on CUDA; ``fused``), then ``zero_grad()``: every phase is timed on its own, and a whole
step with one implementation is forward + backward + its step + ``zero_grad``. Variants, built
in one process per world size (a subprocess each, so every world size gets a fresh fake group):

- per configuration (``--configs``): ``plain`` (the model unsharded), ``fullshard`` and
  ``fsdp2`` (torch's ``fully_shard``). Configurations: ``base`` (fp32, default
  ``reshard_after_forward``), ``bf16`` (``MixedPrecisionPolicy(bf16, reduce fp32)``; plain is
  the model in bf16), ``noreshard`` (``reshard_after_forward=False`` on every unit), ``ac``
  (activation checkpointing, non-reentrant, of every unit, plain too). Only ``base`` steps all
  three optimizer implementations; the others step ``foreach``.
- ``fullshard armed`` (configuration ``base``): the middle unit declared optional
  (``set_optional()``) and run on every rank. Its difference from ``fullshard`` is what the
  feature costs when it has nothing to do. (Live recovery's interrupt token cannot be armed
  here: its waits poll ``work.is_completed()``, which the fake backend's works never report.)

Rounds alternate every variant (A B C ...), ``--steps`` steps each, after ``--warmup`` rounds;
a figure is the median over ``--rounds`` rounds of its per-step mean. Host overhead per unit of
a phase = (the FSDP's median - plain's median) / 32.

Torch's fake group is not free: its all-gather copies the shard into every rank's chunk of the
output, O(world) host work that both FSDPs pay and that a GPU's collectives do not put on the
host. So after the rounds the two FSDPs run ``--backend-steps`` more steps of each
configuration, alternating, with the group's collective methods wrapped in the clock: the time
spent inside them (per unit, the median step) is that FSDP's own cost of the fake backend,
measured where it is paid (cold output buffers and all: timed alone in a loop, the same
collectives cost a third less at world 64 and three fifths less at world 8). Every ratio is
given with and without it, each FSDP's taken off its own overhead.

``--hooks N`` times N fullshard steps with each hook entry point wrapped in a clock (after the
rounds, in the same process): microseconds per unit per step of each hook, and the rest of the
overhead (autograd running the hooks' nodes, the optimizer hooks). ``--profile N`` runs N
fullshard steps under cProfile at the first world size and prints fullshard's own functions,
top 25 by cumulative and by own time, per unit per step.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_host_overhead.py --world 8,64 --hooks 40
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

UNITS = 32
DIM = 64
IMPLS = ("plain", "fullshard", "fsdp2")
OPTIMS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
CONFIGS = ("base", "bf16", "noreshard", "ac")
ARMED = "fullshard armed"
PHASES = ("forward", "backward", "zero_grad")  # then one entry per optimizer implementation
# the clock every phase is timed with (``--clock``): this thread's CPU time by default, which a
# shared machine's other processes do not add to (time spent descheduled is not host work)
CLOCK: list[Callable[[], float]] = [time.thread_time]


class Root(nn.Module):
    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.units = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, DIM), nn.GELU(), nn.Linear(DIM, DIM)) for _ in range(UNITS)
        )
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for unit in self.units:
            x = checkpoint(unit, x, use_reentrant=False) if self.checkpointed else unit(x)
        return x


def build(impl: str, config: str, armed: bool = False) -> nn.Module:
    """The model of a variant (``tests/fast/test_fast_host_calls.py`` counts the calls of
    fullshard's with it)."""
    torch.manual_seed(0)
    model = Root(checkpointed=config == "ac")
    if impl == "plain":
        return model.to(torch.bfloat16) if config == "bf16" else model
    kw: dict[str, Any] = {}
    if impl == "fullshard":
        from fullshard import MixedPrecisionPolicy, fully_shard
    else:
        from torch.distributed.fsdp import (  # type: ignore[no-redef,assignment]
            MixedPrecisionPolicy,
            fully_shard,
        )
    if config == "bf16":
        kw["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    for unit in model.units:
        fully_shard(unit, reshard_after_forward=False if config == "noreshard" else None, **kw)
    fully_shard(model, **kw)
    if armed:
        model.units[UNITS // 2].set_optional()  # type: ignore[operator]
    return model


def _optimizers(model: nn.Module, names: list[str]) -> dict[str, torch.optim.Optimizer]:
    params = list(model.parameters())
    return {n: torch.optim.AdamW(params, lr=1e-3, **OPTIMS[n]) for n in names}


def _stepper(
    impl: str, config: str, optims: list[str], batch: int, armed: bool = False
) -> Callable[[dict[str, float]], None]:
    """One step of a variant, adding each phase's seconds into the dict it is given."""
    model = build(impl, config, armed)
    opts = _optimizers(model, optims)
    x = torch.randn(
        batch, DIM, dtype=torch.bfloat16 if impl == "plain" and config == "bf16" else None
    )
    clock = CLOCK[0]

    def step(acc: dict[str, float]) -> None:
        t0 = clock()
        loss = model(x).sum()
        t1 = clock()
        loss.backward()
        t2 = clock()
        acc["forward"] += t1 - t0
        acc["backward"] += t2 - t1
        for name, opt in opts.items():
            t = clock()
            opt.step()
            acc[name] += clock() - t
        t = clock()
        next(iter(opts.values())).zero_grad()
        acc["zero_grad"] += clock() - t

    return step


# the fake group's collective methods both FSDPs reach (torch 2.13 renamed the older two)
BACKEND_METHODS = (
    "all_gather_single",
    "_allgather_base",
    "reduce_scatter_single",
    "_reduce_scatter_base",
)


def _backend_time(
    steps: dict[str, Callable[[dict[str, float]], None]], n: int, configs: list[str]
) -> dict[str, dict[str, float]]:
    """Per configuration and FSDP: ms per unit per step spent inside the fake group's own
    collective methods, each wrapped in the clock, in ``n`` more steps (after 3 untimed) of the
    rounds' variants (``steps``): the median step."""
    group_type = type(dist.group.WORLD)
    clock = CLOCK[0]
    spent = [0.0]
    patched: list[tuple[type, str, Any]] = []
    for name in BACKEND_METHODS:
        owner = next((c for c in group_type.__mro__ if name in c.__dict__), None)
        if owner is None:
            continue
        orig = getattr(group_type, name)

        def timed(self: Any, *a: Any, _orig: Any = orig, **k: Any) -> Any:
            t = clock()
            try:
                return _orig(self, *a, **k)
            finally:
                spent[0] += clock() - t

        # put back as it was found (the class's own entry: a pybind method, not a function)
        patched.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, timed)
    out: dict[str, dict[str, float]] = {}
    try:
        for config in configs:
            impls = ("fullshard", "fsdp2")
            per_step: dict[str, list[float]] = {impl: [] for impl in impls}
            acc: dict[str, float] = defaultdict(float)
            for r in range(n + 3):  # the two alternate step by step
                for impl in impls:
                    spent[0] = 0.0
                    steps[f"{impl} {config}"](acc)
                    if r >= 3:
                        per_step[impl].append(spent[0])
            # the median step: one step's page faults or collection do not move it
            out[config] = {i: 1e3 * statistics.median(v) / UNITS for i, v in per_step.items()}
    finally:
        for owner, name, entry in patched:
            setattr(owner, name, entry)
    return out


def _variants(args: argparse.Namespace) -> dict[str, Callable[[dict[str, float]], None]]:
    steps: dict[str, Callable[[dict[str, float]], None]] = {}
    for config in args.configs:
        optims = list(OPTIMS) if config == "base" else ["foreach"]
        for impl in IMPLS:
            steps[f"{impl} {config}"] = _stepper(impl, config, optims, args.batch)
    if args.armed:
        steps[ARMED] = _stepper("fullshard", "base", list(OPTIMS), args.batch, armed=True)
    return steps


def _summarise(
    times: dict[str, list[dict[str, float]]],
    backend: dict[str, dict[str, float]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Medians per variant and phase (ms per step), overheads per unit (ms), ratios
    (``backend``: ``_backend_time``'s)."""
    med = {
        v: {k: 1e3 * statistics.median(r[k] for r in rounds) for k in rounds[0]}
        for v, rounds in times.items()
    }
    out: dict[str, Any] = {"median_ms": med, "configs": {}}
    for config in args.configs:
        optims = list(OPTIMS) if config == "base" else ["foreach"]
        plain, coll = med[f"plain {config}"], backend[config]
        figures: dict[str, Any] = {"fake_collectives_per_unit_ms": coll}
        wholes = {"fwd+bwd": ("forward", "backward")} | {
            f"step {o}": ("forward", "backward", o, "zero_grad") for o in optims
        }
        for name, parts in {
            **{p: (p,) for p in ("forward", "backward", *optims)},
            **wholes,
        }.items():
            over = {
                impl: sum(med[f"{impl} {config}"][p] - plain[p] for p in parts) / UNITS
                for impl in ("fullshard", "fsdp2")
            }
            # the fake collectives run in forward and backward
            taken = {impl: coll[impl] if name in wholes else 0.0 for impl in over}
            figures[name] = {
                "fullshard_ms": over["fullshard"],
                "fsdp2_ms": over["fsdp2"],
                "ratio": over["fullshard"] / over["fsdp2"],
                "ratio_without_fake_collectives": (over["fullshard"] - taken["fullshard"])
                / (over["fsdp2"] - taken["fsdp2"]),
            }
        out["configs"][config] = figures
    if args.armed:
        base, armed = med["fullshard base"], med[ARMED]
        out["armed"] = {
            f"step {o}": {
                "fullshard_ms": sum(base[p] for p in ("forward", "backward", o, "zero_grad")),
                "armed_ms": sum(armed[p] for p in ("forward", "backward", o, "zero_grad")),
            }
            for o in OPTIMS
        }
        for fig in out["armed"].values():
            fig["cost"] = fig["armed_ms"] / fig["fullshard_ms"] - 1
    return out


def _hook_clock(n: int, args: argparse.Namespace) -> dict[str, float]:
    """Microseconds per unit per step spent in each of fullshard's hook entry points (each
    wrapped in a clock), against the whole overhead of the same steps."""
    from fullshard.engine import hooks, schedule

    spent: dict[str, float] = defaultdict(float)
    clock = CLOCK[0]
    patched: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, name: str, label: str) -> None:
        orig = getattr(owner, name)
        patched.append((owner, name, orig))

        @functools.wraps(orig)
        def timed(*a: Any, **k: Any) -> Any:
            t = clock()
            try:
                return orig(*a, **k)
            finally:
                spent[label] += clock() - t

        setattr(owner, name, timed)

    wrap(hooks.FSDPState, "pre_forward", "pre-forward")
    wrap(hooks.FSDPState, "post_forward", "post-forward")
    wrap(hooks.FSDPState, "_pre_backward", "pre-backward")
    wrap(hooks.FSDPState, "on_post_backward_event", "post-backward events")
    wrap(schedule.StepSchedule, "end_backward", "end of backward")
    try:
        steps = {impl: _stepper(impl, "base", ["foreach"], args.batch) for impl in IMPLS[:2]}
        acc: dict[str, dict[str, float]] = {impl: defaultdict(float) for impl in steps}
        for r in range(n + 3):
            if r == 3:
                spent.clear()
                acc = {impl: defaultdict(float) for impl in steps}
            for impl, step in steps.items():
                step(acc[impl])
    finally:
        for owner, name, orig in patched:
            setattr(owner, name, orig)
    per = 1e6 / (n * UNITS)
    total = sum(acc["fullshard"][k] - acc["plain"][k] for k in acc["plain"])
    out = {k: v * per for k, v in spent.items()}
    out["rest (autograd running the hooks; the optimizer step and zero_grad)"] = (
        total - sum(spent.values())
    ) * per
    out["whole overhead"] = total * per
    return out


def _profile(step: Callable[[dict[str, float]], None], n: int, world: int) -> None:
    """cProfile ``n`` fullshard steps; print fullshard's own functions, per unit per step."""
    acc: dict[str, float] = defaultdict(float)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        step(acc)
    prof.disable()
    stats = pstats.Stats(prof)
    total = stats.total_tt  # type: ignore[attr-defined]
    per = 1e3 / (n * UNITS)  # ms per unit per step, from seconds over n steps
    print(
        f"\ncProfile, fullshard, world {world}: {n} steps, {1e3 * total / n:.2f} ms per step "
        "under the profiler (its own cost inflates every call; compare rows, not totals)"
    )
    own = {k: v for k, v in stats.stats.items() if f"{os.sep}fullshard{os.sep}" in k[0]}  # type: ignore[attr-defined]
    for title, col in (("cumulative", 3), ("total (own)", 2)):
        rows = sorted(own.items(), key=lambda kv: kv[1][col], reverse=True)[:25]
        print(f"\nfullshard functions, top 25 by {title} time, ms per unit per step:")
        print(f"  {'cum':>7s} {'own':>7s} {'calls/unit/step':>15s}  function")
        for (path, line, fn), (_cc, nc, tt, ct, _callers) in rows:
            rel = path.split(f"{os.sep}fullshard{os.sep}", 1)[-1]
            calls = nc / (n * UNITS)
            print(f"  {ct * per:7.4f} {tt * per:7.4f} {calls:15.2f}  {rel}:{line} {fn}")


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    """One world size: rank 0 of ``args.world_one`` on the fake backend, every variant."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    CLOCK[0] = time.thread_time if args.clock == "cpu" else time.perf_counter
    world = args.world_one
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        steps = _variants(args)
        times: dict[str, list[dict[str, float]]] = {v: [] for v in steps}
        for r in range(args.warmup + args.rounds):
            for v, step in steps.items():
                acc: dict[str, float] = defaultdict(float)
                for _ in range(args.steps):
                    step(acc)
                if r >= args.warmup:
                    times[v].append({k: s / args.steps for k, s in acc.items()})
        backend = _backend_time(steps, args.backend_steps, args.configs)
        res = _summarise(times, backend, args)
        if args.hooks:
            res["hooks_us_per_unit"] = _hook_clock(args.hooks, args)
        if args.profile:
            _profile(steps["fullshard base"], args.profile, world)
    finally:
        dist.destroy_process_group()
    res["load_average"] = os.getloadavg()
    return res


def _table(results: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"\nHost overhead per unit per step (ms), {UNITS} units of Linear({DIM},{DIM})-GELU-"
        f"Linear({DIM},{DIM}), batch {args.batch}, AdamW, fake group at rank 0, 1 thread; "
        f"medians of {args.rounds} alternating rounds of {args.steps} steps"
    )
    head = f"  {'world':>5s} {'config':>9s} {'figure':>16s} {'fullshard':>9s} {'fsdp2':>9s}"
    print(head + f" {'ratio':>7s} {'-fake':>7s}")
    for world, res in results.items():
        for config, figs in res["configs"].items():
            for name, f in figs.items():
                if name == "fake_collectives_per_unit_ms":
                    continue
                print(
                    f"  {world:>5s} {config:>9s} {name:>16s} {f['fullshard_ms']:9.3f} "
                    f"{f['fsdp2_ms']:9.3f} {f['ratio']:6.2f}x "
                    f"{f['ratio_without_fake_collectives']:6.2f}x"
                )
            coll = figs["fake_collectives_per_unit_ms"]
            print(
                f"  {'':>5s} {config:>9s} fake collectives/unit {coll['fullshard']:9.3f} "
                f"{coll['fsdp2']:9.3f}"
            )
        for name, f in res.get("armed", {}).items():
            print(
                f"  {world:>5s} idle features armed, {name}: {f['armed_ms']:.2f} ms against "
                f"{f['fullshard_ms']:.2f} ({100 * f['cost']:+.1f}%)"
            )
        if "hooks_us_per_unit" in res:
            print(f"  {world:>5s} fullshard per hook, us per unit per step (base, foreach):")
            for name, us in res["hooks_us_per_unit"].items():
                print(f"  {'':>5s}   {us:8.1f}  {name}")
        print(f"  {world:>5s} load average during the run: {res['load_average']}")
    print(
        "  ratio: fullshard's overhead / fsdp2's (below 1: fullshard costs less); -fake: the same"
        " with each FSDP's time inside the fake backend's collectives (timed in its own steps)"
        " taken off its overhead"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", default="8,64", help="world sizes, comma-separated (default 8,64)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="of " + ",".join(CONFIGS))
    ap.add_argument("--no-armed", dest="armed", action="store_false", help="skip 'armed'")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="steps per variant per round")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--hooks", type=int, default=0, help="time N steps' hooks (each world)")
    ap.add_argument(
        "--backend-steps",
        type=int,
        default=15,
        help="steps per FSDP and configuration timing the fake backend's collectives (median)",
    )
    ap.add_argument(
        "--clock", choices=("cpu", "wall"), default="cpu", help="thread CPU time or wall time"
    )
    ap.add_argument("--profile", type=int, default=0, help="cProfile N fullshard steps")
    ap.add_argument("--out", default="docs/bench/host_overhead.json", help="JSON ('' for none)")
    ap.add_argument("--world-one", type=int, default=0, help=argparse.SUPPRESS)  # the subprocess
    args = ap.parse_args()
    args.configs = [c for c in args.configs.split(",") if c]
    if "base" not in args.configs:
        args.configs.insert(0, "base")  # the armed variant and the hook clock compare with it
    if args.world_one:  # a subprocess: one world size, the result as JSON on the last line
        print(json.dumps(_worker(args)))
        return 0

    worlds = [int(w) for w in args.world.split(",") if w]
    results: dict[str, Any] = {}
    for i, world in enumerate(worlds):
        cmd = [sys.executable, os.path.abspath(__file__), "--world-one", str(world)]
        for flag in ("rounds", "warmup", "steps", "batch", "hooks", "backend_steps", "clock"):
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        cmd += ["--configs", ",".join(args.configs)] + ([] if args.armed else ["--no-armed"])
        if args.profile and i == 0:
            cmd += ["--profile", str(args.profile)]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
        *printed, last = proc.stdout.rstrip("\n").split("\n")
        if printed:
            print("\n".join(printed))
        results[str(world)] = json.loads(last)
    _table(results, args)
    if args.out:
        doc = {
            "what": "host overhead per unit per step of each phase = (FSDP's median - plain's "
            "median) / units; a whole step = forward + backward + one optimizer's step + "
            "zero_grad",
            "fake_collectives": "ms per unit per step each FSDP spent inside the fake group's "
            "collective methods (wrapped in the clock, --backend-steps steps of each "
            "configuration after the rounds); *_without_fake_collectives takes each FSDP's off "
            "its own overhead",
            "units": UNITS,
            "unit": f"Sequential(Linear({DIM}, {DIM}), GELU(), Linear({DIM}, {DIM}))",
            "batch": args.batch,
            "optimizer": {k: f"AdamW({v})" for k, v in OPTIMS.items()},
            "rounds": args.rounds,
            "steps_per_round": args.steps,
            "warmup_rounds": args.warmup,
            "threads": 1,
            "backend": "fake (FakeStore), rank 0",
            "torch": torch.__version__,
            "worlds": results,
        }
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
