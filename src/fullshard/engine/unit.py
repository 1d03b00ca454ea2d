"""One communication unit (layer 6): the parameters of one ``fully_shard`` call, and their whole
lifecycle in one object, as FSDP2's ``FSDPParamGroup``: unshard (issue the all-gather), wait
(copy out, show the gathered parameters), reshard (free), and reduce gradients (pack, one
reduce-scatter, the HSDP all-reduce, divide, accumulate into ``.grad``). The collectives
themselves are pure functions over tensors (``fullshard.comm.collectives``), reached through the
unit's bound ``Comm``; which stream runs what is NOTE [Streams and buffer lifetimes]. The file
reads in the order of a unit's life: its states and the records of its collectives in flight,
then ``CommUnit`` (build, gather, free, reduce), then the pure parts its steps call (its dtype
groups, the reduction's arithmetic, the checks of a change), none of which communicates, waits
or touches a stream.

NOTE [Unit states]
SHARDED --unshard--> GATHERING --wait_for_unshard--> GATHERED --reshard--> SHARDED.
While GATHERED the owning modules see the gathered parameters; otherwise they see the shards.
Only ``wait_for_unshard`` and ``reshard`` swap what the modules see, so a module never sees a
half-gathered unit.

NOTE [Decided once, checked each step]
What a unit does in a steady step is the same step after step, and on a GPU the host's time per
unit decides small and medium models (issue 45). So what each step would otherwise recompute
is made once and kept with the thing it depends on, and each step only checks, by identity,
that this thing is still the one it was made for (a check costs an attribute read; the work it
saves cost tensor ops and Python calls):

- the views the gather's copy-out writes (``FlatLayout.copy_targets``): per gathered storage,
  made again when a storage is built (a cast, ``to_empty``, a load with ``assign=True``);
- the tag slot of the send buffer and the table its row comes from (``ShardGroup.phase_seq_slot``):
  per flat shard buffer;
- the reduce-scatter's tag columns (``desync.reduce_tag_columns``): per unit index, presence
  pattern, dtype and world size;
- where each gradient lies in the reduced shard (``_grad_rows``): per trainable layout, made
  again whenever ``trainable`` is (NOTE [Freezing after fully_shard]);
- the parameter dictionaries the unit writes to show gathered or sharded parameters
  (``_show``): per unit, for its lifetime (a module keeps its ``_parameters`` dict);
- the units holding gathered memory (``live``) and the backward's next unit
  (``Prefetcher.backward_targets``): kept as units change state, and per recorded order;
- the gradient accumulators the post-backward count asks about: NOTE [Gradient accumulators
  kept] (hooks.py); whether a backward is restricted to inputs: per graph task;
- a group's backend and a collective's route: NOTE [A step's collectives on the host].

A change of what the step does (``requires_grad``, a unit skipped or optional, another order,
another world: a new root and new units) is noticed where it happens, and what depends on it
is made again there; the ``requires_grad`` flags themselves have no version to compare, so
each forward reads them (one comprehension of attribute reads per unit: NOTE [Freezing after
fully_shard]). ``tests/fast/test_fast_host_calls.py`` counts what is left: NOTE [A count, not
a clock].

NOTE [Resharding to a smaller group]
``reshard_after_forward=k`` (an int, FSDP2's): after forward each rank keeps its rows of the
unit sharded over k ranks (``post_forward_shard``: k consecutive ranks, e.g. one node), so
backward all-gathers within that group only, for k times the memory of a full reshard.

NOTE [Accumulating without sync]
With ``set_requires_gradient_sync(False)`` the unsharded gradients stay on the rank and the next
backward adds to them. When they are computed in a narrower dtype than the reduce dtype (bf16
compute, fp32 reduce), they are kept in the reduce dtype between backwards (as FSDP2 does), so
k micro-batches of bf16 gradients are not summed in bf16. ``set_requires_all_reduce(False)``
(HSDP) reduce-scatters every micro-batch but keeps the sum on the rank instead of all-reducing
it across replicas; the next all-reduce sends the total.

NOTE [Reducing on streams]
On CUDA (NCCL, or the CUDA emulation) a unit's whole reduction is queued at its post-backward,
in stream order, and the host never waits: the reduce-scatter on the reduce stream; the reduce
stream waits for it and reads the tags; under HSDP the all-reduce at once, on its own stream
after an event of the reduce stream (so the next unit's reduce-scatter does not queue behind
it); the all-reduce hook, the division, the one cast and (offload) the copy to pinned memory,
and ``.grad``, on the last of those streams. Compute then waits twice, as in FSDP2: for the
reduce-scatter before the packed input it made may be reused (rule 3, at the next unit's
post-backward), and for the end of every reduction once, at the end of backward, before the
optimizer reads ``.grad``. Under HSDP the reduce-scatter's output (which the all-reduce stream
uses) is held until that end-of-backward wait, so the reduce stream's next allocation can never
reuse it while the all-reduce still runs. On gloo the collectives are waited for on the host,
so the finish (wait, local sum, all-reduce, ``.grad``) is deferred to the next unit's
post-backward, where the host would block anyway.

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
from torch import nn

from fullshard.comm.collectives import Comm, CommStats, Pending
from fullshard.comm.desync import (
    TAG_BITS,
    TAG_LEN,
    UNREGISTERED,
    Position,
    Verdict,
    moves_data,
    reduce_tag_columns,
    tags_exact,
    write_dynamic_tag,
    write_phase_seq,
    write_static_tag,
)
from fullshard.comm.device import cuda_semantics, current_stream, name_tensor, use_stream
from fullshard.comm.mesh import MeshInfo
from fullshard.engine.copy_in import CopyInGroup, gather_kind
from fullshard.engine.extension import ExtensionGroup
from fullshard.engine.param import GatheredStorage, ShardedParam, ShardGroup
from fullshard.engine.streams import Event, Streams, streams_for
from fullshard.policies import (
    CPUOffloadPolicy,
    FullshardError,
    MixedPrecisionPolicy,
    OffloadPolicy,
    Phase,
)
from fullshard.shard.layout import FlatLayout, contiguous_stride, local_shape


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


class CommUnit:
    """The parameters of one ``fully_shard`` call, sharded over one group, and their
    lifecycle: ``unshard`` / ``wait_for_unshard`` / ``reshard`` (NOTE [Unit states]), and
    ``reduce_grads`` / ``finish_reduce`` / ``end_reduces`` (NOTE [Reducing on streams])."""

    def __init__(
        self,
        name: str,
        module: nn.Module,
        params: list[ShardedParam],
        originals: list[torch.Tensor],
        mesh: MeshInfo,
        mp_policy: MixedPrecisionPolicy,
        offload: OffloadPolicy | None = None,
    ) -> None:
        self.module = module
        self.params = params
        self.mesh = mesh
        self.mp_policy = mp_policy
        self.comm = Comm(mesh.group, mesh.timeout, name, replicate_group=mesh.replicate_group)
        self.post_forward: PostForward | None = None
        self.post_forward_shard: torch.Tensor | None = None
        # compute's event after packing post_forward_shard: the backward gather reads it
        self.post_forward_event: Event | None = None
        self.name = name
        self.index = UNREGISTERED  # set by the root (NOTE [Collective positions])
        self.verdict = Verdict()  # replaced by the root's
        self.streams: Streams = streams_for(mesh.device)
        self.state = UnitState.SHARDED
        # the units holding gathered memory, this one among them while it does: its root's
        # set once it has one (``share_live``), so NOTE [Gathered window] counts a few units,
        # not every unit of the model, at each prefetch
        self.live: set[CommUnit] = set()
        # (module._parameters, name, parameter) of every place a parameter is shown (``_show``)
        self._refs: list[tuple[dict[str, Any], str, ShardedParam]] | None = None
        # whether forward frees the gathered parameters: decided by ``fully_shard`` (None: FSDP2's
        # default, settled when the unit's parent is sharded (True) or at the root's lazy init
        # (False)); ``FSDPModule.set_reshard_after_forward`` changes it
        self.reshard_after_forward: bool | None = None
        self.reshard_after_backward = True
        self.unshard_in_backward = True
        # NOTE [Optional units] (schedule.py): FSDPModule.set_optional
        self.optional = False
        self.gather_in_flight: GatherInFlight | None = None
        self._offload_event: Event | None = None
        # CPUOffloadPolicy: shards, gradients and the optimizer step live on the CPU
        self.offload = isinstance(offload, CPUOffloadPolicy)
        self.shard_device = torch.device("cpu") if self.offload else mesh.device
        self.pin_memory = (
            isinstance(offload, CPUOffloadPolicy)
            and offload.pin_memory
            and cuda_semantics(mesh.device)
        )
        self.groups = self._make_groups(originals)
        self._set_trainable()
        self.requires_grad_sync = True
        self.requires_all_reduce = True
        self.divide_factor: float | None = None  # set_gradient_divide_factor
        # FSDPModule.set_force_sum_reduction_for_comms: what the all-reduce hook sees
        self.force_sum_reduction = False
        # FSDPModule.set_reduce_scatter_unused_params: .grad for every trainable parameter
        self.reduce_scatter_unused_params = False
        # FSDPModule.set_reduce_scatter_max_input_buffers: reduce-scatters in flight at once
        self.max_reduces_in_flight = 1
        # FSDPModule.set_keep_unsharded_storage: resharding keeps the gathered storage
        self.keep_unsharded_storage = False
        self.reduce_in_flight: ReduceInFlight | None = None
        # FSDPModule.set_all_reduce_hook: called on the summed shard before it is divided
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        self.all_reduce_hook_stream: Any = None  # a torch.cuda.Stream
        self.partial_reduce: torch.Tensor | None = None  # HSDP sum kept without all-reduce
        # NOTE [Accumulating without sync]: full gradients kept in the reduce dtype
        self.accumulated: dict[int, torch.Tensor] = {}
        # CUDA: reductions the backward waits for, with buffers another stream still uses
        self._done_events: list[tuple[Event | None, list[torch.Tensor]]] = []
        by_param = {id(p): g for g in self.groups for p in g.params}
        for g in self.groups:
            g.load([t for p, t in zip(params, originals, strict=True) if by_param[id(p)] is g])

    def _set_trainable(self) -> None:
        """Which parameters reduce gradients: their reduce-scatter layout, its dtype, and
        whether its tags are exact in that dtype at this group size (desync.py)."""
        self.trainable = [p for p in self.params if p.requires_grad]
        self.reduce_dtype = reduce_dtype_of(self.groups, self.mp_policy, self.name)
        world, dims = self.mesh.world_size, [p.dim for p in self.trainable]
        self.grad_layout = FlatLayout([p.shape for p in self.trainable], world, dims=dims)
        self._grad_dtype: torch.dtype | None = None  # the trainable's one dtype (_set_grads)
        # where each trainable parameter's rows lie in the reduced shard (``shard_view``'s
        # answer, made once: a gradient is then one view op)
        rank, layout = self.mesh.rank, self.grad_layout
        self._grad_rows = [
            (shape, contiguous_stride(shape), layout.slots[j].offset)
            for j, shape in enumerate(
                local_shape(s.shape, world, rank, s.dim) for s in layout.slots
            )
        ]
        self.reduce_tags = world > 1 and tags_exact(self.reduce_dtype, world)
        if self.comm.fixed_order:  # fullshard.deterministic: checked again for what thawed
            refuse_narrow_fixed_order(self.trainable, self.reduce_dtype, self.name)

    def sync_requires_grad(self) -> None:
        """NOTE [Freezing after fully_shard]: at each forward, follow ``requires_grad_`` calls
        made since the last one on either object of a parameter (the sharded one, or the
        gathered one while the modules showed it)."""
        # one comprehension of attribute reads per unit, no call per parameter (bools: ``is``)
        changed = [
            p
            for p in self.params
            if p.sharded.requires_grad is not p.requires_grad
            or (p.unsharded is not None and p.unsharded.requires_grad is not p.requires_grad)
        ]
        if not changed:
            return
        self.finish_reduce()  # a reduction in flight was packed in the old layout
        refuse_unreduced_change(changed, self.accumulated, self.partial_reduce, self.name)
        for p in changed:
            p.set_requires_grad(not p.requires_grad)
        self._set_trainable()

    # -- the single-dtype view most callers want ------------------------------------------
    @property
    def storage(self) -> GatheredStorage:
        """The first dtype group's gathered storage (the unit's, unless it mixes dtypes)."""
        return self.groups[0].storage

    @property
    def name(self) -> str:
        return self.comm.unit

    @name.setter
    def name(self, value: str) -> None:
        self.comm.unit = value
        if self.post_forward is not None:
            self.post_forward.comm.unit = value
        for g in getattr(self, "groups", []):
            g.unit_name = value

    @property
    def stats(self) -> CommStats:
        """The counters this unit's collectives report to (its root's, once it has one)."""
        return self.comm.stats

    def bind(self, stats: CommStats, verdict: Verdict, index: int) -> None:
        """The root's counters, desync verdict, and the unit's index in the registration order
        every rank shares (NOTE [Collective positions])."""
        self.comm.stats = stats
        if self.post_forward is not None:
            self.post_forward.comm.stats = stats
        verdict.take(self.verdict)  # checks of gathers issued before the root existed
        self.verdict = verdict
        self.index = index
        for g in self.groups:
            g.write_static_tag(index)

    def share_live(self, live: set[CommUnit]) -> None:
        """Keep this unit's place in ``live`` (its root's) from now on."""
        self.live.discard(self)
        self.live = live
        if self.gathered:
            live.add(self)

    def set_post_forward_group(self, size: int) -> None:
        """NOTE [Resharding to a smaller group] (``reshard_after_forward=size``)."""
        refuse_regrouping(self.groups, self.name, "reshard_after_forward as an int", one_dtype=True)
        group, rank = self.mesh.post_forward_group(size)
        comm = Comm(group, self.mesh.timeout, self.name, self.comm.stats)
        # the same shard dims: a Shard(k) size divisible by the group divides by ``size`` too
        layout = unit_layout([p.shape for p in self.params], size, [p.dim for p in self.params])
        self.post_forward = PostForward(size, rank, comm, layout)

    # -- shards ---------------------------------------------------------------------------
    def refresh_shards(self) -> None:
        """Re-adopt shards that ``_apply`` (``to_empty``, ``.to()``) replaced or moved, and copy
        them back into a flat buffer, so one collective can send the unit again. A cast after
        ``fully_shard`` (``model.to(torch.float64)``, ``model.double()``) rebuilds the unit's
        dtype groups from the cast shards (NOTE [Mixed-dtype units])."""
        detached = [g.detached(self) for g in self.groups]
        if any(p.sharded.dtype != g.dtype for g in self.groups for p in g.params):
            self._recast()
            return
        for g, moved in zip(self.groups, detached, strict=True):
            if moved:
                g.reattach()
                g.write_static_tag(self.index)

    def _make_groups(self, originals: list[torch.Tensor]) -> list[ShardGroup]:
        """The unit's groups (NOTE [Mixed-dtype units]), told where their shards live."""
        groups = make_groups(
            self.params,
            originals,
            self.mesh,
            self.mp_policy,
            self.shard_device,
            self.pin_memory,
            self.name,
        )
        for g in groups:
            g.host_shards = self.offload
        return groups

    def _recast(self) -> None:
        refuse_regrouping(self.groups, self.name, "a cast after fully_shard")
        originals = [p.local for p in self.params]
        self.groups = self._make_groups(originals)
        for g in self.groups:
            g.reattach()  # copies each cast shard into the new group's flat buffer
            g.write_static_tag(self.index)
        self._set_trainable()

    # -- unshard / wait / reshard ---------------------------------------------------------
    def unshard(self, phase: Phase = Phase.IDLE) -> None:
        """Issue the unit's all-gather if it is not gathered or gathering already (``phase``:
        for a forward, a backward, or neither)."""
        if self.state is not UnitState.SHARDED:
            return
        self.state = UnitState.GATHERING
        self.live.add(self)
        if self.post_forward_shard is not None and phase is not Phase.BACKWARD:
            self.post_forward_shard = None  # backward did not come for it (another forward)
        if self.mesh.world_size == 1 or not self.params:
            # Nothing to move: the shards are whole parameters (an empty unit has nothing
            # either; every rank agrees, see NOTE [Same model on every rank]).
            self.gather_in_flight = GatherInFlight(None, None, None, None)
            return
        s = self.streams
        pf = self.post_forward if self.post_forward_shard is not None else None
        comm = pf.comm if pf is not None else self.comm
        pos = comm.position("all_gather", phase, self.index)
        if phase is Phase.IDLE:
            s.gather_ready()  # outside a step's forward/backward: the optimizer may have run
        if pf is not None:  # the shard compute packed after forward (FSDP2's reshard event)
            s.gather_waits(self.post_forward_event)
            self.post_forward_event = None
        with s.on(s.gather):
            if pf is not None:
                assert self.post_forward_shard is not None
                send, self.post_forward_shard = self.post_forward_shard, None
                write_dynamic_tag(send[-TAG_LEN:], pos)
                numel = pf.layout.total_numel
            else:
                send = self._wire(pos)
                numel = send.numel() * self.mesh.world_size
            out = comm.gather_buffer(numel, send.dtype, send.device)
            if s.cuda:  # a name for the CUDA emulation's messages
                name_tensor(out, lambda: f"all-gather output of unit '{self.name}'")
            pending = comm.all_gather(out, send, pos)  # type: ignore[arg-type]
        self.gather_in_flight = GatherInFlight(pending, out, send, pos, pf is not None)

    def _wire(self, pos: Position) -> torch.Tensor:
        """This rank's whole unit as one send buffer (NOTE [Mixed-dtype units]), its position
        tag at the end (NOTE [Collective positions]: written into what is sent, a copy when
        cast)."""
        parts = [t for g in self.groups for t in g.wire_parts()]
        write_phase_seq(*self.groups[-1].phase_seq_slot(parts[-1]), pos)
        return join_wire(parts)

    def wait_for_unshard(self, phase: Phase = Phase.IDLE) -> None:
        """Make the unit GATHERED: issue the gather if needed, wait for it, copy out, expose."""
        if self.state is UnitState.GATHERED:
            return
        if self.state is UnitState.SHARDED:
            self.unshard(phase)
        flight, self.gather_in_flight = self.gather_in_flight, None
        assert flight is not None
        if flight.pending is None:
            for g in self.groups:
                g.gather_locally()  # one rank: a cast or a host-to-device copy, or nothing
        else:
            assert flight.out is not None and flight.send is not None and flight.position
            s = self.streams
            if s.cuda:
                with s.on(s.gather):
                    flight.pending.wait()  # NCCL: the gather stream waits
                s.compute_waits(s.record(s.gather))
            else:
                flight.pending.wait()  # gloo: a bounded host wait
            tails = self._copy_out(flight)
            if s.cuda:
                # rule 2: the output (and a cast copy of the shard) may go once the copy-out
                # has read it; in forward one unit later, so the next all-gather need not wait
                s.gathered([flight.out, flight.send], defer=phase is Phase.FORWARD)
            pf = self.post_forward if flight.post_forward else None
            me, group = (pf.rank, pf.comm.group) if pf else (self.mesh.rank, self.mesh.group)
            pos = flight.position
            del flight
            # raises before the modules see anything when the check is free (CPU)
            self.verdict.gather(tails, me, pos, group)
        self._show(gathered=True)
        self.state = UnitState.GATHERED

    def _copy_out(self, flight: GatherInFlight) -> torch.Tensor:
        """Rank-major output -> each group's gathered storage; returns every rank's tag."""
        assert flight.out is not None
        if flight.post_forward:
            assert self.post_forward is not None
            g, layout = self.groups[0], self.post_forward.layout
            g.storage.alloc()
            tails = torch.empty(
                layout.world, TAG_LEN, dtype=flight.out.dtype, device=flight.out.device
            )
            with torch.no_grad():
                layout.copy_out(flight.out, g.storage.flat, tails, dest=g.layout)
            return tails
        world = self.mesh.world_size
        rows = flight.out.view(world, -1)
        tail_dtype = self.groups[-1].tail_dtype  # the last group carries the tag
        tails = torch.empty(world, TAG_LEN, dtype=tail_dtype, device=rows.device)
        if len(self.groups) == 1:  # its columns are the whole output
            self.groups[0].copy_out(rows, tails)
            return tails
        start = 0
        for g in self.groups:
            width = g.wire_width(rows.dtype)
            g.copy_out(rows[:, start : start + width], tails)
            start += width
        return tails

    def reshard(self, after_forward: bool = False) -> None:
        """Free the gathered storage and show the shards to the modules again. After a forward
        whose backward will come, a unit with a post-forward group keeps its rows there."""
        if self.state is UnitState.GATHERING:
            self.wait_for_unshard()  # the gather must land first; collectives stay paired
        if self.state is UnitState.GATHERED:
            if after_forward and self.post_forward is not None and self.mesh.world_size > 1:
                self._keep_post_forward_shard()
            self._show(gathered=False)
            if not self.keep_unsharded_storage:
                for g in self.groups:
                    g.free()
            self.state = UnitState.SHARDED
            self.live.discard(self)

    def _show(self, gathered: bool) -> None:
        """Every owning module sees the gathered (or the sharded) parameters:
        ``ShardedParam.expose`` for the whole unit, in one loop over the modules' parameter
        dicts (kept: a module's ``_parameters`` is one dict for its lifetime)."""
        refs = self._refs
        if refs is None:
            refs = self._refs = [(m._parameters, n, p) for p in self.params for m, n in p.refs]
        if gathered:
            for params, name, p in refs:
                assert p.unsharded is not None
                params[name] = p.unsharded
        else:
            for params, name, p in refs:
                params[name] = p.sharded

    def _keep_post_forward_shard(self) -> None:
        """NOTE [Resharding to a smaller group]: this rank's rows of the gathered unit over k."""
        pf = self.post_forward
        assert pf is not None
        g = self.groups[0]
        shard = torch.empty(pf.layout.shard_numel, dtype=g.compute_dtype, device=self.mesh.device)
        with torch.no_grad():
            fulls = [p.unsharded for p in self.params]  # views of the gathered storage
            pf.layout.pack_shard(fulls, pf.rank, shard)  # type: ignore[arg-type]
        write_static_tag(shard[-TAG_LEN:], self.index)
        self.post_forward_shard = name_tensor(shard, lambda: f"post-forward shard of '{self.name}'")
        self.post_forward_event = self.streams.record_compute()

    # -- reduce gradients (NOTE [Reducing on streams]) -------------------------------------
    def accumulate_unsynced(self) -> None:
        """NOTE [Accumulating without sync]: after a backward that does not reduce, keep the
        gradients computed in a narrower dtype in the reduce dtype."""
        for p in self.trainable:
            u = p.unsharded
            if u is None or u.grad is None or u.grad.dtype == self.reduce_dtype:
                continue
            grad = p.pop_grad()
            assert grad is not None
            kept = self.accumulated.get(id(p))
            if kept is None:
                self.accumulated[id(p)] = grad.to(self.reduce_dtype)
            else:
                kept += grad

    def reduce_grads(self) -> None:
        """Reduce-scatter the unit's unsharded gradients (asynchronously) and drop them."""
        if not self.trainable:
            return
        self.finish_reduce()  # at most one reduce-scatter of a unit in flight
        world, dtype, device = self.mesh.world_size, self.reduce_dtype, self.mesh.device
        if self.accumulated:  # NOTE [Accumulating without sync]
            grads = [self._full_grad(p) for p in self.trainable]
        else:
            grads = [p.pop_grad() for p in self.trainable]
        present = [g is not None for g in grads]
        pos, extra = None, None
        if self.reduce_tags:
            # NOTE [Which gradients exist] and [Collective positions]: every rank's block ends
            # in this rank's presence bits and tag, so the sum says whether the ranks agreed
            pos = self.comm.position("reduce_scatter", Phase.BACKWARD, self.index)
            # in the gradients' dtype (0 and 1 are exact in any), so the pack needs no cast;
            # contiguous, so that the pack keeps CUDA's single-kernel _chunk_cat path
            bits = next(iter([g.dtype for g in grads if g is not None]), dtype)
            extra = reduce_tag_columns(pos, present, bits, device, world)
        # packed on the compute stream, where autograd made the gradients (rule 3)
        s = self.streams
        full = self.grad_layout.pack_for_reduce(
            grads, dtype=dtype, device=device, extra=extra, cast_in_kernel=s.cuda
        )
        if s.cuda:  # a name for the CUDA emulation's messages
            name_tensor(full, lambda: f"packed gradients of unit '{self.name}'")
        del grads  # the packed copy is all we need: the full gradients go now
        # NOTE [Dividing the sum]: only fp16 pre-divides (no call for the others)
        pre = self._pre_divide_factor() if self.reduce_dtype is torch.float16 else 1
        if pre != 1:  # NOTE [Dividing the sum]: the gradient columns only; the tags stay exact
            full[:, : self.grad_layout.shard_numel].div_(pre)
        if world == 1 and self.comm.replicate_group is None:
            # nothing to communicate: the full gradient is the shard, made on compute, and
            # finishing it on compute costs no stream hand-over
            self.reduce_in_flight = ReduceInFlight(None, full.view(-1), full, present, pos)
            return
        pending = None
        with s.begin_reduce():
            if world == 1:
                out = full.view(-1)  # HSDP with a one-rank shard group: only the all-reduce
            else:
                out = self.comm.reduce_buffer(full.shape[1], dtype, device)
                if s.cuda:
                    name_tensor(out, lambda: f"reduce-scatter output of unit '{self.name}'")
                pending = self.comm.reduce_scatter(out, full, pos)  # type: ignore[arg-type]
        flight = ReduceInFlight(pending, out, full, present, pos)
        if s.cuda:
            # NOTE [Reducing on streams]: the whole reduction is queued now, in stream order
            self._reduce_on_streams(flight)
            flight.pending = None
        self.reduce_in_flight = flight

    def has_unreduced_grads(self) -> bool:
        """Gradients a backward without sync left on the rank (NOTE [Accumulating without
        sync]), for ``FSDPModule.finalize_backward`` to reduce."""
        if self.accumulated:
            return True
        return any(p.unsharded is not None and p.unsharded.grad is not None for p in self.trainable)

    def _full_grad(self, p: ShardedParam) -> torch.Tensor | None:
        """The gradient to reduce (taken off the parameter): this backward's plus what was
        accumulated without sync."""
        grad = p.pop_grad()
        kept = self.accumulated.pop(id(p), None)
        if kept is None:
            return grad
        if grad is not None:
            kept += grad
        return kept

    def _pre_divide_factor(self) -> int:
        """NOTE [Dividing the sum]: what fp16 sums are divided by before the reduce-scatter."""
        n = self.mesh.data_parallel_size
        return pre_divide_factor(n, self.reduce_dtype, self.divide_factor)

    def _reduce_on_streams(self, flight: ReduceInFlight) -> None:
        """CUDA: the reduce-scatter's result, the HSDP all-reduce (on its own stream, issued at
        once), the division and ``.grad``, queued in stream order without a host wait."""
        s, layout = self.streams, self.grad_layout
        shard = flight.out[: layout.shard_numel]
        with s.on(s.reduce):
            if flight.pending is not None:
                flight.pending.wait()  # the reduce stream waits (NCCL); no host wait
                check_reduce_tags(self.verdict, flight, self.trainable, self.mesh)
            flight.reduced = s.record(s.reduce)  # rule 3: compute waits on this before reuse
        last = s.reduce
        summed: torch.Tensor | None = shard
        if self.comm.replicate_group is not None:
            summed = self._hsdp_sum(
                shard_and_counts(flight, len(self.trainable)), on=s.all_reduce, after=flight.reduced
            )
            summed = None if summed is None else summed[: layout.shard_numel]
            last = s.all_reduce
        if summed is not None:
            with s.on(last):
                self._finish_shard(summed, self._receivers(flight))
        flight.done = s.record(last)  # the end of backward orders compute after it

    def _hsdp_sum(
        self, shard: torch.Tensor, on: object = None, after: Event | None = None
    ) -> torch.Tensor | None:
        """HYBRID / NO_SHARD: the shard's sum over the replicas (or, without all-reduce, kept
        for the next one: NOTE [Accumulating without sync]); ``None`` when kept."""
        s = self.streams
        if on is not None:
            on.wait_event(after)  # type: ignore[attr-defined]
        with s.on(on):
            if self.partial_reduce is not None:
                shard += self.partial_reduce
                self.partial_reduce = None
            if not self.requires_all_reduce:
                self.partial_reduce = shard
                return None
            # ordered after the reduce-scatter by the stream (gloo: by the host wait before)
            self.comm.all_reduce_replicas(shard).wait()
        return shard

    def finish_reduce(self) -> None:
        """Finish the unit's reduction: on gloo, wait for the reduce-scatter (and HSDP
        all-reduce) and accumulate the averaged shard into ``.grad``; on CUDA, where that is
        queued already, make compute wait before the packed input is reused (rule 3)."""
        flight, self.reduce_in_flight = self.reduce_in_flight, None
        if flight is None:
            return
        s, layout = self.streams, self.grad_layout
        side = self.mesh.world_size > 1 or self.comm.replicate_group is not None
        if s.cuda and side:
            s.compute_waits(flight.reduced)  # not the all-reduce: the end of backward waits
            # HSDP: the all-reduce stream still uses the reduce-scatter output (and, at one
            # rank per shard group, the packed input it reduced in place): they are released
            # only once compute has waited for it, at the end of backward
            held = [flight.out, flight.full] if self.comm.replicate_group is not None else []
            self._done_events.append((flight.done, held))
            return
        shard: torch.Tensor | None = flight.out[: layout.shard_numel]
        with s.on(s.reduce if side else None):
            if flight.pending is not None:
                flight.pending.wait()  # gloo: host wait and the local sum
                check_reduce_tags(self.verdict, flight, self.trainable, self.mesh)
            if self.comm.replicate_group is not None and shard is not None:
                shard = self._hsdp_sum(shard_and_counts(flight, len(self.trainable)))
                shard = None if shard is None else shard[: layout.shard_numel]
            if shard is not None:
                self._finish_shard(shard, self._receivers(flight))
        if side:
            s.compute_waits(s.record(s.reduce))
        del flight

    def _receivers(self, flight: ReduceInFlight) -> list[bool]:
        """NOTE [Which gradients exist]: the parameters some rank used get ``.grad`` (every
        trainable one with ``set_reduce_scatter_unused_params(True)``, as FSDP2)."""
        if self.reduce_scatter_unused_params:
            return [True] * len(self.trainable)
        replicated = self.comm.replicate_group is not None
        return gradient_receivers(flight, len(self.trainable), self.mesh.world_size, replicated)

    def end_reduces(self) -> None:
        """End of backward (CUDA): compute waits for every reduction queued this backward."""
        for event, _ in self._done_events:
            self.streams.compute_waits(event)
        self._done_events = []  # and the buffers held for the all-reduce stream go

    def _finish_shard(self, shard: torch.Tensor, present: list[bool]) -> None:
        # what the shard is divided by so far (only fp16 pre-divides: NOTE [Dividing the sum])
        divided: float = self._pre_divide_factor() if self.reduce_dtype is torch.float16 else 1
        if self.all_reduce_hook is not None:
            divided = self._run_all_reduce_hook(shard, divided)
        self._set_grads(shard, present, divided)

    def _run_all_reduce_hook(self, shard: torch.Tensor, divided: float) -> float:
        """NOTE [What the all-reduce hook sees]: divide as FSDP2 has when its hook runs, run
        the hook; returns what the shard is now divided by."""
        assert self.all_reduce_hook is not None
        seen = hook_divisor(
            self.mesh.data_parallel_size,
            self.reduce_dtype,
            self.divide_factor,
            self.force_sum_reduction,
        )
        if seen != divided:
            shard.div_(seen / divided)
        run_all_reduce_hook(
            self.all_reduce_hook, self.all_reduce_hook_stream, shard, self.streams.cuda
        )
        return seen

    def _set_grads(self, shard: torch.Tensor, present: list[bool], divided: float) -> None:
        factor = (self.divide_factor or self.mesh.data_parallel_size) / divided
        if factor != 1:
            shard.div_(factor)
        # one cast per unit, on the device, before any copy to the host (NOTE [Dividing the sum])
        dtype = self._grad_dtype
        if dtype is None or dtype != self.trainable[0].sharded.dtype:
            dtypes = {p.sharded.dtype for p in self.trainable}
            dtype = self._grad_dtype = dtypes.pop() if len(dtypes) == 1 else None
        if dtype is not None and shard.dtype != dtype:
            shard = shard.to(dtype)
        if self.offload:
            shard = self._to_host(shard)
        base = shard.storage_offset()
        for j, (p, (shape, stride, offset)) in enumerate(
            zip(self.trainable, self._grad_rows, strict=True)
        ):
            if not present[j]:
                continue  # NOTE [Which gradients exist]: no rank used it
            g = shard.as_strided(shape, stride, base + offset)  # this rank's rows of it
            if g.dtype != p.sharded.dtype:
                g = g.to(p.sharded.dtype)  # a mixed-dtype unit (NOTE [Mixed-dtype units])
            p.add_grad(g)  # a DTensor gradient over these rows
            # NOTE [Post-accumulate-grad hooks on sharded parameters]
            if getattr(p.sharded, "_post_accumulate_grad_hooks", None):
                for hook in post_accumulate_hooks(p):
                    hook(p.sharded)

    def _to_host(self, shard: torch.Tensor) -> torch.Tensor:
        """Offload: the gradient shard goes to host memory; with pinned memory the copy is
        asynchronous and the end of backward waits for it (``take_offload_event``)."""
        if (
            not self.pin_memory
            or any(p.sharded.grad is not None for p in self.trainable)
            or any(post_accumulate_hooks(p) for p in self.trainable)
        ):
            return shard.to("cpu")  # accumulating on the host (or a hook) needs the values now
        host = torch.empty(shard.shape, dtype=shard.dtype, pin_memory=True)
        name_tensor(host, lambda: f"gradient shard of unit '{self.name}' (pinned host)")
        host.copy_(shard, non_blocking=True)
        # recorded on the stream doing the copy (the reduce stream, or compute)
        self._offload_event = current_stream(shard.device).record_event()
        return host

    def take_offload_event(self) -> bool:
        """Whether a copy of gradients to pinned host memory was queued since the last call
        (the end of backward then makes the host wait for it, once for every unit)."""
        queued, self._offload_event = self._offload_event is not None, None
        return queued

    @property
    def gathered(self) -> bool:
        """True while gathered memory is held (in flight or complete)."""
        return self.state is not UnitState.SHARDED

    def __repr__(self) -> str:
        return f"CommUnit({self.name!r}, params={len(self.params)}, state={self.state.value})"


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
