"""One communication unit (layer 6): the parameters of one ``fully_shard`` call, and their whole
lifecycle in one object, as FSDP2's ``FSDPParamGroup``: unshard (issue the all-gather), wait
(copy out, show the gathered parameters), reshard (free), and reduce gradients (reduce-scatter
and accumulate into ``.grad``; those methods are in ``unit_reduce.py``). The collectives
themselves are pure functions over tensors (``fullshard.comm.collectives``), reached through the
unit's bound ``Comm``; which stream runs what is NOTE [Streams and buffer lifetimes].

NOTE [Unit states]
SHARDED --unshard--> GATHERING --wait_for_unshard--> GATHERED --reshard--> SHARDED.
While GATHERED the owning modules see the gathered parameters; otherwise they see the shards.
Only ``wait_for_unshard`` and ``reshard`` swap what the modules see, so a module never sees a
half-gathered unit.

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

NOTE [Resharding to a smaller group]
``reshard_after_forward=k`` (an int, FSDP2's): after forward each rank keeps its rows of the
unit sharded over k ranks (``post_forward_shard``: k consecutive ranks, e.g. one node), so
backward all-gathers within that group only, for k times the memory of a full reshard.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import nn

from fullshard.comm.collectives import Comm, CommStats, Pending
from fullshard.comm.desync import (
    TAG_LEN,
    UNREGISTERED,
    Position,
    Verdict,
    tags_exact,
    write_dynamic_tag,
    write_static_tag,
)
from fullshard.comm.device import cuda_semantics
from fullshard.comm.mesh import MeshInfo
from fullshard.engine.extension import ExtensionGroup, has_extension_hooks
from fullshard.engine.param import GatheredStorage, ShardedParam
from fullshard.engine.shards import ShardGroup
from fullshard.engine.streams import Event, Streams, streams_for
from fullshard.engine.unit_reduce import ReduceGrads, ReduceInFlight
from fullshard.policies import (
    CPUOffloadPolicy,
    FullshardError,
    MixedPrecisionPolicy,
    OffloadPolicy,
)
from fullshard.shard.layout import FlatLayout
from fullshard.testing import emulation


class UnitState(enum.Enum):
    """See NOTE [Unit states]."""

    # Only shards are held; modules see the sharded parameters.
    SHARDED = "sharded"
    # An all-gather is in flight; modules still see the shards.
    GATHERING = "gathering"
    # The gathered storage is allocated and filled; modules see the gathered parameters.
    GATHERED = "gathered"


def gather_phase(why: str) -> str:
    """The phase name a gather reports in its position (NOTE [Collective positions])."""
    if why.startswith("forward"):
        return "forward gather"
    if why.startswith("backward") or why == "recompute":
        return "backward gather"
    return "unshard()"


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
class PostForward:
    """NOTE [Resharding to a smaller group]: the group, this rank in it, the unit's layout there."""

    size: int
    rank: int
    comm: Comm
    layout: FlatLayout


class CommUnit(ReduceGrads):
    """The parameters of one ``fully_shard`` call, sharded over one group."""

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
        self.reshard_after_forward = True
        self.reshard_after_backward = True
        self.unshard_in_backward = True
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
        self.groups = self._make_groups(params, originals)
        self.trainable = [p for p in params if p.requires_grad]
        self.reduce_dtype = self._reduce_dtype()
        self.grad_layout = FlatLayout(
            [p.shape for p in self.trainable],
            mesh.world_size,
            dims=[p.dim for p in self.trainable],
        )
        # reduce-scatter tags are exact in the reduce dtype up to a group size (desync.py)
        self.reduce_tags = mesh.world_size > 1 and tags_exact(self.reduce_dtype, mesh.world_size)
        self.init_reduce_state()
        by_param = {id(p): g for g in self.groups for p in g.params}
        for g in self.groups:
            g.load([t for p, t in zip(params, originals, strict=True) if by_param[id(p)] is g])

    def _make_groups(
        self, params: list[ShardedParam], originals: list[torch.Tensor]
    ) -> list[ShardGroup]:
        """NOTE [Mixed-dtype units]: one group per dtype, widest first (alignment in bytes), then
        one per dtype of the parameters gathered through extension hooks; the last group carries
        the position tag."""

        def width(d: torch.dtype) -> int:
            return -torch.empty((), dtype=d).element_size()

        kinds: list[tuple[bool, torch.dtype]] = []
        for ext in (False, True):
            dtypes = {t.dtype for t in originals if has_extension_hooks(t) == ext}
            kinds += [(ext, d) for d in sorted(dtypes, key=width)]
        kinds = kinds or [(False, torch.float32)]
        world = self.mesh.world_size
        groups: list[ShardGroup] = []
        for i, (ext, dtype) in enumerate(kinds):
            pairs = [
                (p, t)
                for p, t in zip(params, originals, strict=True)
                if t.dtype == dtype and has_extension_hooks(t) == ext
            ]
            members = [p for p, _ in pairs]
            compute = self.mp_policy.param_dtype or dtype
            # the tag ends the last group, so it ends what is sent
            tail = TAG_LEN if world > 1 and i == len(kinds) - 1 else 0
            args = (members, dtype, compute, self.mesh, self.shard_device, self.pin_memory)
            if ext:
                g: ShardGroup = ExtensionGroup(*args, tail, [t for _, t in pairs], self.mp_policy)
            else:
                g = ShardGroup(*args, tail, align=len(kinds) > 1)
            g.unit_name = self.comm.unit
            groups.append(g)
        return groups

    def _reduce_dtype(self) -> torch.dtype:
        """FSDP2's rule: ``reduce_dtype``, else the dtype gradients are computed in."""
        if self.mp_policy.reduce_dtype is not None:
            return self.mp_policy.reduce_dtype
        computed = {g.compute_dtype for g in self.groups if any(p.requires_grad for p in g.params)}
        if len(computed) > 1:
            raise FullshardError(
                f"unit '{self.name}' has trainable parameters computed in "
                f"{sorted(str(d) for d in computed)}; their gradients are reduced in one "
                "collective of one dtype. Pass MixedPrecisionPolicy(reduce_dtype=torch.float32) "
                "(or a param_dtype for the whole unit), or freeze the parameters of one dtype."
            )
        return computed.pop() if computed else self.groups[0].compute_dtype

    # -- the single-dtype view most callers want ------------------------------------------
    @property
    def layout(self) -> FlatLayout:
        """The first dtype group's layout (the unit's, unless it mixes dtypes)."""
        return self.groups[0].layout

    @property
    def shard_flat(self) -> torch.Tensor:
        return self.groups[0].flat

    @property
    def storage(self) -> GatheredStorage:
        return self.groups[0].storage

    @property
    def dtype(self) -> torch.dtype:
        return self.groups[0].dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.groups[0].compute_dtype

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

    def set_post_forward_group(self, size: int) -> None:
        """NOTE [Resharding to a smaller group] (``reshard_after_forward=size``)."""
        if any(g.extension for g in self.groups):
            raise FullshardError(
                f"unit '{self.name}' has parameters gathered through all-gather extension hooks "
                "(tensor subclasses, e.g. float8 weights); reshard_after_forward as an int is not "
                "supported for them (nor in torch FSDP2). Pass True or False."
            )
        if len(self.groups) > 1:
            raise FullshardError(
                f"unit '{self.name}' mixes dtypes; reshard_after_forward as an int is supported "
                "for units of one dtype. Pass True or False, or shard the parts separately."
            )
        group, rank = self.mesh.post_forward_group(size)
        comm = Comm(group, self.mesh.timeout, self.name, self.comm.stats)
        # the same shard dims: a Shard(k) size divisible by the group divides by ``size`` too
        dims = [p.dim for p in self.params]
        layout = FlatLayout([p.shape for p in self.params], size, tail=TAG_LEN, dims=dims)
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

    def _recast(self) -> None:
        if any(g.extension for g in self.groups):
            raise FullshardError(
                f"unit '{self.name}' has parameters gathered through all-gather extension hooks "
                "(tensor subclasses, e.g. float8 weights); casting it after fully_shard is not "
                "supported. Cast the model before calling fully_shard."
            )
        self.groups = self._make_groups(self.params, [p.local for p in self.params])
        for g in self.groups:
            g.reattach()  # copies each cast shard into the new group's flat buffer
            g.write_static_tag(self.index)
        self.reduce_dtype = self._reduce_dtype()
        world = self.mesh.world_size
        self.reduce_tags = world > 1 and tags_exact(self.reduce_dtype, world)

    # -- unshard / wait / reshard ---------------------------------------------------------
    def unshard(self, why: str = "gather") -> None:
        """Issue the unit's all-gather if it is not gathered or gathering already."""
        if self.state is not UnitState.SHARDED:
            return
        self.state = UnitState.GATHERING
        backward = gather_phase(why) == "backward gather"
        if self.post_forward_shard is not None and not backward:
            self.post_forward_shard = None  # backward did not come for it (another forward)
        if self.mesh.world_size == 1 or not self.params:
            # Nothing to move: the shards are whole parameters (an empty unit has nothing
            # either; every rank agrees, see NOTE [Same model on every rank]).
            self.gather_in_flight = GatherInFlight(None, None, None, None)
            return
        s = self.streams
        pf = self.post_forward if self.post_forward_shard is not None else None
        comm = pf.comm if pf is not None else self.comm
        pos = comm.position("all_gather", gather_phase(why), self.index)
        if pos.phase == "unshard()":
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
            emulation.name_tensor(out, lambda: f"all-gather output of unit '{self.name}'")
            pending = comm.all_gather(out, send, pos)  # type: ignore[arg-type]
        self.gather_in_flight = GatherInFlight(pending, out, send, pos, pf is not None)

    def _wire(self, pos: Position) -> torch.Tensor:
        """This rank's whole unit as one send buffer (NOTE [Mixed-dtype units]), its position
        tag at the end (NOTE [Collective positions]: written into what is sent, a copy when
        cast)."""
        parts = [t for g in self.groups for t in g.wire_parts()]
        write_dynamic_tag(parts[-1][-TAG_LEN:], pos)
        if len(parts) == 1:
            return parts[0]
        if len({t.dtype for t in parts}) == 1:
            return torch.cat(parts)
        return torch.cat([t.view(torch.uint8) for t in parts])

    def wait_for_unshard(self, why: str = "gather") -> None:
        """Make the unit GATHERED: issue the gather if needed, wait for it, copy out, expose."""
        if self.state is UnitState.GATHERED:
            return
        if self.state is UnitState.SHARDED:
            self.unshard(why)
        flight, self.gather_in_flight = self.gather_in_flight, None
        assert flight is not None
        if flight.pending is None:
            for g in self.groups:
                g.gather_locally()  # one rank: a cast or a host-to-device copy, or nothing
        else:
            assert flight.out is not None and flight.send is not None and flight.position
            s = self.streams
            with s.on(s.gather):
                flight.pending.wait()  # gloo: bounded host wait; NCCL: the gather stream waits
            s.compute_waits(s.record(s.gather))
            tails = self._copy_out(flight)
            # rule 2: the output (and a cast copy of the shard) may go once the copy-out has
            # read it; in forward one unit later, so the next all-gather need not wait for it
            s.gathered([flight.out, flight.send], defer=why.startswith("forward"))
            pf = self.post_forward if flight.post_forward else None
            me, group = (pf.rank, pf.comm.group) if pf else (self.mesh.rank, self.mesh.group)
            pos = flight.position
            del flight
            # raises before the modules see anything when the check is free (CPU)
            self.verdict.gather(tails, me, pos, group)
        for p in self.params:
            p.expose(unsharded=True)
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
            for p in self.params:
                p.expose(unsharded=False)
            for g in self.groups:
                g.free()
            self.state = UnitState.SHARDED

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
        self.post_forward_shard = emulation.name_tensor(
            shard, lambda: f"post-forward shard of '{self.name}'"
        )
        self.post_forward_event = self.streams.record_compute()

    @property
    def gathered(self) -> bool:
        """True while gathered memory is held (in flight or complete)."""
        return self.state is not UnitState.SHARDED

    def __repr__(self) -> str:
        return f"CommUnit({self.name!r}, params={len(self.params)}, state={self.state.value})"


__all__ = ["CommUnit", "GatherInFlight", "ReduceInFlight", "UnitState", "gather_phase"]
