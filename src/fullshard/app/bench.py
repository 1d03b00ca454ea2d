"""``fullshard bench``: each strategy side by side with torch's FSDP2, DDP and one process.

Method (DESIGN.md, "Performance method"), in two kinds of launch:

1. **Timing**, one launch of ``--nproc`` ranks holding every variant at once (same model, same
   initial weights, same batches). After ``--warmup`` untimed rounds, ``--rounds`` rounds run
   each variant for one step in turn (A B C ... A B C ...), with a barrier before every timed
   step, so that slow drifts of the machine hit every variant alike. A step's time is the slowest
   rank's (the step is done when every rank is); a variant's figure is the median over rounds.
   The ``single`` variant is one process doing one rank's batch on the whole model: rank 0 runs
   it while the other ranks wait at the next barrier (same threads, same core count per rank).
   After the rounds, untimed steps measure what timing must not pay for: bytes per collective
   kind counted at the c10d level (a dispatch mode sees every c10d op, whoever issued it), and
   for fullshard the exposed communication from its timeline ``Recorder``.
2. **Memory**, one short launch per variant (a process's peak resident set cannot be split
   between variants that share it), with ``MALLOC_MMAP_THRESHOLD_=65536`` so that freed tensors
   leave the resident set at once. Pass one: the growth of the peak resident set over a baseline
   taken after process-group init and imports (the peak is reset after wrapping, so building the
   unsharded model does not count). Pass two, on a fresh copy: the peak of live tensor storage
   from the profiler's allocator events (every variant alike), and for fullshard the
   ``MemoryTracker``'s peak by category.

``main_bench`` (outside torchrun) runs the launches and writes the report (see
:mod:`fullshard.app.bench_report`); ``run_bench_rank`` is one rank's body.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fullshard.app.launch import (
    init_distributed,
    launch_local,
    leave_together,
    under_torchrun,
)

__all__ = [
    "FULLSHARD_VARIANTS",
    "VARIANTS",
    "add_bench_arguments",
    "default_variants",
    "main_bench",
    "parse_variants",
    "run_bench_rank",
]

FULLSHARD_VARIANTS = (
    "full_shard",
    "shard_grad_op",
    "no_shard",
    "hybrid_shard",
    "hybrid_shard_zero2",
)
VARIANTS = (*FULLSHARD_VARIANTS, "fsdp2", "ddp", "single")
VOCAB = 256  # the built-in models' byte-level vocabulary
OBSERVED_STEPS = 2  # untimed fullshard steps under the Recorder, for exposed communication
MMAP_THRESHOLD = "65536"

# c10d op name -> collective kind. Bytes are the *full* buffer each collective covers: the
# all-gather output, the reduce-scatter input, the all-reduce tensor (the model-unit convention).
C10D_KINDS = {
    "_allgather_base_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "allgather_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    # fullshard's reduce-scatter on gloo (NOTE [Reduce-scatter on gloo]): same bytes
    "alltoall_base_": "all_to_all",
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "broadcast_": "broadcast",
}


def default_variants(nproc: int) -> list[str]:
    """Every fullshard strategy that makes sense at ``nproc`` ranks, FSDP2, DDP, one process."""
    names = ["full_shard", "shard_grad_op", "no_shard"]
    if nproc >= 4 and nproc % 2 == 0:
        names.append("hybrid_shard")  # a (2, nproc/2) mesh; below 4 ranks it is FULL_SHARD
    return [*names, "fsdp2", "ddp", "single"]


def parse_variants(text: str, nproc: int) -> list[str]:
    """``--variants``: a comma list (empty = :func:`default_variants`); raises ``ValueError``."""
    names = [v.strip().lower() for v in text.split(",") if v.strip()]
    if not names:
        return default_variants(nproc)
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown bench variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    hybrid = [v for v in names if v.startswith("hybrid")]
    if hybrid and (nproc < 4 or nproc % 2):
        raise ValueError(f"{hybrid} need an even --nproc of at least 4 (got {nproc})")
    return list(dict.fromkeys(names))  # drop repeats, keep order


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``fullshard bench`` (every user-facing one documented in ``--help``)."""
    p.add_argument("--model", default="small", help="built-in model size (default: small, ~10M)")
    p.add_argument("--nproc", type=int, default=2, help="local ranks to launch (default: 2)")
    p.add_argument(
        "--batch-size", type=int, default=8, help="sequences per rank per step (default: 8)"
    )
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default: 128)")
    p.add_argument(
        "--warmup", type=int, default=1, help="untimed rounds of every variant first (default: 1)"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="timed rounds; each runs every variant for one step, in turn (default: 5)",
    )
    p.add_argument(
        "--variants",
        default="",
        help="comma list from " + ", ".join(VARIANTS) + " (default: full_shard, shard_grad_op, "
        "no_shard, hybrid_shard at >= 4 ranks, fsdp2, ddp, single)",
    )
    p.add_argument("--out", default="runs/bench", help="output folder (default: runs/bench)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default: 1)")
    p.add_argument(
        "--pin-cores",
        action="store_true",
        help="pin rank r to cores [r*threads, (r+1)*threads) when the machine has enough",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=900.0,
        help="seconds any one launch may run, and any collective may wait (default: 900)",
    )
    p.add_argument(
        "--no-memory",
        action="store_true",
        help="skip the per-variant memory launches (timing and communication only)",
    )
    p.add_argument(
        "--memory-steps",
        type=int,
        default=3,
        help="training steps in each memory launch, the first included (default: 3)",
    )
    # Internal: set by main_bench for the launches it makes.
    p.add_argument("--bench-phase", default="", help=argparse.SUPPRESS)
    p.add_argument("--bench-result", default="", help=argparse.SUPPRESS)


# ----------------------------------------------------------------------------------------------
# one rank: building variants and stepping them


@dataclass
class Variant:
    """One way of training the same model on this rank (``active``: this rank takes part)."""

    name: str
    model: nn.Module
    opt: torch.optim.Optimizer
    active: bool = True


def _build(name: str, model_name: str, rank: int, world: int, device: torch.device) -> Variant:
    """The model, wrapped the way ``name`` says, and its AdamW (built after wrapping)."""
    from fullshard.app.models import build_model, unit_types_of

    model = build_model(model_name, VOCAB, seed=0, device=device)
    if name in FULLSHARD_VARIANTS:
        from fullshard.app.wrap import shard_model

        shard_model(model, name, unit_types_of(model), shard_size=world // 2)
    elif name == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        units = unit_types_of(model)
        for m in [m for m in model.modules() if m is not model and isinstance(m, units)]:
            fully_shard(m)
        fully_shard(model)
    elif name == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif name != "single":
        raise ValueError(f"unknown variant {name!r}")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return Variant(name, model, opt, active=name != "single" or rank == 0)


def _step(v: Variant, batch: torch.Tensor) -> float:
    """One training step (forward, loss, backward, optimizer); returns the loss."""
    logits = v.model(batch[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))
    loss.backward()
    v.opt.step()
    v.opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def _batches(args: argparse.Namespace, rank: int, n: int, device: torch.device) -> list[Any]:
    # Seeded by rank: every variant sees the same batches in the same order.
    gen = torch.Generator().manual_seed(1000 + rank)
    return [
        torch.randint(VOCAB, (args.batch_size, args.seq_len + 1), generator=gen).to(device)
        for _ in range(n)
    ]


class C10dCounter(TorchDispatchMode):
    """Calls and bytes of every c10d collective dispatched while active (as tests/commcount.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "c10d" and func._opname in C10D_KINDS:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            for a in args:
                if isinstance(a, (list, tuple)):
                    tensors += [t for t in a if isinstance(t, torch.Tensor)]
            if tensors:
                kind = C10D_KINDS[func._opname]
                self.calls[kind] += 1
                self.bytes[kind] += max(t.numel() * t.element_size() for t in tensors)
        return func(*args, **(kwargs or {}))


def _setup_rank(args: argparse.Namespace) -> tuple[int, int, torch.device]:
    info = init_distributed("auto", args.timeout)
    if info.device.type == "cpu":
        torch.set_num_threads(args.threads)
        cores = list(range(info.local_rank * args.threads, (info.local_rank + 1) * args.threads))
        if (
            args.pin_cores
            and hasattr(os, "sched_setaffinity")
            and max(cores) < (os.cpu_count() or 1)
        ):
            os.sched_setaffinity(0, cores)
    return info.rank, info.world_size, info.device


def _model_facts(model_name: str) -> dict[str, Any]:
    """Parameter count and the share of it in the root unit (gathered once per step, not twice)."""
    from fullshard.app.models import build_model, count_params, unit_types_of

    model = build_model(model_name, VOCAB, seed=0, device="meta")
    units = unit_types_of(model)
    in_units = {id(p) for m in model.modules() if isinstance(m, units) for p in m.parameters()}
    n = count_params(model)
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_units)
    return {"params": n, "model_bytes": 4 * n, "root_fraction": root / n}


def _time_all(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> dict:
    """The timing launch: round-robin timed steps, then counted and observed steps."""
    from fullshard.observe.timeline import Recorder, exposed_seconds, root_schedule

    names = parse_variants(args.variants, world)
    variants = [_build(n, args.model, rank, world, device) for n in names]
    batches = _batches(args, rank, args.warmup + args.rounds + 1 + OBSERVED_STEPS, device)
    for r in range(args.warmup):
        for v in variants:
            dist.barrier()
            if v.active:
                _step(v, batches[r])
    for v in variants:
        if v.name in FULLSHARD_VARIANTS:
            root_schedule(v.model).stats.reset()
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    losses: dict[str, list[float]] = {v.name: [] for v in variants}
    for r in range(args.rounds):
        batch = batches[args.warmup + r]
        for v in variants:
            # Collect now, untimed: a full collection triggered inside a step would be charged
            # to whichever variant happened to cross the threshold.
            gc.collect()
            dist.barrier()  # every rank starts the step together
            if v.active:
                t0 = time.perf_counter()
                losses[v.name].append(_step(v, batch))
                times[v.name].append(time.perf_counter() - t0)
    result: dict[str, Any] = {}
    k = args.warmup + args.rounds
    for v in variants:
        entry: dict[str, Any] = {"times_s": times[v.name], "losses": losses[v.name]}
        if v.name in FULLSHARD_VARIANTS:
            stats = root_schedule(v.model).stats
            entry["commstats_bytes"] = {kk: b / args.rounds for kk, b in stats.bytes.items()}
        dist.barrier()
        if v.active and v.name != "single":
            # The dispatch mode slows every op a little: this step is counted, never timed.
            with C10dCounter() as counter:
                _step(v, batches[k])
            entry["c10d_bytes"] = dict(counter.bytes)
            entry["c10d_calls"] = dict(counter.calls)
        if v.name in FULLSHARD_VARIANTS:
            recorder = Recorder().attach(v.model, v.opt)
            observed = []
            for i in range(OBSERVED_STEPS):
                dist.barrier()
                t0 = time.perf_counter()
                _step(v, batches[k + 1 + i])
                observed.append(time.perf_counter() - t0)
            recorder.detach()
            entry["exposed_s"] = exposed_seconds(recorder.events) / OBSERVED_STEPS
            entry["observed_step_s"] = statistics.median(observed)
        result[v.name] = entry
    per_rank: list[Any] = [None] * world
    dist.all_gather_object(per_rank, result)
    return {"world": world, "variants": names, "per_rank": per_rank}


# ----------------------------------------------------------------------------------------------
# one rank: memory


def _proc_status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS; False where unsupported."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _peak_rss_bytes() -> int:
    hwm = _proc_status_kib("VmHWM")
    if hwm is not None:
        return hwm * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _prime() -> None:
    """Touch the kernels and thread pools every variant uses, before the memory baseline, so
    one-time library state is not charged to whichever variant runs first."""
    layer = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 64))
    opt = torch.optim.AdamW(layer.parameters())
    layer(torch.randn(4, 64)).square().mean().backward()
    opt.step()


def _live_peak(prof: Any, marker: str) -> int | None:
    """Peak live tensor bytes after ``marker`` began, from the profiler's allocator events.

    The running sum starts at the profiler's start (nothing of the run was alive before it), so
    the peak is absolute: parameters, gradients, optimizer state, activations, buffers.
    """
    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if results is None:
        return None
    events = results.events()
    start = min((e.start_ns() for e in events if e.name() == marker), default=None)
    mem = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    if start is None or not mem:
        return None
    live = peak = 0
    for t, nbytes in mem:
        live += nbytes
        if t >= start:
            peak = max(peak, live)
    return peak


def _memory_one(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> dict:
    """The memory launch of one variant: RSS pass, then live-storage (and tracker) pass."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from fullshard.observe.memory import MemoryTracker

    name = parse_variants(args.variants, world)[0]
    steps = max(1, args.memory_steps)
    batches = _batches(args, rank, steps, device)
    _prime()
    gc.collect()
    baseline = (_proc_status_kib("VmRSS") or 0) * 1024
    v = _build(name, args.model, rank, world, device)
    gc.collect()
    reset = _reset_peak_rss()  # from here: training state and step transients only
    for b in batches:
        _step(v, b)
    out: dict[str, Any] = {
        "baseline_rss_bytes": baseline,
        "rss_growth_bytes": _peak_rss_bytes() - baseline,
        "rss_peak_reset": reset,
    }
    del v
    gc.collect()
    marker = "fullshard_bench_steps"
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        v = _build(name, args.model, rank, world, device)
        tracker = None
        with record_function(marker):
            for i, b in enumerate(batches):
                _step(v, b)
                if i == 0 and name in FULLSHARD_VARIANTS:
                    # attached after the first forward, which sets up the root's units
                    tracker = MemoryTracker().attach(v.model, v.opt)
    out["live_peak_bytes"] = _live_peak(prof, marker)
    if tracker is not None:
        tracker.detach()
        out["tracker_peaks"] = tracker.peaks
        out["tracker_peak_bytes"] = max(p["total"] for p in tracker.peaks.values())
    del v, tracker, prof
    per_rank: list[Any] = [None] * world
    dist.all_gather_object(per_rank, out)
    return {"world": world, "variant": name, "per_rank": per_rank}


def run_bench_rank(args: argparse.Namespace) -> int:
    """One rank's part of ``fullshard bench`` (under torchrun); returns an exit status.

    ``--bench-phase time|memory`` (set by :func:`main_bench`) runs one launch's work and rank 0
    writes its raw figures to ``--bench-result``. Without it (an external ``torchrun ... bench``)
    the rank runs the timing launch and rank 0 writes the report to ``--out`` (no memory
    figures: those need one launch per variant).
    """
    rank, world, device = _setup_rank(args)
    try:
        if args.bench_phase == "memory":
            raw = _memory_one(args, rank, world, device)
        else:
            raw = _time_all(args, rank, world, device)
        # Destroy the variants now, while the process group is alive (NOTE [Leaving together])
        leave_together()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        if args.bench_result:
            Path(args.bench_result).write_text(json.dumps(raw))
        else:
            from fullshard.app.bench_report import summarize, write_report

            summary = summarize(_config(args, world, raw["variants"]), raw, {}, {})
            print(write_report(summary, Path(args.out)), flush=True)
    return 0


# ----------------------------------------------------------------------------------------------
# the driver: launches and the report


def _rank_flags(args: argparse.Namespace, variants: list[str]) -> list[str]:
    # Full option names only: torchrun's parser would claim abbreviations such as --nproc.
    names = ("model", "batch_size", "seq_len", "warmup", "rounds", "threads", "timeout")
    flags = [f"--{n.replace('_', '-')}={getattr(args, n)}" for n in names]
    flags += [f"--memory-steps={args.memory_steps}", f"--variants={','.join(variants)}"]
    return [*flags, "--pin-cores"] if args.pin_cores else flags


def _launch(nproc: int, argv: list[str], env: dict[str, str], timeout: float) -> int:
    """``python -m fullshard.app.bench <argv>`` on ``nproc`` ranks, within ``timeout`` seconds."""
    return launch_local(nproc, argv, module="fullshard.app.bench", env=env, timeout_s=timeout)


def _rank_env(memory: bool) -> dict[str, str]:
    """The ranks' environment. Memory launches get ``MALLOC_MMAP_THRESHOLD_`` (glibc reads it at
    start-up, so only a new process can have it); timing launches keep the default allocator,
    whose reuse of freed blocks is what a training run gets."""
    env = dict(os.environ)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback: see fullshard.app.launch
    env.setdefault("OMP_NUM_THREADS", "1")  # torch's thread count is set from --threads anyway
    if memory:
        env["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD
    return env


def _config(args: argparse.Namespace, world: int, variants: list[str]) -> dict[str, Any]:
    facts = _model_facts(args.model)
    return {
        "model": args.model,
        **facts,
        "world_size": world,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "tokens_per_rank_step": args.batch_size * args.seq_len,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "memory_steps": args.memory_steps,
        "observed_steps": OBSERVED_STEPS,
        "threads": args.threads,
        "pin_cores": args.pin_cores,
        "variants": variants,
        "dtype": "float32",
        "optimizer": "AdamW",
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "memory_env": {"MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD},
    }


def main_bench(args: argparse.Namespace) -> int:
    """``fullshard bench`` outside torchrun: run the launches, write the report; exit status.

    0 when every launch succeeded; 1 when one failed (what succeeded is still reported);
    2 for bad options.
    """
    try:
        variants = parse_variants(args.variants, args.nproc)
        if min(args.nproc, args.batch_size, args.seq_len, args.rounds, args.threads) < 1:
            raise ValueError("--nproc, --batch-size, --seq-len, --rounds, --threads must be >= 1")
        _model_facts(args.model)
    except (ValueError, KeyError) as exc:
        print(f"fullshard bench: error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    flags = _rank_flags(args, variants)
    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="fullshard-bench-") as tmp:
        timing_path = Path(tmp) / "timing.json"
        argv = [*flags, "--bench-phase=time", f"--bench-result={timing_path}"]
        rc = _launch(args.nproc, argv, _rank_env(memory=False), args.timeout)
        if rc != 0 or not timing_path.exists():
            print(f"fullshard bench: the timing launch failed (status {rc})", file=sys.stderr)
            return 1
        timing = json.loads(timing_path.read_text())
        memory: dict[str, Any] = {}
        for name in [] if args.no_memory else variants:
            path = Path(tmp) / f"memory-{name}.json"
            argv = [*flags, f"--variants={name}", "--bench-phase=memory", f"--bench-result={path}"]
            nproc = 1 if name == "single" else args.nproc
            rc = _launch(nproc, argv, _rank_env(memory=True), args.timeout)
            if rc == 0 and path.exists():
                memory[name] = json.loads(path.read_text())
            else:
                failed.append(f"memory launch of {name} (status {rc})")
    from fullshard.app.bench_report import summarize, write_report

    summary = summarize(_config(args, args.nproc, variants), timing, memory, {"failed": failed})
    print(write_report(summary, out), flush=True)
    for f in failed:
        print(f"fullshard bench: {f} failed", file=sys.stderr)
    return 1 if failed else 0


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fullshard bench",
        description="Step time, tokens/s, memory and communication of each fullshard strategy "
        "side by side with torch FSDP2, DDP and one process.",
    )
    add_bench_arguments(parser)
    args = parser.parse_args(argv)
    return run_bench_rank(args) if under_torchrun() else main_bench(args)


if __name__ == "__main__":
    sys.exit(_main())
