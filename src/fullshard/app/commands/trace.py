"""``fullshard trace``: record a few real training steps per rank and show what FSDP did.

Each rank trains a built-in model for ``--warmup`` steps (the first forward has no prefetch
order yet), then records ``--steps`` steps with :class:`fullshard.observe.timeline.Recorder`
and :class:`fullshard.observe.memory.MemoryTracker`. Rank 0 gathers every rank's events and
writes:

- ``trace.json``: Chrome/Perfetto trace (open in https://ui.perfetto.dev or chrome://tracing),
  one process per rank, lanes compute / comm / exposed / free;
- ``trace.png``: the same timeline drawn, ranks as rows;
- ``trace_summary.json``: step time, exposed communication (time and share of the step),
  bytes per collective kind in units of the model, memory peaks per phase and category.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from fullshard import step_schedule
from fullshard.app.commands.checks import (
    at_least,
    dims_of,
    model_and_length,
    positive_seconds,
    writable_folder,
)
from fullshard.app.config import ParallelismConfig, add_config_options
from fullshard.app.dims import ParallelDims, under_torchrun
from fullshard.app.launch.local import (
    check_devices,
    forward_flags,
    launch_local,
    rank_session,
    validated_by_launcher,
)
from fullshard.app.models.gpt import build_model, count_params, lm_loss, unit_types_of
from fullshard.app.models.wrap import shard_model
from fullshard.comm import control
from fullshard.observe.memory import MemoryTracker
from fullshard.observe.plot import draw_timeline
from fullshard.observe.timeline import (
    Recorder,
    chrome_trace,
    exposed_seconds,
    gather_events,
)

__all__ = ["DESCRIPTION", "EPILOG", "HELP", "add_arguments", "run", "validate"]

HELP = "record a few training steps per rank: timeline (JSON + PNG), exposed communication"
DESCRIPTION = (
    "Train a built-in model for a few steps on N local ranks and record, per rank, every "
    "gather / compute / free / reduce-scatter / optimizer step. Writes a Chrome/Perfetto trace "
    "(trace.json), a PNG with ranks as rows (trace.png) and a summary with the exposed "
    "(non-overlapped) communication time."
)
EPILOG = None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``fullshard trace`` (every one documented in ``--help``); those it shares
    with ``fullshard train`` are train's own definitions (``add_config_options``)."""
    add_config_options(p, "model", defaults={"model": "small"})
    add_config_options(p, "strategy", "shard_size", "nproc")
    p.add_argument(
        "--batch-size", type=int, default=8, help="sequences per rank per step (default: 8)"
    )
    add_config_options(p, "seq_len")
    p.add_argument("--warmup", type=int, default=2, help="untraced steps first (default: 2)")
    p.add_argument("--steps", type=int, default=2, help="traced steps (default: 2)")
    p.add_argument("--out", default="runs/trace", help="output folder (default: runs/trace)")
    add_config_options(p, "device", "backend", "threads", "timeout")


def validate(args: argparse.Namespace, dims: ParallelDims | int) -> None:
    """Every check of ``fullshard trace`` (``dims``: the ranks it will have)."""
    dims = dims_of(dims, 1, args.strategy, args.shard_size)
    at_least(args, 1, "nproc", "batch_size", "seq_len", "steps", "threads")
    at_least(args, 0, "warmup", "shard_size")
    positive_seconds(args.timeout, "--timeout")
    model_and_length(args.model, args.seq_len, "--seq-len")
    if dims.hybrid:  # the size the ranks will choose (the engine's default when 0)
        dims.checked_shard_group()
    writable_folder(args.out, "--out")
    check_devices(args.device, args.backend, dims.local_world)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Validate and launch ``--nproc`` local ranks (once per launch: the ranks our launcher
    started do not validate again), or trace as one of them."""
    if not validated_by_launcher():
        dims = ParallelDims.from_env(args.nproc, strategy=args.strategy, shard_size=args.shard_size)
        validate(args, dims)
    if not under_torchrun():
        # Full-name flags without --nproc, which torchrun's parser would claim (see forward_flags)
        parser = argparse.ArgumentParser(allow_abbrev=False)
        add_arguments(parser)
        return launch_local(args.nproc, ["trace", *forward_flags(parser, args, exclude=("nproc",))])
    with rank_session(args.device, args.timeout, args.backend) as info:
        _trace(args, info.rank, info.world_size, info.device)
    return 0


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    lm_loss(model, x).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if x.is_cuda:  # a step's time includes its GPU work, not just the host's issuing of it
        torch.cuda.synchronize(x.device)


def _trace(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> dict[str, Any]:
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    model = build_model(args.model, 256, seed=0, device=device, lazy_weights=True)
    n_params = count_params(model)
    parallelism = ParallelismConfig(strategy=args.strategy, shard_size=args.shard_size)
    plan = shard_model(model, parallelism, unit_types_of(model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(rank)
    batches = [
        torch.randint(256, (args.batch_size, args.seq_len + 1), generator=gen).to(device)
        for _ in range(args.warmup + args.steps)
    ]
    for i in range(args.warmup):
        _step(model, opt, batches[i])
    recorder = Recorder().attach(model, opt)
    memory = MemoryTracker().attach(model, opt)
    stats = step_schedule(model).stats
    stats.reset()
    control.host_barrier(what="trace start barrier")  # every rank's clock starts together
    origin = time.perf_counter()
    step_times = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        _step(model, opt, batches[args.warmup + i])
        step_times.append(time.perf_counter() - t0)
        recorder.mark(f"step {i + 1}")
    recorder.detach()
    memory.detach()
    events = gather_events(recorder.events)
    origins = control.all_gather_objects(origin)
    exposed = exposed_seconds(recorder.events) / args.steps
    per_rank = control.all_gather_objects(
        {
            "step_s": statistics.median(step_times),
            "exposed_s": exposed,
            "memory_peaks": memory.peaks,
        }
    )
    model_bytes = n_params * 4
    summary = {
        "model": args.model,
        "params": n_params,
        "world_size": world,
        "plan": plan.summary(),
        "strategy": args.strategy,
        "steps": args.steps,
        "step_ms": 1e3 * statistics.median(r["step_s"] for r in per_rank),
        "exposed_ms": 1e3 * statistics.median(r["exposed_s"] for r in per_rank),
        "comm_per_step_in_model_units": {
            k: v / args.steps / model_bytes for k, v in dict(stats.bytes).items()
        },
        "collectives_per_step": {k: v / args.steps for k, v in dict(stats.calls).items()},
        "per_rank": per_rank,
    }
    summary["exposed_fraction"] = summary["exposed_ms"] / summary["step_ms"]
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        origin_by_rank = dict(enumerate(origins))
        (out / "trace.json").write_text(json.dumps(chrome_trace(events, origin_by_rank)))
        title = (
            f"{args.model} ({n_params / 1e6:.1f}M params), {world} ranks, {args.strategy}: "
            f"{args.steps} steps, exposed comm {100 * summary['exposed_fraction']:.1f}% of a step"
        )
        drawn = draw_timeline(events, origin_by_rank, out / "trace.png", title)
        (out / "trace_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        comm = ", ".join(f"{k} {v:.2f}" for k, v in summary["comm_per_step_in_model_units"].items())
        files = ["trace.json", *(["trace.png"] if drawn else []), "trace_summary.json"]
        print(
            f"{title}\nstep {summary['step_ms']:.1f} ms (median), exposed communication "
            f"{summary['exposed_ms']:.1f} ms; bytes per step in model units: {comm}\n"
            f"wrote {', '.join(str(out / f) for f in files)}",
            flush=True,
        )
    return summary
