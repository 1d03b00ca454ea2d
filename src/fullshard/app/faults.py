"""Fault injection for ``fullshard train`` (tests and drills), and the non-finite step policy.

``FULLSHARD_FAULT="KIND:rank=R:step=S"`` makes rank R misbehave at the start of step S:

- ``kill``: the process exits at once (as if killed or out of memory);
- ``hang``: the process stops in a sleep longer than any timeout (a stuck rank);
- ``nan``: the rank's loss becomes NaN for that step (a numerical blow-up on one rank).

Faults fire only in the first attempt of a job (``TORCHELASTIC_RESTART_COUNT`` 0), so that a run
under ``torchrun --max-restarts`` can show its recovery.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fullshard.policies import FullshardError

__all__ = ["Fault", "NonFiniteError", "agree_nonfinite", "fault_from_env"]


class NonFiniteError(FullshardError):
    """A step produced a non-finite loss or gradient and ``--on-nonfinite stop`` was asked."""


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int

    def at_step(self, step: int, rank: int) -> bool:
        """Apply the fault if it is due; returns True when the loss must become NaN."""
        if step != self.step or rank != self.rank:
            return False
        if self.kind == "kill":
            print(f"[fault] rank {rank} killed at step {step}", flush=True)
            os._exit(1)
        if self.kind == "hang":
            print(f"[fault] rank {rank} hangs at step {step}", flush=True)
            time.sleep(10**6)
        return self.kind == "nan"


def fault_from_env() -> Fault | None:
    spec = os.environ.get("FULLSHARD_FAULT", "")
    if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return None
    kind, *fields = spec.split(":")
    values = dict(f.split("=", 1) for f in fields)
    if kind not in ("kill", "hang", "nan"):
        raise FullshardError(f"FULLSHARD_FAULT: unknown fault {kind!r} (kill, hang or nan)")
    return Fault(kind, int(values.get("rank", 0)), int(values.get("step", 1)))


def agree_nonfinite(loss: float, grad_norm: float, device: torch.device) -> bool:
    """True on every rank if any rank's loss, or the global gradient norm, is not finite.

    The gradient norm is already global (``clip_grad_norm_`` all-reduces it); the loss is this
    rank's, so its verdict is all-reduced (MAX) to make the decision the same everywhere.
    """
    flag = torch.tensor([0.0 if torch.isfinite(torch.tensor(loss)) else 1.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0) or not torch.isfinite(torch.tensor(grad_norm)).item()
