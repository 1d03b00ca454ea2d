"""The rates of this machine's device, measured (``plan --calibrate`` and ``plan --check``):
its matmul rate, memory bandwidth and cost per eager op."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["GEMMS", "measure_device", "timed"]

# GEMM shapes (tokens x in -> out) spanning a small model's linears: the median rate is kept
GEMMS = ((1024, 256, 1024), (1024, 512, 512), (1024, 1024, 256), (1024, 320, 1280))


def timed(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` after one warm-up call, ``sync`` after
    each (the device's queue drained)."""
    fn()  # warm up: first-call allocations, kernel selection
    sync()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def measure_device(device: torch.device, repeats: int = 7) -> dict[str, float]:
    """This device's achieved fp32 matmul rate (FLOP/s, median over :data:`GEMMS`), memory
    bandwidth (bytes/s of an out-of-place add over 64 MB tensors) and seconds per eager op
    (a small op recorded by autograd, forward and backward)."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    rates = []
    for m, k, n in GEMMS:
        a = torch.randn(m, k, device=device)
        b = torch.randn(k, n, device=device)
        secs = statistics.median(timed(lambda a=a, b=b: torch.mm(a, b), repeats, sync))  # type: ignore[misc]
        rates.append(2.0 * m * k * n / secs)
    x = torch.randn(16 << 20, device=device)  # 64 MB of fp32
    y, z = torch.randn_like(x), torch.empty_like(x)
    add = statistics.median(timed(lambda: torch.add(x, y, out=z), repeats, sync))
    small = torch.randn(8, device=device, requires_grad=True)

    def ops() -> None:  # 20 forward ops and their backward
        h = small
        for _ in range(20):
            h = h * 1.0001
        h.sum().backward()

    per_op = statistics.median(timed(ops, repeats, sync)) / 60  # forward + 2x backward kernels
    return {
        "matmul": statistics.median(rates),
        "matmul_spread": (max(rates) - min(rates)) / statistics.median(rates),
        "memory_bandwidth": 3 * x.numel() * x.element_size() / add,
        "launch_s": per_op,
    }
