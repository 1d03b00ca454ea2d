"""The CUDA-path checks of the GPU checks (``gpu_check.py``) (issue 21), and the subprocess two of them run.

- ``<group>.bf16_offload``, in a group's spawned ranks (``run_rank``, as ``gpu_check_ranks``):
  bf16 parameters *and* reduce (``MixedPrecisionPolicy(param_dtype=bf16)``, no ``reduce_dtype``)
  with ``CPUOffloadPolicy()`` (pinned), the case where a gradient cast on the host from a pinned
  buffer the GPU had not yet written comes out as zeros, garbage or the last step's. Each of 4
  steps compares every rank's gradient shard (a) with a one-process reference fed every rank's
  batch through the same bf16 computation (the model's own weights, cast to bf16; the ranks'
  bf16 gradients summed in bf16, divided by the world), relative L2 error per parameter under
  ``BF16_TOL``; and (b) with the same run without offload: bitwise equal at the first step (the
  only difference is where the gradient lives), within ``BF16_TOL`` after it (the offloaded
  optimizer steps on the CPU, whose rounding may differ from the GPU's by an ulp).
- ``csan.<group>``: two steps (the first initialises) of every strategy, and of bf16 with CPU
  offload, in the group's spawned ranks under torch's CUDA sanitizer (``TORCH_CUDA_SANITIZER=1``,
  ``torch.cuda._sanitizer``), all inside one subprocess (``python gpu_checks_cuda.py csan``)
  bounded by a timeout: a PASS needs exit status 0 and no "CSAN" report in its output
  (``csan_verdict``). The sanitizer needs CUDA; on CPU the same steps run without it.
- ``fake8.steps`` / ``fake8.no_host_sync``: one process plays rank 3 of 8 on torch's fake
  process group with the model on CUDA (``python gpu_checks_cuda.py fake``), 4 steps of every
  strategy and of bf16 with CPU offload. The third step is the quiet one: torch's GPU trace
  (the sanitizer's callbacks) counts event records and waits per stream and every stream, event
  and device synchronisation, and ``torch.cuda.set_sync_debug_mode("warn")`` flags synchronising
  calls. ``steps`` needs every configuration to run, events on a stream other than compute's,
  and collectives ordered by stream (NCCL's path) rather than waited on the host;
  ``no_host_sync`` needs zero synchronisations (``fake_verdicts``). On CPU ``steps`` runs the
  steps alone and ``no_host_sync`` is a SKIP.

The spawn of a group's ranks and the merge of their verdicts (``run_group``, ``merge``) live
here too, not in the driver: the csan child runs a group itself, and ``gpu_check.py`` imports
this module, so this module imports nothing of the driver's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
for _p in (str(SRC), str(HERE)):  # this checkout's fullshard, and gpu_check_ranks
    if _p not in sys.path:
        sys.path.insert(0, _p)

import gpu_check_ranks as ranks  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from fullshard import CPUOffloadPolicy, MixedPrecisionPolicy, clip_grad_norm_  # noqa: E402
from fullshard.app.models.gpt import lm_loss  # noqa: E402

BF16_OFFLOAD = "bf16_offload"
BF16_STEPS = 4
# relative L2 error of a gradient shard: bf16 keeps 8 significant bits (rounding ~4e-3 per
# element); a gradient read before it landed (zeros, garbage, the last step's) is off by ~1
BF16_TOL = 2e-2
STEPS = 2  # per configuration under the sanitizer: the first initialises, the second is steady
FAKE_STEPS, QUIET_STEP = 4, 2  # the third step is the one watched for host synchronisations
FAKE_RANK = 3  # of FAKE_WORLD: not rank 0, with uneven and empty shards of the odd shapes
FAKE_CHECKS = ("steps", "no_host_sync")
RankCheck = Callable[[int, int, torch.device], tuple[bool, str]]
Result = tuple[str, "bool | None", str, float]  # name, ok (None: skipped), info, seconds


def step_configs(world: int) -> list[str]:
    """Every strategy that means something at ``world`` ranks, then bf16 with CPU offload."""
    return [*ranks.strategies_for(world), BF16_OFFLOAD]


def _config(name: str) -> tuple[str, dict[str, Any]]:
    """``(strategy, parallelize keywords)`` of a configuration of ``step_configs``."""
    if name == BF16_OFFLOAD:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)  # reduce dtype: bf16 too
        return "full_shard", {"mp_policy": policy, "offload_policy": CPUOffloadPolicy()}
    return name, {}


def _build(config: str, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    strategy, kw = _config(config)
    torch.manual_seed(0)
    model = ranks._shard(ranks.Net().to(device), strategy, device, **kw)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model: nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor) -> torch.Tensor:
    """One training step as the trainer takes it, reading nothing back to the host."""
    loss = lm_loss(model, batch)
    loss.backward()
    clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    return loss.detach()


# ---- bf16 reduce with CPU offload ---------------------------------------------------------


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative L2 error of ``got`` (absolute where ``want`` is all zeros)."""
    want = want.float()
    diff = (got.float().to(want.device) - want).norm().item()
    norm = want.norm().item()
    return diff / norm if norm > 0 else diff


def _rows(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s rows of a ``Shard(0)`` DTensor of ``full`` (torch.chunk's layout)."""
    per = -(-full.shape[0] // world)
    return full[rank * per : (rank + 1) * per]


def _local_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's gradient shard of every parameter (a copy: buffers may be reused)."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            raise AssertionError(f"no gradient for {name}")
        g = p.grad
        out[name] = (g.to_local() if hasattr(g, "to_local") else g).detach().clone()
    return out


def _reference_grads(
    low: nn.Module, params: dict[str, torch.Tensor], batches: list[torch.Tensor], world: int
) -> dict[str, torch.Tensor]:
    """One process's gradients at ``params`` computed as the bf16 run computes them: weights
    rounded to bf16, every rank's batch, the ranks' bf16 gradients summed in bf16 (autograd
    accumulates into the bf16 ``.grad``), divided by the world size."""
    low.load_state_dict(params)  # fp32 into bf16 parameters: rounds as the unit's cast does
    low.zero_grad(set_to_none=True)
    for batch in batches:
        lm_loss(low, batch).backward()
    return {n: p.grad.float() / world for n, p in low.named_parameters() if p.grad is not None}


def _bf16_offload(rank: int, world: int, device: torch.device) -> tuple[bool, str]:
    strategy, kw = _config(BF16_OFFLOAD)
    on_device = {k: v for k, v in kw.items() if k != "offload_policy"}  # the same, not offloaded
    models: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {}
    for key, kws in (("offloaded", kw), ("on device", on_device)):
        torch.manual_seed(0)
        model = ranks._shard(ranks.Net().to(device), strategy, device, **kws)
        models[key] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    on = models["on device"][0]
    low = ranks.Net().to(device).to(torch.bfloat16)  # the reference: loaded from `on` each step
    data = ranks._data(world, BF16_STEPS, device)
    worst = dict.fromkeys(models, 0.0)
    pair, bitwise, where, losses = 0.0, [], set(), []
    for step in range(BF16_STEPS):
        ref = _reference_grads(low, ranks._full_params(on), data[step], world)
        grads = {}
        for key, (model, opt) in models.items():
            loss = lm_loss(model, data[step][rank])
            loss.backward()
            grads[key] = _local_grads(model)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        for key, got in grads.items():
            for name, g in got.items():
                want = _rows(ref[name], rank, world)
                if g.shape != want.shape:
                    return False, f"{key} {name}: local gradient {tuple(g.shape)}, expected rows "
                    f"{tuple(want.shape)} of {tuple(ref[name].shape)} (not torch.chunk's layout?)"
                worst[key] = max(worst[key], _rel(g, want))
        off, dev = grads["offloaded"], grads["on device"]
        where |= {g.device.type for g in off.values()}
        bitwise.append(all(torch.equal(off[n].to(dev[n].device), dev[n]) for n in dev))
        pair = max(pair, *(_rel(off[n], dev[n]) for n in dev))
    ok = max(worst.values()) < BF16_TOL and bitwise[0] and pair < BF16_TOL and where == {"cpu"}
    ok = ok and all(math.isfinite(x) for x in losses)
    same = [i + 1 for i, b in enumerate(bitwise) if b]
    return ok, (
        f"bf16 params and reduce, {BF16_STEPS} steps; gradient error against a bf16 reference: "
        f"offloaded {worst['offloaded']:.1e}, on device {worst['on device']:.1e} (tolerance "
        f"{BF16_TOL:.0e}); offloaded against on device: bitwise equal at steps {same}, max "
        f"{pair:.1e}; offloaded gradients on {sorted(where)}"
    )


# ---- the group's ranks --------------------------------------------------------------------


def _steps_check(config: str) -> RankCheck:
    def check(rank: int, world: int, device: torch.device) -> tuple[bool, str]:
        model, opt = _build(config, device)
        data = ranks._data(world, STEPS, device)
        for step in range(STEPS):
            loss = _step(model, opt, data[step][rank])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        value = loss.item()
        return math.isfinite(value), f"{STEPS} steps, last loss {value:.3f}"

    return check


def _check(name: str) -> RankCheck:
    if name == BF16_OFFLOAD:
        return _bf16_offload
    if name.startswith("step."):
        return _steps_check(name.split(".", 1)[1])
    raise KeyError(name)


def run_rank(
    rank: int,
    world: int,
    backend: str,
    device_type: str,
    store_path: str,
    out_path: str,
    names: list[str],
    timeout_s: float,
) -> None:
    """``gpu_check_ranks.run_group_rank`` for this module's checks (a group's spawn target)."""
    ranks.run_group_rank(
        rank, world, backend, device_type, store_path, out_path, names, timeout_s, lookup=_check
    )


# ---- a group of spawned ranks (gpu_check.py's groups and the csan child's) -----------------

GROUP_TIMEOUT_S = 360.0  # one spawned group, all its checks
COLLECTIVE_TIMEOUT_S = 120.0  # any one wait inside a group (a dead peer fails, never hangs)


def run_group(
    backend: str,
    device_type: str,
    world: int,
    checks: list[str],
    work: Path,
    deadline: float,
    *,
    target: Callable[..., None] = ranks.run_group_rank,
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
) -> list[tuple[str, bool, str, float]]:
    """Spawn the group's ranks, wait (bounded), merge their verdicts (all ranks must pass).
    ``target``: the ranks' function (``gpu_check_ranks``'s, or ``gpu_checks_cuda.run_rank``)."""
    prefix = f"{backend}{world}."
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=work))
    outs = [str(folder / f"rank{r}.json") for r in range(world)]
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=target,
            args=(
                r,
                world,
                backend,
                device_type,
                str(folder / "store"),
                outs[r],
                checks,
                collective_timeout_s,
            ),
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = min(deadline, time.monotonic() + GROUP_TIMEOUT_S)
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    late = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    per_rank = [json.loads(Path(o).read_text()) if Path(o).is_file() else [] for o in outs]
    return merge(prefix, checks, per_rank, late)


def merge(
    prefix: str, checks: list[str], per_rank: list[list[dict[str, Any]]], late: list[int]
) -> list[tuple[str, bool, str, float]]:
    """One verdict per check from every rank's: a PASS needs every rank's; a FAIL names the
    ranks that failed or never reported (``late``: ranks killed at the time limit)."""
    results = []
    for name in checks:
        got = [next((v for v in vs if v["name"] == name), None) for vs in per_rank]
        ok = all(v is not None and v["ok"] for v in got)
        info = got[0]["info"] if got[0] is not None else "not run"
        bad = [
            f"rank {r}: {v['info'] if v else 'not run'}"
            for r, v in enumerate(got)
            if v is None or not v["ok"]
        ]
        if bad:
            info = "; ".join(bad[:2]) + (f"; ranks {late} killed at the time limit" if late else "")
        results.append((prefix + name, ok, info, max((v["s"] for v in got if v), default=0.0)))
    return results


# ---- torch's CUDA sanitizer ---------------------------------------------------------------

CSAN_MARK = "CSAN detected"


def csan_excerpt(output: str) -> str:
    """The first CSAN report in ``output``, in one line: the race, both accesses (stream, op,
    read/write) and the innermost fullshard frame of each access's stack."""
    lines = output.splitlines()
    start = next((i for i, line in enumerate(lines) if CSAN_MARK in line), None)
    if start is None:
        return ""
    end = next(
        (i for i in range(start + 1, len(lines)) if CSAN_MARK in lines[i] or "====" in lines[i]),
        len(lines),
    )
    block = lines[start:end]
    picks = [block[0].strip()]
    heads = [i for i, line in enumerate(block) if "access by stream" in line.lower()]
    alloc = next(
        (i for i, ln in enumerate(block) if "allocat" in ln and "trace" in ln.lower()), None
    )
    for k, i in enumerate(heads):
        picks += [line.strip() for line in block[i : i + 3]]
        stop = heads[k + 1] if k + 1 < len(heads) else (alloc or len(block))
        frames = [ln.strip() for ln in block[i:stop] if ln.strip().startswith("File ")]
        ours = [f for f in frames if f"{os.sep}fullshard{os.sep}" in f]
        if ours or frames:
            picks.append("innermost: " + (ours or frames)[-1])
    return " | ".join(picks)[:900]


def csan_verdict(
    returncode: int, output: str, results: list[list[Any]], sanitized: bool
) -> tuple[bool, str]:
    """PASS: exit status 0, every configuration's verdict a pass, no CSAN report in the output.
    ``results``: the group's merged verdicts, ``[name, ok, info, seconds]`` each."""
    reports = output.count(CSAN_MARK)
    failed = [f"{r[0]}: {r[2]}" for r in results if not r[1]]
    if reports:
        first = f"; {failed[0][:300]}" if failed else ""
        return False, f"{reports} CSAN report(s), the first: {csan_excerpt(output)}{first}"
    if returncode != 0 or failed or not results:
        tail = " | ".join(line[:200] for line in output.strip().splitlines()[-3:])
        return False, f"exit status {returncode}: " + ("; ".join(failed[:2]) or tail)
    configs = ", ".join(r[0].split(".step.", 1)[-1] for r in results)
    how = (
        "under TORCH_CUDA_SANITIZER=1: no CSAN report"
        if sanitized
        else "CPU form: the sanitizer needs CUDA, so these ran without it"
    )
    return True, f"{STEPS} steps each of {configs}, {how}"


def _csan_main(args: argparse.Namespace) -> int:
    from gpu_checks_cuda import run_rank as target  # by module name, for the spawn's pickle

    if args.device == "cuda":
        # read at `import torch`: the ranks' (this process imported torch without it, so it
        # tracks nothing itself and opens no CUDA context)
        os.environ["TORCH_CUDA_SANITIZER"] = "1"
    names = [f"step.{c}" for c in step_configs(args.world)]
    work = Path(tempfile.mkdtemp(prefix="csan-", dir=args.work))
    results = run_group(
        args.backend,
        args.device,
        args.world,
        names,
        work,
        time.monotonic() + args.timeout,
        target=target,
        collective_timeout_s=60.0,
    )
    Path(args.out).write_text(json.dumps(results))
    return 0 if results and all(r[1] for r in results) else 1


# ---- the fake process group at world 8 ----------------------------------------------------


class SyncWatch:
    """What a quiet step asks of the GPU: event records and waits per stream, and every stream,
    event and device synchronisation (torch's GPU trace, the sanitizer's source) with the
    innermost fullshard frame; and what ``set_sync_debug_mode("warn")`` flags."""

    def __init__(self) -> None:
        self.on = False
        self.streams: dict[int, int] = {}  # stream -> event records and waits on it
        self.syncs: list[str] = []
        self.flags: list[str] = []
        self.compute = 0
        self.traced = hasattr(torch._C, "_activate_gpu_trace")
        if self.traced:
            from torch.cuda import _gpu_trace as trace

            torch._C._activate_gpu_trace()
            trace.register_callback_for_event_record(lambda _e, s: self._stream(s))
            trace.register_callback_for_event_wait(lambda _e, s: self._stream(s))
            trace.register_callback_for_stream_synchronization(lambda _s: self._sync("stream"))
            trace.register_callback_for_event_synchronization(lambda _e: self._sync("event"))
            trace.register_callback_for_device_synchronization(lambda: self._sync("device"))

    def _stream(self, stream: int) -> None:
        if self.on:
            self.streams[stream] = self.streams.get(stream, 0) + 1

    def _sync(self, kind: str) -> None:
        if self.on:
            frames = traceback.extract_stack()[:-2]  # less this frame and the callback's
            ours = [f for f in frames if f"{os.sep}fullshard{os.sep}" in f.filename]
            outside = [f for f in frames if f"{os.sep}torch{os.sep}" not in f.filename]
            pick = ours or outside or frames
            f = pick[-1] if pick else None
            site = f"{f.filename.rsplit(os.sep, 2)[-1]}:{f.lineno} {f.name}" if f else "?"
            self.syncs.append(f"{kind} synchronize at {site}")

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        torch.cuda.synchronize()  # what came before is not this step's
        self.streams, self.syncs, self.flags = {}, [], []
        self.compute = torch.cuda.current_stream().cuda_stream
        before = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            self.on = True
            try:
                yield
            finally:
                self.on = False
                torch.cuda.set_sync_debug_mode(before)
        for w in caught:
            if "synchroniz" in str(w.message):
                where = f"{w.filename.rsplit(os.sep, 2)[-1]}:{w.lineno}"
                self.flags.append(f"{str(w.message).splitlines()[0][:80]} at {where}")

    def summary(self) -> dict[str, Any]:
        side = {s: n for s, n in self.streams.items() if s != self.compute}
        return {
            "side_streams": len(side),
            "events": sum(self.streams.values()),
            "syncs": self.syncs,
            "flags": self.flags,
        }


def _collective_path(device: torch.device) -> str:
    """How the engine orders a collective on ``device`` over the default group: "stream"
    (NCCL's: the stream waits), "host" (gloo's: the host waits) or "unknown"."""
    try:
        from fullshard.comm import collectives

        probe = collectives._host_wait
    except (ImportError, AttributeError):
        return "unknown"
    return "host" if probe(torch.empty(1, device=device), None) else "stream"


def _unit_streams(model: nn.Module) -> bool | None:
    """Whether the root unit holds a gather and a reduce stream (None: not found)."""
    unit = getattr(getattr(model, "_fullshard_state", None), "unit", None)
    streams = getattr(unit, "streams", None)
    if streams is None:
        return None
    return getattr(streams, "gather", None) is not None and streams.reduce is not None


def _fake_run(config: str, device: torch.device, watch: SyncWatch | None) -> dict[str, Any]:
    model, opt = _build(config, device)
    data = ranks._data(1, FAKE_STEPS, device)  # one batch per step: this rank's
    out: dict[str, Any] = {}
    for step in range(FAKE_STEPS):
        quiet = watch is not None and step == QUIET_STEP
        with watch.quiet() if quiet and watch else contextlib.nullcontext():
            _step(model, opt, data[step][0])
        if quiet and watch:
            out.update(watch.summary())
    out["unit_streams"] = _unit_streams(model)
    out["shards"] = str(next(model.parameters()).device)
    return out


def fake_checks(device_type: str, world: int, rank: int) -> list[Result]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    t0 = time.perf_counter()
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    watch = SyncWatch() if device.type == "cuda" else None
    runs: dict[str, dict[str, Any]] = {}
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        path = _collective_path(device)
        for config in step_configs(world):
            try:
                runs[config] = _fake_run(config, device, watch)
            except Exception:
                runs[config] = {"error": traceback.format_exc().strip().splitlines()[-1][:300]}
    finally:
        dist.destroy_process_group()
    traced = watch is not None and watch.traced
    seconds = time.perf_counter() - t0
    return [(*v, seconds) for v in fake_verdicts(runs, device.type, rank, world, path, traced)]


def fake_verdicts(
    runs: dict[str, dict[str, Any]],
    device_type: str,
    rank: int,
    world: int,
    path: str,
    traced: bool,
) -> list[tuple[str, bool | None, str]]:
    """``fake<world>.steps`` and ``fake<world>.no_host_sync`` from each configuration's run."""
    prefix = f"fake{world}."
    errors = [f"{c}: {r['error']}" for c, r in runs.items() if "error" in r]
    where = f"rank {rank} of {world} on the fake group, {device_type}"
    if device_type != "cuda":
        ok = bool(runs) and not errors
        info = "; ".join(errors[:2]) or (
            f"CPU form: {where}, {FAKE_STEPS} steps each of {', '.join(runs)} (streams and host "
            "synchronisations need CUDA)"
        )
        return [(prefix + "steps", ok, info), (prefix + "no_host_sync", None, "needs CUDA")]
    ran = {c: r for c, r in runs.items() if "error" not in r}
    no_side = [c for c, r in ran.items() if r["side_streams"] == 0]
    # the root unit's gather and reduce streams (None where the engine keeps them elsewhere)
    no_streams = [c for c, r in ran.items() if r.get("unit_streams") is False]
    steps_ok = bool(ran) and not errors and not no_side and not no_streams
    steps_ok = steps_ok and traced and path != "host"
    paths = {
        "stream": "collectives ordered by stream (NCCL's path)",
        "host": "collectives waited on the host: gloo's path, not NCCL's (fullshard.comm."
        "collectives._host_wait orders only NCCL by stream)",
        "unknown": "the collectives' path not found",
    }
    events = ", ".join(
        f"{c} {r['events']} ({r['side_streams']} side stream(s))" for c, r in ran.items()
    )
    steps_info = "; ".join(errors[:2]) or (
        f"{where}: {FAKE_STEPS} steps each; the quiet step's event records and waits: "
        f"{events}; {paths[path]}"
        + (f"; no side stream in {no_side}" if no_side else "")
        + (f"; no gather/reduce streams in the root unit of {no_streams}" if no_streams else "")
        + ("" if traced else "; torch._C._activate_gpu_trace missing: nothing traced")
    )
    dirty = {c: r["syncs"] + r["flags"] for c, r in ran.items() if r["syncs"] or r["flags"]}
    sync_ok = bool(ran) and not errors and not dirty and traced
    if dirty:
        sync_info = "; ".join(
            f"{c}: {len(r['syncs'])} traced, {len(r['flags'])} flagged, first {d[0]}"
            for c, d in list(dirty.items())[:3]
            for r in (ran[c],)
        )
    else:
        sync_info = "; ".join(errors[:1]) or (
            f"quiet step (step {QUIET_STEP + 1} of {FAKE_STEPS}) of {', '.join(ran)}: 0 stream, "
            "event or device synchronisations traced, 0 flagged by sync debug mode 'warn'"
        )
    return [(prefix + "steps", steps_ok, steps_info), (prefix + "no_host_sync", sync_ok, sync_info)]


def _fake_main(args: argparse.Namespace) -> int:
    results = fake_checks(args.device, args.world, FAKE_RANK)
    Path(args.out).write_text(json.dumps(results))
    return 0 if all(r[1] is not False for r in results) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description="the subprocess of gpu_check.py's csan/fake checks")
    ap.add_argument("what", choices=("csan", "fake"))
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--backend", default="gloo", help="csan: the group's backend")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--out", required=True, help="where the verdicts go (JSON)")
    ap.add_argument("--work", default=None, help="csan: scratch folder for the group")
    ap.add_argument("--timeout", type=float, default=200.0, help="csan: the group's time limit")
    args = ap.parse_args()
    return _csan_main(args) if args.what == "csan" else _fake_main(args)


if __name__ == "__main__":
    sys.exit(main())
