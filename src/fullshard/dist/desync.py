"""Desync detection (layer 4): when ranks disagree on which collective comes next, say who is
where, on every rank, instead of hanging or mixing numbers.

NOTE [Collective positions]
Every collective fullshard issues gets a *position*: its sequence number on this rank, the
training step, its kind, its unit and why it runs (forward gather, backward gather,
reduce-scatter). Three mechanisms use it:

1. Tags in the all-gather payload (always on). Each rank appends a few small integers (unit,
   sequence, phase) to the buffer it sends; after the gather every rank compares all ranks'
   tags. Two ranks that pair *different* collectives of the *same size* (identical transformer
   blocks!) would otherwise silently compute with the wrong weights: now both raise at once,
   naming what each rank was doing. It costs a handful of elements per gather.
2. A failed or timed-out wait (a dead rank, or a rank that went elsewhere): each rank publishes
   its position in the process group's store and reads the others' for a few seconds, so the
   error lists every rank's position, and names the ranks that never reported (dead, or stuck
   outside a collective).
3. Debug mode (``FULLSHARD_DEBUG_COLLECTIVES=1``): before every collective, ranks exchange a
   fixed-size fingerprint (sequence, kind, unit, size, dtype, step) and compare, so a mismatch
   is caught at once even when the real collectives' sizes differ (which would otherwise wait
   for the timeout). One extra small all-gather per collective.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from fullshard.policies import FullshardError

KINDS = ("all_gather", "reduce_scatter", "all_reduce")
PHASES = ("other", "forward gather", "backward gather", "reduce-scatter", "unshard()")
# Payload tags must be exact in bf16/fp16 too: integers below 256.
TAG_MOD = 251
TAG_MAGIC = 173.0
TAG_LEN = 4


class DesyncError(FullshardError):
    """Ranks disagree on the collective sequence; the message says which rank is where."""


def debug_enabled() -> bool:
    return os.environ.get("FULLSHARD_DEBUG_COLLECTIVES", "").lower() in ("1", "true", "yes")


def report_wait() -> timedelta:
    """How long a failing rank waits to hear where the other ranks are."""
    return timedelta(seconds=float(os.environ.get("FULLSHARD_REPORT_WAIT_S", "10")))


def unit_code(unit: str) -> int:
    """A stable small number for a unit name (the same on every rank)."""
    return zlib.crc32(unit.encode()) % TAG_MOD


@dataclass
class Position:
    """Where one rank is in the collective sequence (NOTE [Collective positions])."""

    seq: int
    step: int
    kind: str
    unit: str
    phase: str

    def __str__(self) -> str:
        return f"{self.phase} of unit '{self.unit}' (step {self.step}, collective #{self.seq})"


# -- 1. payload tags ---------------------------------------------------------------------------
def make_tag(pos: Position) -> torch.Tensor:
    return torch.tensor(
        [
            TAG_MAGIC,
            unit_code(pos.unit),
            pos.seq % TAG_MOD,
            PHASES.index(pos.phase) if pos.phase in PHASES else 0,
        ],
        dtype=torch.float64,
    )


def check_tags(
    tags: torch.Tensor,
    mine: torch.Tensor,
    pos: Position,
    names: dict[int, str],
    group: dist.ProcessGroup,
) -> None:
    """Every rank's tag (rows of ``tags``) must equal this rank's; else raise on every rank."""
    tags = tags.double().cpu()
    if bool((tags == mine.reshape(1, -1)).all()):
        return
    ranks = dist.get_process_group_ranks(group)
    lines = []
    for r, row in zip(ranks, tags.tolist(), strict=True):
        if row[0] != TAG_MAGIC:
            lines.append(f"rank {r}: not a fullshard collective of this size (foreign collective)")
            continue
        unit = names.get(int(row[1]), f"#{int(row[1])}")
        phase = PHASES[int(row[3])] if 0 <= int(row[3]) < len(PHASES) else "?"
        lines.append(
            f"rank {r}: {phase} of unit '{unit}', collective #{int(row[2])} (mod {TAG_MOD})"
        )
    raise DesyncError(
        f"rank {dist.get_rank()}: ranks paired different {pos.kind.replace('_', '-')}s ({'; '.join(lines)}); this "
        f"rank was at {pos}. The ranks ran different forward/backward sequences (a skipped or "
        "extra forward, another branch, a different number of micro-batches); no result of this "
        "collective was used."
    )


# -- 2. explaining a failed wait ---------------------------------------------------------------
def explain_failure(pos: Position | None, what: str, group: dist.ProcessGroup | None) -> str:
    """Publish this rank's position in the store and collect the others' (best effort)."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # no store reachable: say what we know
        return f"this rank was at {pos or what}"
    rank = dist.get_rank()
    ranks = (
        dist.get_process_group_ranks(group)
        if group is not None
        else list(range(dist.get_world_size()))
    )
    prefix = "fullshard/desync/"
    store.set(f"{prefix}{rank}", str(pos or what))
    lines = []
    for r in ranks:
        key = f"{prefix}{r}"
        try:
            store.wait([key], report_wait())
            lines.append(f"rank {r}: {store.get(key).decode()}")
        except Exception:
            lines.append(
                f"rank {r}: did not report within {report_wait().total_seconds():.0f}s "
                "(dead, or stuck outside a fullshard collective)"
            )
    return "; ".join(lines)


# -- 3. debug-mode fingerprints ----------------------------------------------------------------
def fingerprint_check(
    pos: Position,
    numel: int,
    dtype: torch.dtype,
    group: dist.ProcessGroup | None,
    device: torch.device,
    timeout: timedelta,
    names: dict[int, str],
) -> None:
    """Exchange and compare a fixed-size fingerprint before a collective (debug mode)."""
    world = dist.get_world_size(group)
    mine = torch.tensor(
        [
            pos.seq,
            KINDS.index(pos.kind) if pos.kind in KINDS else -1,
            unit_code(pos.unit),
            numel,
            hash(str(dtype)) % 10007,
            pos.step,
        ],
        dtype=torch.int64,
        device=device,
    )
    everyone = torch.empty(world * mine.numel(), dtype=torch.int64, device=device)
    work = dist.all_gather_into_tensor(everyone, mine, group=group, async_op=True)
    assert work is not None
    work.wait(timeout)
    rows = everyone.view(world, -1).cpu()
    if bool((rows == mine.cpu().reshape(1, -1)).all()):
        return
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    lines = []
    for r, row in zip(ranks, rows.tolist(), strict=True):
        kind = KINDS[row[1]] if 0 <= row[1] < len(KINDS) else "?"
        lines.append(
            f"rank {r}: {kind} of unit '{names.get(row[2], '#' + str(row[2]))}' ({row[3]} elements) at step {row[5]}, collective #{row[0]}"
        )
    raise DesyncError(
        f"rank {dist.get_rank()}: collective mismatch caught before it ran (debug mode): "
        f"{'; '.join(lines)}. The ranks ran different forward/backward sequences."
    )
