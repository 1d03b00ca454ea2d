"""Policies and small types: the vocabulary every other layer speaks (layer 1).

Everything here is a dataclass (frozen, except where FSDP2's is mutable) or an enum; nothing
imports from the rest of fullshard.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import nn


class FullshardError(RuntimeError):
    """An error fullshard raises on every rank: what is wrong, where, and what to do."""


# Where FSDP2 raises a builtin exception, fullshard raises a ``FullshardError`` that is also an
# instance of that type, so code written against FSDP2 (``except ValueError``) still catches it.


class FullshardValueError(FullshardError, ValueError):
    """A bad argument or input, where FSDP2 raises ``ValueError``."""


class FullshardAssertionError(FullshardError, AssertionError):
    """A refused use, where FSDP2 raises ``AssertionError`` (deep copy, a module wrapped twice,
    a shard dim the parameter lacks)."""


class FullshardNotImplementedError(FullshardError, NotImplementedError):
    """What neither FSDP2 nor fullshard supports, where FSDP2 raises ``NotImplementedError``."""


class FullshardTypeError(FullshardError, TypeError):
    """An argument of the wrong type, where FSDP2 raises ``TypeError``."""


def fsdp2_words(ours: str, theirs: str) -> str:
    """An error message in fullshard's words that also holds FSDP2's for the same error, so
    code and tests that match FSDP2's wording (``assertRaisesRegex``) keep working."""
    return f"{ours} [FSDP2: {theirs}]"


def fsdp2_exact(error: FullshardError, ours: str) -> FullshardError:
    """``error`` built with FSDP2's exact message (code compares ``str(error)`` with it), and
    fullshard's words as a note the traceback shows (Python 3.11+)."""
    if hasattr(error, "add_note"):
        error.add_note(ours)
    return error


class SharedParameterError(FullshardValueError):
    """A parameter is tied across two units (a ``ValueError`` too, as FSDP2 raises)."""


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for gathering/computing, reducing gradients and casting outputs.

    Mirrors ``torch.distributed.fsdp.MixedPrecisionPolicy``. ``None`` everywhere means "train in
    the parameters' own dtype". When ``param_dtype`` is set and ``reduce_dtype`` is not, gradients
    are reduced in the parameters' own (master) dtype.

    ``param_dtype_override_fn`` (torch 2.15's, keyword-only): ``fn(param) -> dtype | None``,
    called once per managed parameter when ``fully_shard`` runs. ``None`` or ``param_dtype``
    keeps the default; the parameter's own dtype keeps that parameter in it (e.g. fp32 norms or
    gates inside a bf16 unit); any other dtype is a ``ValueError``. Forward inputs are still cast
    to ``param_dtype``. A unit whose trainable parameters then compute in two dtypes needs a
    ``reduce_dtype``. It must answer alike on every rank.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    param_dtype_override_fn: Callable[[nn.Parameter], torch.dtype | None] | None = field(
        default=None, kw_only=True
    )

    def for_param(self, param: nn.Parameter) -> MixedPrecisionPolicy:
        """The policy of one parameter: ``param_dtype_override_fn`` resolved (FSDP2's rule and
        its ``ValueError`` s), and dropped."""
        fn = self.param_dtype_override_fn
        if fn is None:
            return self
        dtype = fn(param)
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise FullshardValueError(
                "param_dtype_override_fn must return a torch.dtype or None but got "
                f"{type(dtype)} (fullshard: return None, param_dtype, or the parameter's own "
                "dtype)"
            )
        if dtype is not None and dtype not in (self.param_dtype, param.dtype):
            raise FullshardValueError(
                "param_dtype_override_fn must return None, param_dtype, or the parameter's "
                f"original dtype but got {dtype} for a parameter with dtype {param.dtype} and "
                f"param_dtype {self.param_dtype} (fullshard gathers a parameter in its own dtype "
                "or in param_dtype only)"
            )
        return replace(self, param_dtype=dtype or self.param_dtype, param_dtype_override_fn=None)


@dataclass
class OffloadPolicy:
    """Base offload policy: no offloading (parameters, gradients and optimizer stay on device).
    A mutable dataclass, as FSDP2's (fullshard reads it once, in ``fully_shard``)."""


@dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, gradients and the optimizer step on CPU.

    Parameters are copied to the compute device when gathered. ``pin_memory`` pins the CPU shards
    so host-to-device copies can overlap with compute (ignored where CUDA is absent).
    """

    pin_memory: bool = True


@dataclass
class DataParallelMeshDims:
    """FSDP2's ``DataParallelMeshDims`` (torch 2.13): which named dims of the SPMD
    ``DeviceMesh`` passed to ``fully_shard(..., mesh=spmd, dp_mesh_dims=...)`` are data
    parallel. ``shard``: the dim the unit shards over; ``replicate``: the HSDP replica dim (or
    None). At least one must be set (``ValueError``, as FSDP2). FSDP2 also takes a tuple of
    names and flattens them; fullshard takes one name each (``fully_shard`` says to flatten the
    dims in the mesh first). Built on any torch fullshard supports; torch's own class works
    with fullshard's ``fully_shard`` too."""

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise FullshardValueError(
                "At least one of shard or replicate must be set in DataParallelMeshDims "
                "(fullshard: name the mesh dim the parameters are sharded over, e.g. "
                "DataParallelMeshDims(shard='dp_shard'))"
            )

    @property
    def shard_names(self) -> tuple[str, ...]:
        """``shard`` as a tuple of names (empty when None)."""
        return _as_names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        """``replicate`` as a tuple of names (empty when None)."""
        return _as_names(self.replicate)


def _as_names(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


class ShardingStrategy(enum.Enum):
    """FSDP1 vocabulary, mapped onto ``fully_shard`` arguments by :func:`fullshard.parallelize`."""

    # Shard parameters, gradients and optimizer state; free gathered parameters after forward.
    FULL_SHARD = "full_shard"
    # Like FULL_SHARD but keep gathered parameters from forward through backward (ZeRO-2).
    SHARD_GRAD_OP = "shard_grad_op"
    # Replicate everything and all-reduce gradients (plain data parallel).
    NO_SHARD = "no_shard"
    # 2-D mesh: shard inside a group, replicate across groups (FULL_SHARD inside).
    HYBRID_SHARD = "hybrid_shard"
    # 2-D mesh: shard inside a group, replicate across groups (SHARD_GRAD_OP inside).
    HYBRID_SHARD_ZERO2 = "hybrid_shard_zero2"

    @property
    def hybrid(self) -> bool:
        """Shards inside groups of ranks and replicates across them (a 2-D mesh)."""
        return self in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy.HYBRID_SHARD_ZERO2)

    @property
    def reshard_after_forward(self) -> bool:
        """Non-root units free their gathered parameters after forward (ZeRO-3) or keep them
        for backward (ZeRO-2; replication keeps everything anyway)."""
        return self in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)


# The strategy names every command accepts (``--strategy``), in the enum's order.
STRATEGY_NAMES = tuple(s.value for s in ShardingStrategy)

# Where a training step's memory goes: the one vocabulary of the memory tracker
# (``fullshard.observe.memory``), the planner (``fullshard.plan``) and their reports.
MEMORY_CATEGORIES = (
    "sharded_params",  # this rank's shards of every parameter (the fp32 master weights)
    "gradients",  # sharded gradients, plus unsharded ones until they are reduced
    "optimizer_state",  # the optimizer's per-parameter state (Adam: exp_avg, exp_avg_sq)
    "gathered_window",  # gathered (unsharded) parameters of the units in the window
    "activations",  # tensors autograd saved for backward
    "comm_buffers",  # all-gather outputs and reduce-scatter inputs/outputs in flight
)


class Phase(enum.Enum):
    """What a rank is doing in a step: the one vocabulary of the engine's gathers and
    prefetches, the schedule's points, the collective positions (desync tags), the memory
    tracker and the planner (FSDP2's ``TrainingState``)."""

    # A unit's forward: its gather, a forward prefetch, the points up to its free.
    FORWARD = "forward"
    # A unit's backward: its gather again (also for activation recomputation), a backward
    # prefetch, its reduce-scatter.
    BACKWARD = "backward"
    # The optimizer step (memory is sampled around it; no collective of the engine runs).
    OPTIMIZER = "optimizer"
    # Outside a step's forward and backward: ``FSDPModule.unshard()``, the root's lazy init, a
    # ``reshard()`` that must land a gather first.
    IDLE = "idle"


# The passes a step's peaks are reported for, in order (keys of the tracker's and planner's
# per-phase tables).
STEP_PHASES = tuple(p.value for p in (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER))
