"""The parts of a unit that are not its lifecycle (layer 6): its states, the records of its
collectives in flight, how its parameters form dtype groups, and the pure arithmetic of its
gradient reduction. ``CommUnit`` (``unit.py``) runs the lifecycle; nothing here communicates,
waits or touches a stream.

NOTE [Mixed-dtype units]
Parameters of several dtypes in one unit (fp32 LoRA adapters on a bf16 base) form one
``ShardGroup`` per dtype, each with its flat buffer and gathered storage. They still travel in
one all-gather: the groups' (cast) shards are concatenated, in the compute dtype when the policy
gives every group the same one, else as bytes (each group padded to 16 bytes so every dtype stays
aligned). Gradients are reduced in one dtype, so a unit whose trainable parameters compute in
different dtypes needs ``MixedPrecisionPolicy(reduce_dtype=...)``. Parameters gathered through
all-gather extension hooks (float8 weights) form groups of their own after the others, and send
what their hooks return, as bytes (NOTE [All-gather extensions] in extension.py): the unit still
moves in one all-gather.

NOTE [Dividing the sum]
The sum over N data-parallel ranks is divided by N once, after the reduction, in the reduce
dtype: in float32 that makes 2 ranks bitwise equal to one process's ``(g0 + g1) / 2``. A float16
sum of N gradients can overflow, so fp16 sums are pre-divided by a power of two p near sqrt(N)
(exact: a power of two) and post-divided by N / p, as FSDP2 does. The reduced shard is then cast
to the parameters' dtype once per unit, on the device, before any copy to host memory: casting
the pinned host copy instead read it before the device had written it (issue 17, defect 1).

NOTE [Which gradients exist]
Real programs do not reach the same parameters on every rank: a mixture-of-experts layer routes
each rank's tokens to different experts, an image encoder runs only where a batch has an image.
One process on the union of the ranks' data gives a parameter the sum of the gradients of the
ranks that used it, and leaves ``.grad`` None only where no rank did (DDP with
``find_unused_parameters`` too). So a rank whose backward did not reach a parameter sends zeros
for it (every rank issues the same collective), and each rank's block of the reduce-scatter
ends in one presence bit per parameter ("this rank used it"): after the sum, a column holds how
many ranks used the parameter. Then every rank sets ``.grad`` where *any* rank used it
(``gradient_receivers``), so a rank that did not use a parameter contributes an exact zero.
Deciding that on the host is free where the sums are host memory (gloo on CPU: the sums are
read anyway) and costs a synchronisation per unit where they are device memory; so:

- every rank used every parameter (the common case; known locally): ``.grad`` where it is,
  nothing read, nothing added;
- sums in host memory: ``.grad`` exactly where some rank used it (None where none did, as one
  process and DDP); under HSDP the replicas' all-reduce carries the counts too (the ``k``
  elements after the shard, ``shard_and_counts``);
- sums on a device (the CUDA path), or no presence bits (a one-rank shard group under HSDP,
  NO_SHARD): every trainable parameter gets ``.grad``, an exact zero where no rank used it. Reading the sums would cost a host synchronisation per unit
  per step; the zero is what ``0 * p.sum()`` (the usual workaround) gives too. A parameter no
  rank ever uses is then decayed by AdamW's weight decay where one process would leave it:
  freeze it (``requires_grad_(False)``).

Mispaired collectives are still caught by the tag bits that follow (NOTE [Collective
positions]); a unit that some ranks skip entirely is NOTE [Optional units] (schedule.py).

NOTE [Freezing after fully_shard]
Fine-tuning freezes and thaws parameters after sharding, between steps, with ``requires_grad_``
on either object of a parameter: the sharded one (what the optimizer holds, and what
``model.parameters()`` yields while the unit is sharded) or the gathered one (what it yields
while the unit is gathered). A unit can stay gathered into the next step: one that keeps its
parameters after forward (every unit without a root unit above it, by FSDP2's default; a root)
and that no backward reached (its parameters and inputs needed no gradient). Autograd computes
with the gathered parameter. So at every forward, before the unit's graph is recorded, each
unit compares both objects' flags with what it last saw (one comprehension of attribute reads
per unit, no call per parameter, nothing on the device); a change on either is set on the other
(and on the local rows of NOTE [Local optimizer steps]), a newly trainable gathered parameter
gets the post-accumulate-grad hooks of NOTE [Post-backward events], a reduction in flight
finishes, and ``trainable`` is rebuilt: the reduce-scatter's layout, reduce dtype (FSDP2's rule,
applied to what trains now: a unit frozen at its first forward reduces in ``reduce_dtype`` once
thawed, where torch 2.13's FSDP2 raises, pytorch#186998) and presence bits cover exactly the
trainable parameters, so a frozen one gets no gradient and the optimizer leaves it as it is.
Missing a change is worse than a wrong answer: a gathered parameter that requires grad outside
``trainable`` is missing from the post-backward count, so the unit is freed while autograd still
reads it (before issue 41: a thawed unit left gathered trained nothing, or segfaulted).

A change takes effect at the next forward (a backward already recorded keeps its graph, as in
plain PyTorch), and every rank must change the same parameters, as FSDP2 requires (the
reduce-scatter's size follows them). A change while gradients kept without sync (NOTE
[Accumulating without sync]) still wait to be reduced in the old layout is refused: they would
be lost. Under ``fullshard.deterministic`` the reduce dtype is checked again for what thawed, and
``GradientTree`` follows every parameter it was given, frozen or not. On the CUDA path all of
this is host bookkeeping: finishing a reduction in flight is a stream wait.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from fullshard.comm.collectives import Comm, Pending
from fullshard.comm.desync import TAG_BITS, TAG_LEN, Position, Verdict, moves_data
from fullshard.comm.device import cuda_semantics, current_stream, use_stream
from fullshard.comm.mesh import MeshInfo
from fullshard.engine.copy_in import CopyInGroup, gather_kind
from fullshard.engine.extension import ExtensionGroup
from fullshard.engine.param import ShardedParam, ShardGroup
from fullshard.engine.streams import Event
from fullshard.policies import FullshardError, MixedPrecisionPolicy
from fullshard.shard.layout import FlatLayout


class UnitState(enum.Enum):
    """See NOTE [Unit states] (unit.py)."""

    # Only shards are held; modules see the sharded parameters.
    SHARDED = "sharded"
    # An all-gather is in flight; modules still see the shards.
    GATHERING = "gathering"
    # The gathered storage is allocated and filled; modules see the gathered parameters.
    GATHERED = "gathered"


@dataclass
class GatherInFlight:
    """An all-gather between ``unshard`` and ``wait_for_unshard``; ``None`` fields: no
    collective (a one-rank shard group, or an aliased/empty unit)."""

    pending: Pending | None
    out: torch.Tensor | None  # rank-major output, allocated on the gather stream
    send: torch.Tensor | None  # what the collective reads (a cast copy, or the shard itself)
    position: Position | None
    post_forward: bool = False  # gathered over the post-forward group


@dataclass
class ReduceInFlight:
    """A reduce-scatter between ``reduce_grads`` and ``finish_reduce``."""

    pending: Pending | None
    out: torch.Tensor  # this rank's summed block (its shard, then the extra columns)
    full: torch.Tensor  # the packed input, held until compute has waited for the collective
    present: list[bool]
    position: Position | None
    reduced: Event | None = None  # CUDA: the reduce stream after the reduce-scatter
    done: Event | None = None  # CUDA: the last stream of the reduction, after ``.grad``


@dataclass
class PostForward:
    """NOTE [Resharding to a smaller group] (unit.py): the group, this rank in it, the unit's
    layout there."""

    size: int
    rank: int
    comm: Comm
    layout: FlatLayout


def tag_tail(world: int) -> int:
    """Elements a unit's all-gather shard ends in: the position tag, when there is another rank
    to compare with (NOTE [Collective positions])."""
    return TAG_LEN if world > 1 else 0


def unit_layout(shapes: list[torch.Size], world: int, dims: list[int] | None = None) -> FlatLayout:
    """The flat layout of a one-dtype unit's parameters over ``world`` ranks, as the engine
    gathers it (tag included): what the planner sizes a unit's shard and gather by."""
    return FlatLayout(shapes, world, tail=tag_tail(world), dims=dims)


def make_groups(
    params: list[ShardedParam],
    originals: list[torch.Tensor],
    mesh: MeshInfo,
    mp_policy: MixedPrecisionPolicy,
    shard_device: torch.device,
    pin_memory: bool,
    unit_name: str,
) -> list[ShardGroup]:
    """NOTE [Mixed-dtype units]: one group per dtype, widest first (alignment in bytes), then
    one per dtype of the parameters gathered through extension hooks (values in the flat
    buffer, then shards of their own: NOTE [Shards of their own] in copy_in.py); the last
    group carries the position tag. Parameters that ``param_dtype_override_fn`` keeps in their
    own dtype form groups of their own (computed in that dtype, not ``param_dtype``)."""

    def width(d: torch.dtype) -> int:
        return -torch.empty((), dtype=d).element_size()

    of = [gather_kind(t) for t in originals]
    kinds: list[tuple[str, torch.dtype, bool]] = []
    for kind in ("plain", "flat", "own"):
        keys = {
            (t.dtype, p.keeps_dtype)
            for p, t, k in zip(params, originals, of, strict=True)
            if k == kind
        }
        kinds += [(kind, d, keep) for d, keep in sorted(keys, key=lambda x: (width(x[0]), x[1]))]
    kinds = kinds or [("plain", torch.float32, False)]
    groups: list[ShardGroup] = []
    for i, (kind, dtype, keep) in enumerate(kinds):
        pairs = [
            (p, t)
            for p, t, k in zip(params, originals, of, strict=True)
            if t.dtype == dtype and k == kind and p.keeps_dtype == keep
        ]
        members = [p for p, _ in pairs]
        compute = dtype if keep else (mp_policy.param_dtype or dtype)
        # the tag ends the last group, so it ends what is sent
        tail = tag_tail(mesh.world_size) if i == len(kinds) - 1 else 0
        args = (members, dtype, compute, mesh, shard_device, pin_memory)
        if kind != "plain":
            cls = ExtensionGroup if kind == "flat" else CopyInGroup
            mp = replace(mp_policy, param_dtype=compute) if keep else mp_policy
            g: ShardGroup = cls(*args, tail, [t for _, t in pairs], mp)
        else:
            g = ShardGroup(*args, tail, align=len(kinds) > 1)
        g.unit_name = unit_name
        groups.append(g)
    return groups


def reduce_dtype_of(
    groups: list[ShardGroup], mp_policy: MixedPrecisionPolicy, unit: str
) -> torch.dtype:
    """FSDP2's rule: ``reduce_dtype``, else the dtype gradients are computed in."""
    if mp_policy.reduce_dtype is not None:
        return mp_policy.reduce_dtype
    computed = {g.compute_dtype for g in groups if any(p.requires_grad for p in g.params)}
    if len(computed) > 1:
        raise FullshardError(
            f"unit '{unit}' has trainable parameters computed in "
            f"{sorted(str(d) for d in computed)}; their gradients are reduced in one "
            "collective of one dtype. Pass MixedPrecisionPolicy(reduce_dtype=torch.float32) "
            "(or a param_dtype for the whole unit), or freeze the parameters of one dtype."
        )
    return computed.pop() if computed else groups[0].compute_dtype


def join_wire(parts: list[torch.Tensor]) -> torch.Tensor:
    """The groups' send parts as one buffer (NOTE [Mixed-dtype units]): the part itself when
    alone, concatenated in their dtype when they share one, else as bytes."""
    if len(parts) == 1:
        return parts[0]
    if len({t.dtype for t in parts}) == 1:
        return torch.cat(parts)
    return torch.cat([t.view(torch.uint8) for t in parts])


def pre_divide_factor(n: int, reduce_dtype: torch.dtype, divide_factor: float | None) -> int:
    """NOTE [Dividing the sum]: fp16 sums of ``n`` ranks are pre-divided by a power of two near
    sqrt(n), as FSDP2 does, so that n gradients cannot overflow; other dtypes (and a custom
    divide factor) divide after the sum (exact against one process in fp32)."""
    if reduce_dtype is not torch.float16 or divide_factor is not None or n <= 1:
        return 1
    pre = 1
    while n % (pre * 2) == 0 and n // (pre * 2) >= pre * 2:
        pre *= 2
    return pre


def hook_divisor(
    n: int, reduce_dtype: torch.dtype, divide_factor: float | None, force_sum: bool
) -> float:
    """NOTE [What the all-reduce hook sees]
    FSDP2 divides the sum over the ``n`` data-parallel ranks inside its collectives where it
    can: in fp32 and bf16 its reduce-scatter averages (``ReduceOp.AVG``, or a pre-multiplied
    sum by 1 / ``set_gradient_divide_factor``), so its all-reduce hook receives the average. In
    other dtypes (fp16 for overflow, fp64), or with ``set_force_sum_reduction_for_comms(True)``,
    it reduces with ``SUM``: the hook receives the sum divided by a pre-factor (fp16/fp64: the
    power of two its loop below finds; fp32/bf16: 1) and the rest of the division follows the
    hook. fullshard always sums on the wire (NOTE [Dividing the sum]); when a hook is set it
    divides the summed shard by what FSDP2 has divided by at that point, runs the hook (which
    may change the shard in place: torchft all-reduces it across replica groups), then divides
    by the rest. This returns that divisor. Without a hook nothing of this runs."""
    factor = float(divide_factor) if divide_factor is not None else float(n)
    plain = reduce_dtype in (torch.float32, torch.bfloat16)
    if plain and not force_sum:
        return factor  # averaged (or pre-multiplied by 1 / factor) by the collective
    if plain:
        return 1.0  # a plain sum; FSDP2 post-divides by the whole factor
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return float(pre)


def post_accumulate_hooks(p: ShardedParam) -> list[Callable[[torch.Tensor], None]]:
    """NOTE [Post-accumulate-grad hooks on sharded parameters]
    ``register_post_accumulate_grad_hook`` on a sharded parameter (the optimizer-in-backward
    pattern: step each parameter as soon as its gradient exists) never fires by itself: autograd
    accumulates into the gathered parameter, not the shard. As FSDP2 does, the unit calls those
    hooks itself, once per parameter per reduction, right after the reduced (and, under HSDP,
    all-reduced) shard became ``.grad``."""
    hooks = getattr(p.sharded, "_post_accumulate_grad_hooks", None)
    return list(hooks.values()) if hooks else []


def run_all_reduce_hook(
    hook: Callable[[torch.Tensor], None], stream: Any, shard: torch.Tensor, ordered: bool
) -> None:
    """FSDP2's all-reduce hook: ``hook(reduce_output)`` on the unit's reduced shard (after the
    HSDP all-reduce, else after the reduce-scatter), divided as NOTE [What the all-reduce hook
    sees]; e.g. torchft all-reduces it across replica groups there. On ``stream`` when one was
    given: ordered after the reduction and before what follows on the CUDA path (``ordered``);
    on the host path, where everything runs in order, it is only made current for the hook (a
    ``torch.cpu.Stream`` on CPU), as FSDP2 does."""
    if stream is None:
        hook(shard)
        return
    if not ordered:
        with torch.get_device_module(shard.device).stream(stream):
            hook(shard)
        return
    here = current_stream(shard.device)
    stream.wait_stream(here)
    with use_stream(stream):
        hook(shard)
    here.wait_stream(stream)


def refuse_regrouping(
    groups: list[ShardGroup], unit: str, what: str, *, one_dtype: bool = False
) -> None:
    """``what`` (an int ``reshard_after_forward``, a cast after ``fully_shard``) rebuilds or
    regroups a unit's shards: refused for the groups it cannot handle."""
    if any(g.extension for g in groups):
        raise FullshardError(
            f"unit '{unit}' has parameters gathered through all-gather extension hooks (tensor "
            f"subclasses, e.g. float8 weights); {what} is not supported for them (nor in torch "
            "FSDP2). Pass reshard_after_forward as True or False, and cast the model before "
            "calling fully_shard."
        )
    if one_dtype and len(groups) > 1:
        raise FullshardError(
            f"unit '{unit}' mixes dtypes; reshard_after_forward as an int is supported "
            "for units of one dtype. Pass True or False, or shard the parts separately."
        )


def refuse_narrow_fixed_order(
    trainable: list[ShardedParam], reduce_dtype: torch.dtype, unit: str
) -> None:
    """``fullshard.deterministic`` sums in a tree whose partial sums must not be rounded: a
    reduce dtype narrower than a trainable parameter is refused (at ``enable``, and again when
    a parameter thaws: NOTE [Freezing after fully_shard])."""
    bits = torch.finfo(reduce_dtype).bits
    narrow = [p.fqn for p in trainable if bits < torch.finfo(p.sharded.dtype).bits]
    if narrow:
        raise FullshardError(
            f"unit '{unit}' reduces {narrow[0]} in {reduce_dtype}, narrower than the "
            "parameter: fixed-order mode needs MixedPrecisionPolicy(reduce_dtype=) equal to "
            "the parameters' dtype (e.g. torch.float32 with bf16 compute)"
        )


def refuse_unreduced_change(
    changed: list[ShardedParam],
    accumulated: dict[int, torch.Tensor],
    partial_reduce: torch.Tensor | None,
    unit: str,
) -> None:
    """NOTE [Freezing after fully_shard]: ``requires_grad`` changed while gradients kept
    without sync (NOTE [Accumulating without sync]) wait to be reduced in the old layout."""
    names = [
        p.fqn
        for p in changed
        if id(p) in accumulated or (p.unsharded is not None and p.unsharded.grad is not None)
    ]
    if not names and partial_reduce is None:
        return
    what = f"parameter(s) {', '.join(names)}" if names else "the unit's reduce-scatter"
    raise FullshardError(
        f"rank {changed[0].mesh.rank}: requires_grad of {', '.join(p.fqn for p in changed)} in "
        f"unit '{unit}' changed while gradients accumulated without sync "
        f"(set_requires_gradient_sync(False) / set_requires_all_reduce(False)) for {what} "
        "are not reduced yet; they are reduced in the old layout, so they would be lost. "
        "Change requires_grad between steps, after the backward that reduces."
    )


def gradient_receivers(flight: ReduceInFlight, k: int, world: int, replicated: bool) -> list[bool]:
    """NOTE [Which gradients exist]: which of the ``k`` trainable parameters get ``.grad``
    from this reduction (call once it has landed)."""
    if all(flight.present):
        return flight.present  # the common case: nothing to read
    if world == 1 and not replicated:
        return flight.present  # this rank is the whole group
    if flight.position is None:
        return [True] * k  # no presence bits here: an exact zero
    counts = flight.out[flight.out.numel() - k - TAG_BITS : flight.out.numel() - TAG_BITS]
    if cuda_semantics(counts.device):
        return [True] * k  # reading would synchronise the host: an exact zero
    return [c > 0 for c in counts.tolist()]


def shard_and_counts(flight: ReduceInFlight, k: int) -> torch.Tensor:
    """HSDP: the summed shard and, right after it, the ``k`` presence counts (NOTE [Which
    gradients exist]), so that the replicas' all-reduce sums those too (a few elements)."""
    n = flight.out.numel() - (k + TAG_BITS if flight.position is not None else 0)
    return flight.out[: n + (k if flight.position is not None else 0)]


def check_reduce_tags(
    verdict: Verdict, flight: ReduceInFlight, trainable: list[ShardedParam], mesh: MeshInfo
) -> None:
    """Hand a reduce-scatter's presence bits and tag to the verdict (NOTE [Which gradients
    exist] in unit.py): every rank's block before the sum (gloo), else the summed columns."""
    if flight.position is None or not moves_data(mesh.group):
        return  # NOTE [Backends that move no data]: nothing to check, nothing to slice
    names = [p.fqn for p in trainable]
    k = len(names) + TAG_BITS  # presence bits, then tag bits
    rows = flight.pending.rows if flight.pending is not None else None
    if rows is not None:  # gloo: every rank's block, before the sum
        verdict.reduce_rows(rows[:, -k:], mesh.rank, flight.position, mesh.group, names)
    else:
        verdict.reduce_sums(flight.out[-k:], mesh.world_size, flight.position, mesh.group, names)
