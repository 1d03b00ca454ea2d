"""``fullshard plan --calibrate``: measure this machine, so that a run here can be planned.

Each of ``--devices`` local ranks (launched as ``plan --check`` launches them, so they share the
machine as a check's ranks do) measures at the same time its matmul rate, its memory bandwidth
and its cost per eager op; then the ranks time the engine's own all-gather and reduce-scatter
(``fullshard.comm.collectives``) on the backend a run would use. Rank 0 writes the result as a
:class:`fullshard.plan.hardware.Hardware` JSON file (``--calibration``), which ``--gpu FILE``
reads. The rates are achieved rates: the description's efficiencies are 1.

The median of several repetitions is kept (a shared machine's timings are noisy); the file
records the spread beside each figure (``source``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from fullshard.app.commands.plan_measure import measure_device, timed
from fullshard.app.launch.local import rank_session, resolve_backend
from fullshard.comm import control
from fullshard.comm.collectives import all_gather, reduce_scatter
from fullshard.plan.hardware import Efficiency, Hardware

__all__ = ["calibrate_rank"]

COLLECTIVE_BYTES = (1 << 20, 16 << 20)  # a small and a large message: latency and bandwidth


def _collectives(device: torch.device, world: int, repeats: int = 5) -> dict[str, float]:
    """Bus bandwidth (bytes/s: ``(n-1)/n`` of the tensor over the time) of the engine's
    all-gather and reduce-scatter at the large message, and the small message's time per
    ring step (latency)."""
    timeout = timedelta(seconds=120)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    out: dict[str, float] = {}
    for nbytes in COLLECTIVE_BYTES:
        numel = nbytes // 4
        full = torch.randn(numel - numel % world, device=device)
        shard = torch.empty(full.numel() // world, device=device)

        def gather(full: torch.Tensor = full, shard: torch.Tensor = shard) -> None:
            all_gather(full, shard, None, what="calibrate", timeout=timeout).wait()

        def scatter(full: torch.Tensor = full, shard: torch.Tensor = shard) -> None:
            reduce_scatter(shard, full, None, what="calibrate", timeout=timeout).wait()

        for name, fn in (("all_gather", gather), ("reduce_scatter", scatter)):
            control.barrier()
            out[f"{name}_{nbytes}"] = statistics.median(timed(fn, repeats, sync))
    ring = (world - 1) / world
    big, small = COLLECTIVE_BYTES[1], COLLECTIVE_BYTES[0]
    secs_big = (out[f"all_gather_{big}"] + out[f"reduce_scatter_{big}"]) / 2
    secs_small = (out[f"all_gather_{small}"] + out[f"reduce_scatter_{small}"]) / 2
    bus = ring * big / secs_big
    # what the small message took beyond its bytes at the large one's rate, per ring step
    latency = max(0.0, secs_small - ring * small / bus) / max(world - 1, 1)
    return {"bus_bandwidth": bus, "latency_s": latency, **out}


def calibrate_rank(args: argparse.Namespace) -> dict[str, Any] | None:
    """One rank of ``plan --calibrate`` (under torchrun). Rank 0 writes ``args.calibration`` and
    returns what it wrote; the others return ``None``."""
    device_type, _ = resolve_backend(args.check_device, "auto", flag="--check-device")
    backend = args.backend if device_type == "cuda" else "gloo"
    with rank_session(args.check_device, 300.0, backend) as info:
        torch.set_num_threads(1)  # as plan --check runs each rank
        control.barrier()
        mine = measure_device(info.device)  # every rank at once: they share the machine
        everyone = control.all_gather_objects(mine)
        links = _collectives(info.device, info.world_size)
        if info.rank != 0:
            return None
        return _write(args, info.world_size, info.backend, info.device, everyone, links)


def _write(
    args: argparse.Namespace,
    world: int,
    backend: str,
    device: torch.device,
    ranks: list[dict[str, float]],
    links: dict[str, float],
) -> dict[str, Any]:
    def worst(key: str) -> float:  # the slowest rank sets a collective step's pace
        return min(r[key] for r in ranks)

    matmul = worst("matmul")
    memory = (
        torch.cuda.get_device_properties(device).total_memory
        if device.type == "cuda"
        else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / world
    )
    hw = Hardware(
        name=f"calibrated: {socket.gethostname()} ({world} ranks, {backend}, {device.type})",
        memory_bytes=float(memory),
        matmul_flops={"fp32": matmul, "bf16": matmul, "fp16": matmul},
        memory_bandwidth=worst("memory_bandwidth"),
        intra_node_bandwidth=links["bus_bandwidth"],
        inter_node_bandwidth=links["bus_bandwidth"],
        devices_per_node=world,
        latency_s=links["latency_s"],
        inter_node_latency_s=links["latency_s"],
        kind="cuda" if device.type == "cuda" else "cpu",
        efficiency=Efficiency(launch_s=max(r["launch_s"] for r in ranks)),
        source=(
            f"fullshard plan --calibrate, {time.strftime('%Y-%m-%d %H:%M')}: matmul rates "
            + ", ".join(f"{r['matmul'] / 1e9:.1f}" for r in ranks)
            + " GFLOP/s per rank (spread over shapes "
            + ", ".join(f"{r['matmul_spread']:.0%}" for r in ranks)
            + f"); collectives {links['bus_bandwidth'] / 1e9:.2f} GB/s bus, "
            f"{links['latency_s'] * 1e6:.0f} us per ring step"
        ),
    )
    data = hw.to_dict()
    Path(args.calibration).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return data
