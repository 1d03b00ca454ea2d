"""One communication unit (layer 6): the parameters of one ``fully_shard`` call, and their whole
lifecycle in one object, as FSDP2's ``FSDPParamGroup``: unshard (issue the all-gather), wait
(copy out, show the gathered parameters), reshard (free), reduce gradients (reduce-scatter and
accumulate into ``.grad``). The collectives themselves are pure functions over tensors
(``fullshard.dist.collectives``), reached through the unit's bound ``Comm``; which stream runs
what is NOTE [Streams and buffer lifetimes].

NOTE [Unit states]
SHARDED --unshard--> GATHERING --wait_for_unshard--> GATHERED --reshard--> SHARDED.
While GATHERED the owning modules see the gathered parameters; otherwise they see the shards.
Only ``wait_for_unshard`` and ``reshard`` swap what the modules see, so a module never sees a
half-gathered unit.

NOTE [Which gradients exist]
Plain PyTorch leaves ``.grad`` None for a parameter no backward reached. A rank sets the sharded
``.grad`` exactly where its own backward produced a gradient (missing ones are sent as zeros, so
that every rank issues the same collective). That is exact when every rank's backward reaches
the same parameters, which FSDP2 requires too; fullshard also checks it: each rank's block of the
reduce-scatter carries one presence bit per parameter, and after the sum each must be 0 or the
group size (NOTE [Collective positions]). A disagreement raises on every rank, naming the
parameters, instead of leaving ranks whose shards silently diverge; deciding from the sums
instead would need the host to read them every unit, every step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import nn

from fullshard.dist.collectives import Comm, CommStats, Pending
from fullshard.dist.desync import (
    TAG_LEN,
    UNREGISTERED,
    Position,
    Verdict,
    reduce_tag_row,
    tags_exact,
    write_dynamic_tag,
    write_static_tag,
)
from fullshard.dist.mesh import MeshInfo
from fullshard.engine.param import GatheredStorage, ShardedParam
from fullshard.engine.streams import Event, Streams, streams_for
from fullshard.policies import (
    CPUOffloadPolicy,
    FullshardError,
    MixedPrecisionPolicy,
    OffloadPolicy,
)
from fullshard.shard.layout import FlatLayout


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
    send: torch.Tensor | None  # the (cast) shard the collective reads
    position: Position | None


@dataclass
class ReduceInFlight:
    """A reduce-scatter between ``reduce_grads`` and ``finish_reduce``."""

    pending: Pending | None
    out: torch.Tensor  # this rank's summed block (its shard, then the extra columns)
    full: torch.Tensor  # the packed input, held until compute has waited for the collective
    present: list[bool]
    position: Position | None


class CommUnit:
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
        self.name = name
        self.index = UNREGISTERED  # set by the root (NOTE [Collective positions])
        self.verdict = Verdict()  # replaced by the root's
        self.streams: Streams = streams_for(mesh.device)
        self.state = UnitState.SHARDED
        self.reshard_after_forward = True
        self.reshard_after_backward = True
        self.requires_grad_sync = True
        self.gather_in_flight: GatherInFlight | None = None
        self.reduce_in_flight: ReduceInFlight | None = None
        self._offload_event: Event | None = None

        dtypes = {t.dtype for t in originals}
        if len(dtypes) > 1:
            raise FullshardError(
                f"unit '{name}' mixes parameter dtypes {sorted(str(d) for d in dtypes)}; one "
                "unit gathers in one dtype. Cast the module (module.to(dtype)) or call "
                "fully_shard separately on the submodule whose parameters differ."
            )
        self.dtype = originals[0].dtype if originals else torch.float32
        self.compute_dtype = mp_policy.param_dtype or self.dtype
        self.reduce_dtype = mp_policy.reduce_dtype or self.dtype
        # CPUOffloadPolicy: shards, gradients and the optimizer step live on the CPU
        self.offload = isinstance(offload, CPUOffloadPolicy)
        self.shard_device = torch.device("cpu") if self.offload else mesh.device
        self.pin_memory = (
            isinstance(offload, CPUOffloadPolicy)
            and offload.pin_memory
            and mesh.device.type == "cuda"
        )
        world = mesh.world_size
        # the tail carries the all-gather's position tags (NOTE [Collective positions])
        self.layout = FlatLayout([p.shape for p in params], world, tail=TAG_LEN if world > 1 else 0)
        self.trainable = [p for p in params if p.requires_grad]
        self.grad_layout = FlatLayout([p.shape for p in self.trainable], world)
        # reduce-scatter tags are exact in the reduce dtype up to a group size (desync.py)
        self.reduce_tags = world > 1 and tags_exact(self.reduce_dtype, world)
        self.shard_flat = torch.zeros(0)
        self.load_shards(originals)

    @property
    def name(self) -> str:
        return self.comm.unit

    @name.setter
    def name(self, value: str) -> None:
        self.comm.unit = value

    @property
    def stats(self) -> CommStats:
        """The counters this unit's collectives report to (its root's, once it has one)."""
        return self.comm.stats

    @property
    def aliased(self) -> bool:
        """One-rank shard group, same dtype, same device: gathered params view the shards."""
        return (
            self.mesh.world_size == 1
            and self.compute_dtype == self.dtype
            and self.shard_device == self.mesh.device
        )

    def register(self, index: int) -> None:
        """The root gives the unit its index in the registration order every rank shares."""
        self.index = index
        self._write_static_tag()

    def _write_static_tag(self) -> None:
        if self.layout.tail and not self.shard_flat.is_meta:
            write_static_tag(self.shard_flat[-self.layout.tail :], self.index)

    # -- shards ---------------------------------------------------------------------------
    def _build_storage(self) -> None:
        # (meta shards: real storage for now; refresh_shards rebuilds it once they are real)
        alias = self.shard_flat if self.aliased and not self.shard_flat.is_meta else None
        self.storage = GatheredStorage(
            self.layout.total_numel, self.compute_dtype, self.mesh.device, alias=alias
        )
        self.storage.alloc()
        for i, p in enumerate(self.params):
            p.make_unsharded(self.layout.gathered_view(self.storage.flat, i))
        self.storage.free()
        self._write_static_tag()

    def load_shards(self, fulls: list[torch.Tensor]) -> None:
        """(Re)build the flat shard buffer from full tensors and point the shards into it.

        The sharded ``nn.Parameter`` objects are kept (only their ``.data`` changes), so an
        optimizer built earlier still holds the right objects.
        """
        device = fulls[0].device if fulls and fulls[0].is_meta else self.shard_device
        flat = self._new_flat(device)
        with torch.no_grad():
            if not flat.is_meta:
                self.layout.pack_shard([t.detach().to(device) for t in fulls], self.mesh.rank, flat)
            for i, p in enumerate(self.params):
                p.set_sharded_data(self.layout.shard_view(flat, i, self.mesh.rank))
        self.shard_flat = flat
        self._build_storage()

    def _new_flat(self, device: torch.device) -> torch.Tensor:
        flat = torch.zeros(self.layout.shard_numel, dtype=self.dtype, device=device)
        return flat.pin_memory() if self.pin_memory and not flat.is_meta else flat

    def refresh_shards(self) -> None:
        """Re-adopt shards that ``_apply`` (``to_empty``, ``.to()``) replaced or moved, and copy
        them back into a flat buffer, so one collective can send the unit again."""
        if self._shards_detached():
            self.reattach_shards()

    def _shards_detached(self) -> bool:
        adopted = [p.adopt_module_param() for p in self.params]
        for p in self.params:
            p.sharded._fullshard_unit = self  # type: ignore[attr-defined]
            if p.sharded.dtype != self.dtype:
                raise FullshardError(
                    f"sharded parameter '{p.fqn}' of unit '{self.name}' changed dtype from "
                    f"{self.dtype} to {p.sharded.dtype} after fully_shard; cast the model "
                    "(model.to(dtype)) before calling fully_shard."
                )
        if any(p.sharded.is_meta for p in self.params):
            return False  # nothing to copy yet; the meta check at first forward explains
        if any(adopted):
            return True
        start = self.shard_flat.data_ptr() if not self.shard_flat.is_meta else -1
        for i, p in enumerate(self.params):
            t = p.local
            if t.is_meta != self.shard_flat.is_meta or t.device != self.shard_flat.device:
                return True
            if t.is_meta or t.numel() == 0:
                continue
            if t.data_ptr() != start + self.layout.slots[i].offset * t.element_size():
                return True
        return False

    def reattach_shards(self) -> None:
        """Copy shards that were replaced (``to_empty``, ``.to()``) back into a flat buffer."""
        world, rank = self.mesh.world_size, self.mesh.rank
        flat = self._new_flat(self.shard_device)
        with torch.no_grad():
            for i, p in enumerate(self.params):
                view = self.layout.shard_view(flat, i, rank)
                if p.local.shape != view.shape:
                    raise FullshardError(
                        f"rank {rank}: sharded parameter '{p.fqn}' of unit '{self.name}' has shape "
                        f"{tuple(p.local.shape)}, expected {tuple(view.shape)} ({world} ranks). "
                        "Do not replace sharded parameters with tensors of another shape."
                    )
                view.copy_(p.local.detach())
                p.set_sharded_data(view)
        self.shard_flat = flat
        self._build_storage()

    # -- unshard / wait / reshard ---------------------------------------------------------
    def unshard(self, why: str = "gather") -> None:
        """Issue the unit's all-gather if it is not gathered or gathering already."""
        if self.state is not UnitState.SHARDED:
            return
        self.state = UnitState.GATHERING
        if self.mesh.world_size == 1 or not self.params:
            # Nothing to move: the shards are whole parameters (an empty unit has nothing
            # either; every rank agrees, see NOTE [Same model on every rank]).
            self.gather_in_flight = GatherInFlight(None, None, None, None)
            return
        s = self.streams
        pos = self.comm.position("all_gather", gather_phase(why), self.index)
        if pos.phase == "unshard()":
            s.gather_ready()  # outside a step's forward/backward: the optimizer may have run
        with s.on(s.gather):
            # Offload: shards travel from (pinned) host memory. Mixed precision: the gather
            # moves param_dtype bytes; the shards stay in full precision.
            send = self.shard_flat.to(self.mesh.device, self.compute_dtype, non_blocking=True)
            # NOTE [Collective positions]: the tag goes into what is sent (a copy when cast)
            write_dynamic_tag(send[-self.layout.tail :], pos)
            out = torch.empty(self.layout.total_numel, dtype=self.compute_dtype, device=send.device)
            pending = self.comm.all_gather(out, send, pos)
        self.gather_in_flight = GatherInFlight(pending, out, send, pos)

    def wait_for_unshard(self, why: str = "gather") -> None:
        """Make the unit GATHERED: issue the gather if needed, wait for it, copy out, expose."""
        if self.state is UnitState.GATHERED:
            return
        if self.state is UnitState.SHARDED:
            self.unshard(why)
        flight, self.gather_in_flight = self.gather_in_flight, None
        assert flight is not None
        if flight.pending is None:
            if not self.aliased and self.params:
                self.storage.alloc()  # one rank: the gather is a cast (or a host-to-device copy)
                with torch.no_grad():
                    self.storage.flat.copy_(self.shard_flat, non_blocking=True)
        else:
            assert (
                flight.out is not None and flight.send is not None and flight.position is not None
            )
            s = self.streams
            with s.on(s.gather):
                flight.pending.wait()  # gloo: bounded host wait; NCCL: the gather stream waits
            s.compute_waits(s.record(s.gather))
            self.storage.alloc()
            world, tail = self.mesh.world_size, self.layout.tail
            tails = torch.empty(world, tail, dtype=flight.out.dtype, device=flight.out.device)
            with torch.no_grad():
                self.layout.copy_out(flight.out, self.storage.flat, tails)
            # rule 2: the output (and a cast copy of the shard) may go once the copy-out has
            # read it; in forward one unit later, so the next all-gather need not wait for it
            s.gathered([flight.out, flight.send], defer=why.startswith("forward"))
            pos = flight.position
            del flight
            # raises before the modules see anything when the check is free (CPU)
            self.verdict.gather(tails, self.mesh.rank, pos, self.mesh.group)
        for p in self.params:
            p.expose(unsharded=True)
        self.state = UnitState.GATHERED

    def reshard(self) -> None:
        """Free the gathered storage and show the shards to the modules again."""
        if self.state is UnitState.GATHERING:
            self.wait_for_unshard()  # the gather must land first; collectives stay paired
        if self.state is UnitState.GATHERED:
            for p in self.params:
                p.expose(unsharded=False)
            self.storage.free()
            self.state = UnitState.SHARDED

    @property
    def gathered(self) -> bool:
        """True while gathered memory is held (in flight or complete)."""
        return self.state is not UnitState.SHARDED

    # -- reduce gradients -----------------------------------------------------------------
    def reduce_grads(self) -> None:
        """Reduce-scatter the unit's unsharded gradients (asynchronously) and drop them."""
        if not self.trainable:
            return
        self.finish_reduce()  # at most one reduce-scatter of a unit in flight
        world, dtype, device = self.mesh.world_size, self.reduce_dtype, self.mesh.device
        grads = [p.unsharded.grad if p.unsharded is not None else None for p in self.trainable]
        present = [g is not None for g in grads]
        pos, extra = None, None
        if self.reduce_tags:
            # NOTE [Which gradients exist] and [Collective positions]: every rank's block ends
            # in this rank's presence bits and tag, so the sum says whether the ranks agreed
            pos = self.comm.position("reduce_scatter", "reduce-scatter", self.index)
            # in the gradients' dtype (0 and 1 are exact in any), so the pack needs no cast
            bits = next((g.dtype for g in grads if g is not None), dtype)
            extra = reduce_tag_row(pos, present, bits, device).expand(world, -1)
        # packed on the compute stream, where autograd made the gradients (rule 3)
        full = self.grad_layout.pack_for_reduce(grads, dtype=dtype, device=device, extra=extra)
        for p in self.trainable:
            assert p.unsharded is not None
            p.unsharded.grad = None  # the packed copy is all we need: free the full gradients
        if world == 1 and self.comm.replicate_group is None:
            # nothing to communicate: the full gradient is the shard, made on compute, and
            # finishing it on compute costs no stream hand-over
            self.reduce_in_flight = ReduceInFlight(None, full.view(-1), full, present, pos)
            return
        pending = None
        with self.streams.begin_reduce():
            if world == 1:
                out = full.view(-1)  # HSDP with a one-rank shard group: only the all-reduce
            else:
                out = torch.empty(full.shape[1], dtype=dtype, device=device)
                pending = self.comm.reduce_scatter(out, full, pos)  # type: ignore[arg-type]
        self.reduce_in_flight = ReduceInFlight(pending, out, full, present, pos)

    def finish_reduce(self) -> None:
        """Wait for the unit's reduce-scatter (and HSDP all-reduce) and accumulate the averaged
        shard into ``.grad``; on the reduce stream when there was a collective."""
        flight, self.reduce_in_flight = self.reduce_in_flight, None
        if flight is None:
            return
        s, layout, rank = self.streams, self.grad_layout, self.mesh.rank
        shard = flight.out[: layout.shard_numel]
        side = self.mesh.world_size > 1 or self.comm.replicate_group is not None
        with s.on(s.reduce if side else None):
            if flight.pending is not None:
                flight.pending.wait()  # gloo: host wait and the local sum; NCCL: stream wait
                self._check_reduce(flight)
            if self.comm.replicate_group is not None:
                # HYBRID / NO_SHARD: the shard's sum over the replicas, ordered after the
                # reduce-scatter by the reduce stream (gloo: by the host wait above)
                self.comm.all_reduce_replicas(shard).wait()
            if self.mesh.data_parallel_size > 1:
                shard.div_(self.mesh.data_parallel_size)
            if self.offload:
                shard = self._to_host(shard)
            for j, p in enumerate(self.trainable):
                if not flight.present[j]:
                    continue  # NOTE [Which gradients exist]
                g = layout.shard_view(shard, j, rank)
                if g.dtype != p.sharded.dtype:
                    g = g.to(p.sharded.dtype)
                p.add_grad(g)  # a DTensor gradient over these rows
        if side:
            # rule 3: compute waits before the packed input (and the gradients) may be reused
            s.compute_waits(s.record(s.reduce))
        del flight

    def _check_reduce(self, flight: ReduceInFlight) -> None:
        if flight.position is None:
            return
        names = [p.fqn for p in self.trainable]
        k = len(names) + 8 * TAG_LEN  # presence bits, then tag bits
        rows = flight.pending.rows if flight.pending is not None else None
        if rows is not None:  # gloo: every rank's block, before the sum
            me = self.mesh.rank
            self.verdict.reduce_rows(rows[:, -k:], me, flight.position, self.mesh.group, names)
        else:
            world = self.mesh.world_size
            self.verdict.reduce_sums(
                flight.out[-k:], world, flight.position, self.mesh.group, names
            )

    def _to_host(self, shard: torch.Tensor) -> torch.Tensor:
        """Offload: the gradient shard goes to host memory; with pinned memory the copy is
        asynchronous and ``sync_offloaded_grads`` (end of backward) waits for it."""
        if not self.pin_memory or any(p.sharded.grad is not None for p in self.trainable):
            return shard.to("cpu")  # accumulating on the host needs the values now
        host = torch.empty(shard.shape, dtype=shard.dtype, pin_memory=True)
        host.copy_(shard, non_blocking=True)
        # recorded on the stream doing the copy (the reduce stream, or compute)
        self._offload_event = torch.cuda.current_stream(shard.device).record_event()
        return host

    def sync_offloaded_grads(self) -> None:
        """Block the host until offloaded gradients have landed (the CPU optimizer reads them)."""
        if self._offload_event is not None:
            self._offload_event.synchronize()
            self._offload_event = None

    def __repr__(self) -> str:
        return f"CommUnit({self.name!r}, params={len(self.params)}, state={self.state.value})"
