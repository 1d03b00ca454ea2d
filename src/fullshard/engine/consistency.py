"""Checks that need every rank (layer 8): the model agrees across ranks before any collective
that could hang on a disagreement, and an optimizer built before ``fully_shard`` is caught.

NOTE [Same model on every rank]
Every collective of a unit has a size fixed by the unit's parameters. Ranks whose models differ
(shape, dtype, names, count) would issue mismatched collectives: a hang or a crash deep in the
transport, or worse, silently mixed numbers. ``fully_shard`` therefore exchanges a signature of
the unit (one small ``all_gather_object`` per group) and raises, on every rank, the list of
differences with the ranks that have them.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fullshard.comm.control import all_gather_objects
from fullshard.comm.mesh import MeshInfo
from fullshard.engine.extension import is_tensor_subclass
from fullshard.engine.param import local_of
from fullshard.policies import FullshardError

Signature = list[tuple[str, tuple[int, ...], str, bool, int]]


def signature(
    entries: Sequence[tuple[list[str], torch.Tensor, Any]], dims: Sequence[int] | None = None
) -> Signature:
    """What must be equal across ranks: names, shapes, dtypes (with the tensor subclass, which
    decides what the all-gather sends: NOTE [All-gather extensions]), trainability, and the dim
    ``shard_placement_fn`` shards each parameter on (``dims``; two layouts of the same size
    would otherwise mix numbers silently)."""
    dims = dims if dims is not None else [0] * len(entries)
    return [
        (fqns[0], tuple(p.shape), _dtype(p), p.requires_grad, d)
        for (fqns, p, _), d in zip(entries, dims, strict=True)
    ]


def _dtype(p: torch.Tensor) -> str:
    local = local_of(p)
    return f"{p.dtype} ({type(local).__name__})" if is_tensor_subclass(local) else str(p.dtype)


def _differences(sigs: list[Signature], group_ranks: list[int]) -> list[str]:
    ref = {name: rest for name, *rest in sigs[0]}
    lines = []
    for i, sig in enumerate(sigs[1:], start=1):
        r = group_ranks[i]
        mine = {name: rest for name, *rest in sig}
        for name in sorted(ref.keys() - mine.keys()):
            lines.append(f"rank {r} has no parameter '{name}' (rank {group_ranks[0]} has it)")
        for name in sorted(mine.keys() - ref.keys()):
            lines.append(f"rank {r} has an extra parameter '{name}'")
        for name in sorted(ref.keys() & mine.keys()):
            if ref[name] != mine[name]:
                (s0, d0, g0, k0), (s1, d1, g1, k1) = ref[name], mine[name]
                what = []
                if s0 != s1:
                    what.append(f"shape {s1} vs {s0}")
                if d0 != d1:
                    what.append(f"dtype {d1} vs {d0}")
                if g0 != g1:
                    what.append(f"requires_grad {g1} vs {g0}")
                if k0 != k1:  # shard_placement_fn must answer alike everywhere
                    what.append(f"shard_placement_fn dim {k1} vs {k0}")
                lines.append(
                    f"rank {r}: parameter '{name}' has {', '.join(what)} on rank {group_ranks[0]}"
                )
    return lines


def check_same_model(unit_name: str, sig: Signature, mesh: MeshInfo) -> None:
    """NOTE [Same model on every rank]: raise on every rank if ``sig`` differs anywhere."""
    groups = [mesh.group] + ([mesh.replicate_group] if mesh.replicate_group is not None else [])
    for group in groups:
        size = dist.get_world_size(group)
        if size == 1:
            continue
        sigs = all_gather_objects(sig, group)
        ranks = dist.get_process_group_ranks(group)
        lines = _differences(sigs, ranks)
        if lines:
            shown = "; ".join(lines[:10]) + (
                f"; (+{len(lines) - 10} more)" if len(lines) > 10 else ""
            )
            raise FullshardError(
                f"rank {dist.get_rank()}: {unit_name} differs across ranks: {shown}. Every rank "
                "must build the same model before fully_shard (same config and code; random "
                "init may differ, shapes may not)."
            )


class _OptimizerGuard:
    """Warns once when an optimizer steps parameters that ``fully_shard`` has replaced.

    An optimizer built before wrapping holds the original, unsharded parameters, which the
    model no longer uses: its steps would change nothing the model computes with.
    """

    def __init__(self) -> None:
        # id -> (name, weak reference): tensors compare by value, so no WeakSet of tensors
        self.replaced: dict[int, tuple[str, weakref.ref[torch.Tensor]]] = {}
        self._handle: Any = None
        self._checked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()

    def track(self, originals: list[tuple[str, torch.Tensor]]) -> None:
        for name, p in originals:
            self.replaced[id(p)] = (name, weakref.ref(p))
        if self._handle is None:
            self._handle = register_optimizer_step_pre_hook(self._check)

    def _check(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if opt in self._checked:  # once per optimizer: the hook runs on every step
            return
        self._checked.add(opt)
        stale = []
        for group in opt.param_groups:
            for p in group["params"]:
                entry = self.replaced.get(id(p))
                if entry is not None and entry[1]() is p:
                    stale.append(entry[0])
        if stale:
            import warnings

            warnings.warn(
                f"rank {dist.get_rank() if dist.is_initialized() else 0}: this optimizer holds "
                f"{len(stale)} parameter(s) that fully_shard replaced by shards (e.g. "
                f"'{stale[0]}'): it was built before wrapping, so its steps do not reach the "
                "model. Build the optimizer after fully_shard, from model.parameters().",
                stacklevel=3,
            )


# One guard per process: optimizers are process-wide objects, like torch's own global hooks.
OPTIMIZER_GUARD = _OptimizerGuard()
