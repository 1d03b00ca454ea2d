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

from fullshard.dist import control
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


def agree_nonfinite(loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
    """1.0 on every rank if any rank's loss, or the global gradient norm, is not finite, else 0.0.

    The vote stays on the device (no host read here): this rank's 0/1 flag is built with
    ``torch.isfinite`` and all-reduced (MAX), and the caller reads it together with the step's
    other figures in the step's one synchronisation. The gradient norm is already global
    (``clip_grad_norm_`` all-reduces it); voting on it too costs nothing and keeps the verdict
    one tensor.
    """
    finite = torch.isfinite(loss.detach()).all() & torch.isfinite(grad_norm.detach()).all()
    flag = (~finite).to(torch.float64).reshape(1)
    return control.all_reduce_values(flag, "max", what="non-finite vote all-reduce")
