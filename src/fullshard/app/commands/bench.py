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
   ``MemoryTracker``'s peak by category. On CUDA also the allocator's peaks
   (``max_memory_allocated`` / ``max_memory_reserved``, reset after wrapping).

Each step reports its *issue time* next to its step time (NOTE [Issue time] in
:mod:`fullshard.app.commands.bench_variants`): on CUDA a step ends with a device synchronisation, and the
issue time is taken just before it.

:func:`run` validates the options (:func:`validate`) and makes the launches (``main_bench``),
then writes the report (see :mod:`fullshard.app.commands.bench_report`); a launched rank (under
torchrun) runs one launch's work (``run_bench_rank``).
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
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fullshard import step_schedule
from fullshard.app.commands.bench_variants import (
    FULLSHARD_VARIANTS,
    VARIANTS,
    Variant,
    bench_step,
    build_variant,
    default_variants,
    finish_step,
    make_batches,
    parse_variants,
)
from fullshard.app.commands.checks import (
    at_least,
    model_and_length,
    positive_seconds,
    writable_folder,
)
from fullshard.app.config import add_config_options
from fullshard.app.errors import ConfigError
from fullshard.app.launch.local import (
    check_devices,
    forward_flags,
    init_distributed,
    launch_local,
    leave_together,
    resolve_backend,
    under_torchrun,
)
from fullshard.comm import control
from fullshard.observe.c10d_counter import C10dCounter

__all__ = [
    "DESCRIPTION",
    "EPILOG",
    "FULLSHARD_VARIANTS",
    "HELP",
    "VARIANTS",
    "add_arguments",
    "default_variants",
    "main_bench",
    "parse_variants",
    "run",
    "run_bench_rank",
    "validate",
]

HELP = "step time, tokens/s, memory and communication: fullshard strategies vs FSDP2, DDP"
DESCRIPTION = (
    "Benchmark the same model, data and ranks under each fullshard strategy, torch FSDP2, torch "
    "DDP and a single process: step time (median of alternating rounds), tokens/s, peak memory "
    "per rank, communication per step in model units, exposed communication. Writes "
    "bench.json, bench.md and bench.png."
)
EPILOG = None

OBSERVED_STEPS = 2  # untimed fullshard steps under the Recorder, for exposed communication
MMAP_THRESHOLD = "65536"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``fullshard bench`` (every user-facing one documented in ``--help``); those
    it shares with ``fullshard train`` are train's own definitions (``add_config_options``)."""
    add_config_options(p, "model", "nproc", defaults={"model": "small"})
    p.add_argument(
        "--batch-size", type=int, default=8, help="sequences per rank per step (default: 8)"
    )
    add_config_options(
        p,
        "seq_len",
        "mixed_precision",
        helps={
            "mixed_precision": "bf16: fullshard and FSDP2 compute in bfloat16 and reduce "
            "gradients in float32, DDP and single run under torch.autocast; master weights "
            "stay float32"
        },
    )
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
    add_config_options(p, "device", "backend", "threads")
    p.add_argument(
        "--pin-cores",
        action="store_true",
        help="pin rank r to cores [r*threads, (r+1)*threads) when the machine has enough",
    )
    add_config_options(
        p,
        "timeout",
        defaults={"timeout": 900.0},
        helps={"timeout": "seconds any one launch may run, and any collective may wait"},
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


def validate(args: argparse.Namespace) -> list[str]:
    """Every check of ``fullshard bench`` (outside torchrun); returns the variants to run."""
    from fullshard.app.commands.bench_variants import MIXED_PRECISION

    if args.mixed_precision not in MIXED_PRECISION:
        raise ConfigError(
            f"--mixed-precision {args.mixed_precision}: bench compares "
            f"{' and '.join(MIXED_PRECISION)} (fp16 needs loss scaling, which not every variant "
            "has): use one of those"
        )
    at_least(args, 1, "nproc", "batch_size", "seq_len", "rounds", "threads", "memory_steps")
    at_least(args, 0, "warmup")
    try:
        variants = parse_variants(args.variants, args.nproc)
    except ValueError as exc:
        raise ConfigError(f"--variants {args.variants}: {exc}") from None
    positive_seconds(args.timeout, "--timeout")
    model_and_length(args.model, args.seq_len, "--seq-len")
    writable_folder(args.out, "--out")
    check_devices(args.device, args.backend, args.nproc)
    return variants


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """The launches and the report (outside torchrun), or one launched rank's work."""
    if under_torchrun():  # one of the launches main_bench makes, with options it checked
        return run_bench_rank(args)
    return main_bench(args)


# ----------------------------------------------------------------------------------------------
# one rank: timing


def _setup_rank(args: argparse.Namespace) -> tuple[int, int, torch.device]:
    info = init_distributed(args.device, args.timeout, args.backend)
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
    from fullshard.app.models.gpt import build_model, count_params, unit_types_of
    from fullshard.engine.sharding import plan_sharding

    model = build_model(model_name, 256, seed=0, device="meta")
    plan = plan_sharding(model, "full_shard", unit_types_of(model), world_size=1)
    n = count_params(model)
    root = plan.units[0].numel
    return {"params": n, "model_bytes": 4 * n, "root_fraction": root / n}


def _build_all(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> list:
    names = parse_variants(args.variants, world)
    return [build_variant(n, args.model, rank, world, device, args.mixed_precision) for n in names]


def _timed_step(v: Variant, batch: torch.Tensor, device: torch.device) -> tuple[float, float]:
    """``(step seconds, issue seconds)`` of one step, the device's work included."""
    t0 = time.perf_counter()
    loss, issued = bench_step(v, batch)
    finish_step(device)
    end = time.perf_counter()
    v.last_loss = float(loss)  # read after the synchronisation: costs no device wait
    return end - t0, issued - t0


def _time_all(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> dict:
    """The timing launch: round-robin timed steps, then counted and observed steps."""
    from fullshard.observe.timeline import Recorder, exposed_seconds

    variants = _build_all(args, rank, world, device)
    names = [v.name for v in variants]
    n_batches = args.warmup + args.rounds + 1 + OBSERVED_STEPS
    batches = make_batches(args.batch_size, args.seq_len, rank, n_batches, device)
    for r in range(args.warmup):
        for v in variants:
            control.host_barrier(what="bench warm-up barrier")
            if v.active:
                _timed_step(v, batches[r], device)
    for v in variants:
        if v.name in FULLSHARD_VARIANTS:
            step_schedule(v.model).stats.reset()
    times: dict[str, list[float]] = {n: [] for n in names}
    issue: dict[str, list[float]] = {n: [] for n in names}
    losses: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        batch = batches[args.warmup + r]
        for v in variants:
            # Collect now, untimed: a full collection triggered inside a step would be charged
            # to whichever variant happened to cross the threshold.
            gc.collect()
            control.host_barrier(what="bench step barrier")  # every rank starts together
            if v.active:
                step_s, issue_s = _timed_step(v, batch, device)
                times[v.name].append(step_s)
                issue[v.name].append(issue_s)
                losses[v.name].append(v.last_loss)
    result: dict[str, Any] = {}
    k = args.warmup + args.rounds
    for v in variants:
        entry: dict[str, Any] = {
            "times_s": times[v.name],
            "issue_s": issue[v.name],
            "losses": losses[v.name],
        }
        if v.name in FULLSHARD_VARIANTS:
            stats = step_schedule(v.model).stats
            entry["commstats_bytes"] = {kk: b / args.rounds for kk, b in stats.bytes.items()}
        control.host_barrier(what="bench count barrier")
        if v.active and v.name != "single":
            # The dispatch mode slows every op a little: this step is counted, never timed.
            with C10dCounter(known_only=True) as counter:
                _timed_step(v, batches[k], device)
            entry["c10d_bytes"] = dict(counter.bytes)
            entry["c10d_calls"] = dict(counter.calls)
        if v.name in FULLSHARD_VARIANTS:
            recorder = Recorder().attach(v.model, v.opt)
            observed = []
            for i in range(OBSERVED_STEPS):
                control.host_barrier(what="bench observed-step barrier")
                observed.append(_timed_step(v, batches[k + 1 + i], device)[0])
            recorder.detach()
            entry["exposed_s"] = exposed_seconds(recorder.events) / OBSERVED_STEPS
            entry["observed_step_s"] = statistics.median(observed)
        result[v.name] = entry
    per_rank = control.all_gather_objects(result)
    return {"world": world, "variants": names, "per_rank": per_rank}


# ----------------------------------------------------------------------------------------------
# one rank: memory


def _prime() -> None:
    """Touch the kernels and thread pools every variant uses, and import the code that builds
    each, before the memory baseline, so one-time library state is not charged to whichever
    variant runs first: torch's FSDP2 is imported with ``torch.distributed`` here already,
    fullshard's engine only when a variant first shards (ten modules, about 2 MiB of RSS
    growth that were charged to fullshard's variants alone before issue 45)."""
    import torch.distributed.fsdp  # noqa: F401

    import fullshard.app.models.hf  # noqa: F401  (what shard_model loads weights with)
    import fullshard.app.models.wrap  # noqa: F401  (fully_shard, apply_plan and what they use)

    layer = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 64))
    opt = torch.optim.AdamW(layer.parameters())
    layer(torch.randn(4, 64)).square().mean().backward()
    opt.step()


def _memory_one(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> dict:
    """The memory launch of one variant: RSS pass, then live-storage (and tracker) pass."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from fullshard.observe.memory import MemoryTracker, profiler_live_peak
    from fullshard.observe.rss import peak_rss_bytes, reset_peak_rss, rss_bytes

    name = parse_variants(args.variants, world)[0]
    steps = max(1, args.memory_steps)
    batches = make_batches(args.batch_size, args.seq_len, rank, steps, device)
    _prime()
    gc.collect()
    baseline = rss_bytes()
    v = build_variant(name, args.model, rank, world, device, args.mixed_precision)
    gc.collect()
    if device.type == "cuda":
        # The unsharded model built before wrapping is gone; so is its cached block.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    reset = reset_peak_rss()  # from here: training state and step transients only
    for b in batches:
        bench_step(v, b)
        finish_step(device)
    out: dict[str, Any] = {
        "baseline_rss_bytes": baseline,
        "rss_growth_bytes": peak_rss_bytes() - baseline,
        "rss_peak_reset": reset,
    }
    if device.type == "cuda":
        out["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        out["cuda_max_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    del v
    gc.collect()
    marker = "fullshard_bench_steps"
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        v = build_variant(name, args.model, rank, world, device, args.mixed_precision)
        tracker = None
        with record_function(marker):
            for i, b in enumerate(batches):
                bench_step(v, b)
                finish_step(device)
                if i == 0 and name in FULLSHARD_VARIANTS:
                    # attached after the first forward, which sets up the root's units
                    tracker = MemoryTracker().attach(v.model, v.opt)
    out["live_peak_bytes"] = profiler_live_peak(prof, marker)
    if tracker is not None:
        tracker.detach()
        out["tracker_peaks"] = tracker.peaks
        out["tracker_peak_bytes"] = max(p["total"] for p in tracker.peaks.values())
    del v, tracker, prof
    per_rank = control.all_gather_objects(out)
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
            from fullshard.app.commands.bench_report import summarize, write_report

            summary = summarize(_config(args, world, raw["variants"]), raw, {}, {})
            print(write_report(summary, Path(args.out)), flush=True)
    return 0


# ----------------------------------------------------------------------------------------------
# the driver: launches and the report


def _rank_flags(args: argparse.Namespace, variants: list[str]) -> list[str]:
    # Full option names, no --nproc (torchrun's parser would claim it: see forward_flags).
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_arguments(parser)
    skip = ("nproc", "variants", "out", "no_memory", "bench_phase", "bench_result")
    return [*forward_flags(parser, args, exclude=skip), f"--variants={','.join(variants)}"]


def _launch(nproc: int, argv: list[str], memory: bool, timeout: float) -> int:
    """``fullshard bench <argv>`` on ``nproc`` ranks, within ``timeout`` seconds.

    Memory launches start new interpreters (the malloc settings of :func:`_rank_env` are read at
    process start); the timing launch forks its ranks (NOTE [Ranks from a forkserver])."""
    return launch_local(
        nproc,
        ["bench", *argv],
        env=_rank_env(memory),
        timeout_s=timeout,
        fresh_interpreters=memory,
    )


def _rank_env(memory: bool) -> dict[str, str]:
    """The ranks' environment. Memory launches get ``MALLOC_MMAP_THRESHOLD_`` (glibc reads it at
    start-up, so only a new process can have it); timing launches keep the default allocator,
    whose reuse of freed blocks is what a training run gets."""
    env = dict(os.environ)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback: see fullshard.app.launch.local
    env.setdefault("OMP_NUM_THREADS", "1")  # torch's thread count is set from --threads anyway
    if memory:
        env["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD
    return env


def _config(args: argparse.Namespace, world: int, variants: list[str]) -> dict[str, Any]:
    facts = _model_facts(args.model)
    device_type, backend = resolve_backend(args.device, args.backend)
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
        # the compute dtype; master weights and optimizer state are float32 in every variant
        "dtype": "bfloat16" if args.mixed_precision == "bf16" else "float32",
        "master_dtype": "float32",
        "mixed_precision": args.mixed_precision,
        "device": device_type,
        "backend": backend,
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
        variants = validate(args)  # raises ConfigError, a ValueError
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
        rc = _launch(args.nproc, argv, False, args.timeout)
        if rc != 0 or not timing_path.exists():
            print(f"fullshard bench: the timing launch failed (status {rc})", file=sys.stderr)
            return 1
        timing = json.loads(timing_path.read_text())
        memory: dict[str, Any] = {}
        for name in [] if args.no_memory else variants:
            path = Path(tmp) / f"memory-{name}.json"
            argv = [*flags, f"--variants={name}", "--bench-phase=memory", f"--bench-result={path}"]
            nproc = 1 if name == "single" else args.nproc
            rc = _launch(nproc, argv, True, args.timeout)
            if rc == 0 and path.exists():
                memory[name] = json.loads(path.read_text())
            else:
                failed.append(f"memory launch of {name} (status {rc})")
    from fullshard.app.commands.bench_report import summarize, write_report

    summary = summarize(_config(args, args.nproc, variants), timing, memory, {"failed": failed})
    print(write_report(summary, out), flush=True)
    for f in failed:
        print(f"fullshard bench: {f} failed", file=sys.stderr)
    return 1 if failed else 0
