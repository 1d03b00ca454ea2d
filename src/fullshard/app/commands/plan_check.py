"""``fullshard plan --check``: run the planned model and print predicted vs measured peaks and
step time.

Each rank builds the model, shards it with the planned strategy and activation checkpointing,
trains ``--check-steps`` steps (fp32 AdamW, random tokens, the planned batch and sequence) with
:class:`fullshard.observe.memory.MemoryTracker` attached and the profiler recording every
allocation, then ``--check-steps`` more with both off, timed; rank 0 prints, per phase and
category, the planner's prediction next to the tracker's peak (the worst rank), the planned peak
next to the peak of every live storage (the profiler: transients the tracker cannot see
included), each rank's peak resident-set growth for reference, and the predicted step time next
to the measured one (the slowest rank's median).
The step time is predicted on ``--gpu``: on a CPU, a file ``fullshard plan --calibrate`` wrote
for this machine (a GPU preset describes another machine, and is not compared).

The tracker sees what the engine and the optimizer hold; the planner's ``other`` (foreach
optimizer temporaries, the loss's transient beyond what it saves) is outside it, so the totals
compared are the planner's ``tracked`` peaks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from typing import Any

import torch

from fullshard.app.commands.plan_measure import measure_device
from fullshard.app.config import ParallelismConfig
from fullshard.app.launch.local import rank_session, resolve_backend
from fullshard.app.models.gpt import build_model, lm_loss, unit_types_of
from fullshard.app.models.planning import model_vocab, plan_builtin
from fullshard.app.models.wrap import shard_model
from fullshard.comm import control
from fullshard.observe.memory import MemoryTracker, profiler_live_peak
from fullshard.observe.rss import rss_bytes
from fullshard.plan import PlanConfig
from fullshard.plan.hardware import PRESETS, load_hardware
from fullshard.policies import MEMORY_CATEGORIES as CATEGORIES
from fullshard.policies import STEP_PHASES as PHASES

__all__ = [
    "check_config",
    "check_json",
    "check_rank",
    "check_target",
    "format_check",
]

MIB = 2**20


def _rss_mib() -> float:
    return rss_bytes() / MIB


def check_target(args: argparse.Namespace) -> tuple[str, str]:
    """``(device, backend)`` the check runs on: the planned ``--backend`` on CUDA, gloo on CPU
    (where the planned backend may be NCCL: the check then measures the gloo variant)."""
    device_type, _ = resolve_backend(args.check_device, "auto", flag="--check-device")
    return args.check_device, args.backend if device_type == "cuda" else "gloo"


def check_config(args: argparse.Namespace, backend: str | None = None) -> PlanConfig:
    """The plan the check compares with: fp32, the planned strategy, checkpointing, batch and
    sequence; for the step time, the ``--gpu`` description unless it is a GPU preset while the
    check runs on the CPU."""
    device, _ = resolve_backend(args.check_device, "auto", flag="--check-device")
    hardware = None
    if args.gpu not in PRESETS or device == "cuda":
        hardware = load_hardware(args.gpu, devices_per_node=args.devices_per_node)
    return PlanConfig(
        strategy=args.strategy,
        hybrid_group=args.hybrid_group,
        devices_per_node=args.devices_per_node,
        precision="fp32",
        backend=backend or args.backend,
        batch=args.batch,
        seq=args.seq or 128,
        activation_checkpointing=args.activation_checkpointing,
        hardware=hardware,
    )


def check_rank(args: argparse.Namespace) -> dict[str, Any]:
    """One rank of the check (under torchrun); returns predicted and measured figures."""
    device, backend = check_target(args)
    with rank_session(device, 300.0, backend) as info:
        return _check(args, info.rank, info.world_size, info.device, info.backend)


def _check(
    args: argparse.Namespace, rank: int, world: int, device: torch.device, backend: str
) -> dict[str, Any]:
    torch.set_num_threads(1)
    config = check_config(args, backend)
    # one vocabulary for the plan, the model and the tokens drawn (--vocab, else the model's own)
    vocab = model_vocab(args.model, args.vocab)
    plan = plan_builtin(args.model, world, config, vocab_size=vocab, with_recommendation=False)
    rss0 = _rss_mib()
    # the profiler counts every storage from before the model exists (profiler_live_peak)
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=cpu, profile_memory=True) as prof:
        model = build_model(args.model, vocab, seed=0, device=device, lazy_weights=True)
        group = config.shard_group(world)
        parallelism = ParallelismConfig(
            strategy=args.strategy,
            shard_size=group,
            activation_checkpointing=config.checkpointing == "full",
        )
        shard_model(model, parallelism, unit_types_of(model))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        gen = torch.Generator().manual_seed(rank)

        def step() -> float:
            x = torch.randint(vocab, (config.batch, config.seq + 1), generator=gen).to(device)
            t0 = time.perf_counter()
            lm_loss(model, x).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return time.perf_counter() - t0

        step()  # the root is set up on the first forward: track from the next step
        tracker = MemoryTracker().attach(model, opt)
        with torch.profiler.record_function("tracked steps"):
            for _ in range(args.check_steps):
                step()
        tracker.detach()
    # timed without the tracker's samples and the profiler's events; the device's rates measured
    # around them too (a shared machine's rates drift: NOTE [Rates of the moment])
    before = measure_device(device, repeats=3) if config.hardware else None
    seconds = [step() for _ in range(args.check_steps)]
    after = measure_device(device, repeats=3) if config.hardware else None
    mine = {
        "peaks": tracker.peaks,
        "live_peak": profiler_live_peak(prof, "tracked steps"),
        "rss_growth_mib": _rss_mib() - rss0,
        "step_s": statistics.median(seconds),
        "rates": [before, after],
    }
    everyone = control.all_gather_objects(mine)
    now = _rates_of_the_moment(args.model, world, config, vocab, everyone)
    predicted = {p: plan.phases[p].categories() for p in PHASES}
    for p in PHASES:  # without the loss's and the optimizer's temporaries: the tracker's view
        predicted[p]["total"] = plan.phases[p].tracked
    measured = {
        p: {c: max(r["peaks"][p][c] for r in everyone) for c in (*CATEGORIES, "total")}
        for p in PHASES
    }
    timing = plan.step
    return {
        "model": args.model,
        "world": world,
        "strategy": args.strategy,
        "activation_checkpointing": config.checkpointing,
        "predicted": predicted,
        "measured": measured,
        "predicted_peak": plan.peak_bytes,
        "measured_live_peak": max((r["live_peak"] or 0) for r in everyone),
        "rss_growth_mib": [r["rss_growth_mib"] for r in everyone],
        "hardware": config.hardware.name if config.hardware else None,
        "predicted_step_s": timing.step_s if timing else None,
        "predicted_step_parts": {**timing.parts, **timing.exposed} if timing else None,
        "predicted_step_s_now": now,
        "measured_step_s": max(r["step_s"] for r in everyone),
        "measured_step_s_per_rank": [r["step_s"] for r in everyone],
    }


def _rates_of_the_moment(
    model: str, world: int, config: PlanConfig, vocab: int, everyone: list[dict[str, Any]]
) -> float | None:
    """NOTE [Rates of the moment]
    On a shared machine the rates ``--calibrate`` measured may not be the rates of the check's
    minutes (other processes come and go). Each rank therefore measures its matmul rate, memory
    bandwidth and op cost again just before and after its timed steps, and the step is predicted
    a second time on the description with those (the slowest rank's mean; the collectives as
    calibrated): the difference between the two predictions is the machine's drift, the
    difference between the second and the measured step the model's own error."""
    if config.hardware is None or any(r["rates"][0] is None for r in everyone):
        return None
    rates = [{k: (a[k] + b[k]) / 2 for k in a} for a, b in (r["rates"] for r in everyone)]
    matmul = min(r["matmul"] for r in rates)
    hw = replace(
        config.hardware,
        matmul_flops=dict.fromkeys(config.hardware.matmul_flops, matmul),
        memory_bandwidth=min(r["memory_bandwidth"] for r in rates),
        efficiency=replace(config.hardware.efficiency, launch_s=max(r["launch_s"] for r in rates)),
    )
    plan = plan_builtin(
        model, world, replace(config, hardware=hw), vocab_size=vocab, with_recommendation=False
    )
    return plan.step.step_s if plan.step else None


def format_check(res: dict[str, Any]) -> str:
    """Predicted vs measured, per phase and category, with the relative error of each total."""
    lines = [
        f"fullshard plan --check: {res['model']} on {res['world']} ranks, {res['strategy']}, "
        f"activation checkpointing {res['activation_checkpointing']} "
        "(MiB per rank; measured = peak live tensor storage of the worst rank)",
        f"{'phase':<10} {'category':<17} {'predicted':>10} {'measured':>10} {'error':>8}",
    ]
    for phase in PHASES:
        for cat in (*CATEGORIES, "total"):
            p = res["predicted"][phase][cat] / MIB
            m = res["measured"][phase][cat] / MIB
            err = f"{100 * (p - m) / m:+.1f}%" if m > 0 else "-"
            lines.append(f"{phase:<10} {cat:<17} {p:>10.2f} {m:>10.2f} {err:>8}")
    peak_p = max(res["predicted"][p]["total"] for p in PHASES) / MIB
    peak_m = max(res["measured"][p]["total"] for p in PHASES) / MIB
    lines.append(
        f"peak per rank: predicted {peak_p:.2f} MiB, measured {peak_m:.2f} MiB "
        f"({100 * (peak_p - peak_m) / peak_m:+.1f}%); resident-set growth per rank: "
        + ", ".join(f"{v:.0f} MiB" for v in res["rss_growth_mib"])
    )
    pred, live = res["predicted_peak"] / MIB, res["measured_live_peak"] / MIB
    lines.append(
        f"peak of every live storage (the profiler): predicted {pred:.2f} MiB, measured "
        f"{live:.2f} MiB ({100 * (pred - live) / live:+.1f}%)"
    )
    measured = res["measured_step_s"]
    if res["predicted_step_s"] is None:
        lines.append(
            f"step time: measured {measured:.3f} s (the slowest rank's median); not predicted: "
            "give --gpu FILE from `fullshard plan --calibrate` on this machine"
        )
    else:
        pred = res["predicted_step_s"]
        lines.append(
            f"step time on {res['hardware']}: predicted {pred:.3f} s, measured {measured:.3f} s "
            f"({100 * (pred - measured) / measured:+.1f}%; ranks "
            + ", ".join(f"{v:.3f}" for v in res["measured_step_s_per_rank"])
            + " s)"
        )
        now = res.get("predicted_step_s_now")
        if now:
            lines.append(
                f"  predicted with the rates measured around the timed steps: {now:.3f} s "
                f"({100 * (now - measured) / measured:+.1f}%; NOTE [Rates of the moment])"
            )
    return "\n".join(lines)


def check_json(res: dict[str, Any]) -> str:
    return json.dumps(res, indent=2)
