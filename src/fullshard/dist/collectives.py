"""Collectives (layer 4): tensor in, work handle out. All byte counting lives here.

Every collective fullshard issues goes through this file, so ``CommStats`` sees each one with the
unit and phase that issued it. Bytes are counted as the size of the *full* (unsharded) buffer a
collective covers: an all-gather of a unit counts the gathered unit, a reduce-scatter counts the
full gradient it reduces. In those units FULL_SHARD moves 3 model-sizes per step, DDP 2.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from fullshard.policies import FullshardError

# torch 2.13 renamed the single-tensor collectives (the old names warn); torch 2.4 has only those.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommStats:
    """Per-rank counters of collectives issued: calls and bytes by kind and by (kind, unit)."""

    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    unit_bytes: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))

    def record(self, kind: str, unit: str, nbytes: int) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += nbytes
        self.unit_bytes[(kind, unit)] += nbytes

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()
        self.unit_bytes.clear()


class Pending:
    """A collective in flight: ``wait()`` blocks at most ``timeout`` and names what it waited for."""

    def __init__(self, work: dist.Work | None, what: str, timeout: timedelta) -> None:
        self._work = work
        self.what = what
        self._timeout = timeout

    def wait(self) -> None:
        if self._work is None:
            return
        work, self._work = self._work, None
        try:
            ok = work.wait(self._timeout)
        except RuntimeError as exc:  # gloo raises on timeout or on a peer that went away
            raise FullshardError(
                f"rank {dist.get_rank()}: {self.what} failed or timed out after "
                f"{self._timeout.total_seconds():.0f}s: {exc}. Another rank may have died or "
                "taken a different path through the model (check that every rank runs the same "
                "forward/backward sequence)."
            ) from exc
        if ok is False:
            raise FullshardError(
                f"rank {dist.get_rank()}: {self.what} did not finish within "
                f"{self._timeout.total_seconds():.0f}s."
            )

    @property
    def done(self) -> bool:
        return self._work is None


def all_gather(
    out: torch.Tensor,
    shard: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    stats: CommStats,
    what: str,
    unit: str,
    timeout: timedelta,
) -> Pending:
    """Start ``all_gather_into_tensor(out, shard)`` asynchronously."""
    stats.record("all_gather", unit, out.numel() * out.element_size())
    work = _all_gather_single(out, shard, group=group, async_op=True)
    return Pending(work, what, timeout)


def reduce_scatter(
    out: torch.Tensor,
    full: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    stats: CommStats,
    what: str,
    unit: str,
    timeout: timedelta,
) -> Pending:
    """Start a summing ``reduce_scatter_tensor(out, full)`` asynchronously.

    SUM, not AVG: gloo has no AVG, and summing then dividing by the world size on our side makes
    the 2-rank float32 result bitwise equal to a single process's ``(g0 + g1) / 2``.
    """
    stats.record("reduce_scatter", unit, full.numel() * full.element_size())
    work = _reduce_scatter_single(
        out, full.view(-1), op=dist.ReduceOp.SUM, group=group, async_op=True
    )
    return Pending(work, what, timeout)


def all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    stats: CommStats | None = None,
    what: str,
    unit: str = "",
    timeout: timedelta,
) -> Pending:
    """Start an ``all_reduce`` asynchronously."""
    if stats is not None:
        stats.record("all_reduce", unit, tensor.numel() * tensor.element_size())
    work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
    return Pending(work, what, timeout)
