"""Step scheduling (layer 7): what each unit does at each point of a step, which unit to gather
next and how many may be gathered at once, and the root's end-of-backward callback.

The hooks (layer 8) only detect *when* something happens (a unit's forward starts or ends, its
backward starts or ends) and call the matching method here. This file decides *what* happens:
gather and wait, prefetch, free, reduce-scatter, and at the end of backward, the clean-up that
makes every rank leave backward in the same state. Observers subscribe to the typed ``Point`` s.

NOTE [Prefetch order]
Forward runs units in *pre-forward* order (root first, then the blocks), and the next unit's
gather is issued as soon as the current one's has been waited on, so it overlaps with the
current unit's compute. Backward visits units in reverse *post-forward* order (the root finishes
its forward last, so it is first in backward); while unit i runs its backward, the gather of the
unit before it is in flight. Both orders are recorded during each forward and used by the next
step's forward (forward order) or by this step's backward (backward order), so the first
forward of a run has no forward prefetch: it cannot know the order yet. An explicit list set with
``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch`` (an
``ExplicitPrefetch`` of the unit objects) replaces the implicit choice for that unit.

NOTE [Gathered window]
At most ``max_gathered`` non-root units hold gathered storage because of *our* choices (the one
computing plus the prefetched one; default 2). Units that keep their parameters by request
(``reshard_after_forward=False``) do not count: the user asked for that memory. A prefetch that
would exceed the window is skipped, never queued, so the bound holds in every phase. An
explicit list (``set_modules_to_*_prefetch``) is gathered whole, as FSDP2 does: a list of two
or more asks for the memory of more units gathered at once.

NOTE [End of backward]
Autograd gives no per-unit "backward is over" signal that always fires: a unit whose outputs
did not reach the loss, or whose gradients were not asked for (``backward(inputs=...)``), never
completes its post-backward. The root therefore queues one callback per backward
(``Variable._execution_engine.queue_callback``) that runs after the engine has finished: it runs
post-backward for every unit whose backward started but did not finish, finishes every
reduce-scatter in flight (on a GPU: the compute stream waits for the reduce stream, so
``.grad`` is complete for anything queued after ``backward()`` returns), frees every gathered
unit that should be resharded, and closes the step's desync verdict (NOTE [Reading the
verdict]), which the next forward reads. ``set_is_last_backward(False)`` leaves the waits for
the reductions to the next backward or forward (CUDA; on the host path the host waits for each
anyway, so ``.grad`` is set after every backward, as in FSDP2). Under torch 2.15's
``set_manual_backward_finalization(True)`` a backward's end only ends that pass (units whose
backward did not finish are kept for later) and ``FSDPModule.finalize_backward`` does all of
the above once, after first reducing, with gradient sync on, the gradients backwards without
sync accumulated (``reduce_unsynced``): a pipeline stage's or an expert-overlap schedule's many
backward calls make one step.

NOTE [Optional units]
A unit declared optional (``FSDPModule.set_optional()``: an image encoder that runs only where
a batch holds an image) may be skipped by some ranks in a step. Its collectives therefore run at
points every rank reaches, whatever ran: its all-gather is issued right after the root's, at
the start of every forward; it stays gathered through backward (a rank that skipped it waits
for the gather at the root's post-forward); and it is reduce-scattered at the end of backward,
in registration order, where a rank that did not run it sends zeros (NOTE [Which gradients
exist]). It is never prefetched and takes no place in the recorded orders, so the ranks'
prefetches agree whether it ran or not. Its cost: its gathered parameters are held from the
start of forward to the end of backward (once, not per use), its gather competes with the
first block's, and its reduce-scatter, issued when backward has nothing left to overlap, is
exposed; a rank that skipped it still moves its bytes.

NOTE [Units every rank runs]
A unit that is not optional must run on every rank, or on none, in each forward: a rank that
skips it pairs its collectives with other ones (gloo aborts the process on a size mismatch,
NCCL hangs or mixes numbers). Two checks turn that into one ``DesyncError`` on every rank,
naming the unit, the ranks, and ``set_optional()``:

1. The root's first forward fingerprints each forward all-gather before it runs (debug mode's
   fingerprint, NOTE [Collective positions]), because no order is recorded yet to prefetch by
   and a skip mispairs the very next gather. Once per root.
2. At the root's post-forward, every rank publishes a bit per unit ("forwarded this step") and
   reads the others'; when they differ, every rank raises before any backward collective. From
   the second forward on, the forward's gathers follow the recorded order (NOTE [Prefetch
   order]), so a rank that skipped a unit still paired them; it is backward that would mispair.

On the host path (gloo on CPU) both exchange through the job's c10d store (``store_exchange``:
a set, a wait and a get per rank of the group), not a collective, so a step's collectives stay
exactly the model's (what ``tests/test_engine_comm.py`` counts), and check 2 runs every
forward. On the CUDA path they are small all-gathers whose reading synchronises the host, so
they run at a root's first forward (not under ``--elastic``, whose recovery rebuilds the root in
a quiet step) and under ``FULLSHARD_DEBUG_COLLECTIVES=1`` only; after that an
undeclared skip meets the payload tags and the bounded waits of NOTE [Collective positions].

3. A unit that ran on no rank is in no recorded order: if some ranks run it in the next
   forward, its gather is issued where the others issue their next one, and gloo aborts on
   the sizes before check 2 could run. So after a forward in which a non-optional unit ran on
   no rank (every rank sees the same bits, and all decide alike), the next forward's gathers
   are fingerprinted as the first forward's are. On the host path only; it costs nothing in
   the common case (every unit runs), and a model that often leaves a unit unrun on every
   rank should declare it optional. Each rank's check deletes its previous key, so the store
   keeps one per rank.

On the CUDA path, without debug mode, case 3 meets the payload tags and the bounded waits.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd import Variable

from fullshard.comm.collectives import CommStats
from fullshard.comm.control import all_gather_values
from fullshard.comm.desync import (
    DesyncError,
    Verdict,
    interrupt_for,
    moves_data,
    store_exchange,
    store_round,
)
from fullshard.comm.device import cuda_semantics
from fullshard.engine.unit import CommUnit, UnitState
from fullshard.policies import Phase

_SHARDED = UnitState.SHARDED  # a unit holding no gathered memory

DEFAULT_MAX_GATHERED = 2


@dataclass
class ExplicitPrefetch:
    """One unit's ``set_modules_to_{forward,backward}_prefetch`` lists (``None``: implicit)."""

    forward: list[CommUnit] | None = None
    backward: list[CommUnit] | None = None


class Prefetcher:
    """Records the unit order of each forward and issues gathers ahead of use."""

    def __init__(self, root: CommUnit, max_gathered: int = DEFAULT_MAX_GATHERED) -> None:
        self.root = root
        self.max_gathered = max_gathered
        self.units: list[CommUnit] = []
        self.pre_forward_order: list[CommUnit] = []
        self.post_forward_order: list[CommUnit] = []
        # the previous forward's pre-forward order, used to prefetch in this forward
        self.last_forward_order: list[CommUnit] = []
        # FSDPModule.set_modules_to_*_prefetch, by unit (the FSDPState's own object, so a list
        # set after the root's first forward applies at once)
        self.explicit: dict[CommUnit, ExplicitPrefetch] = {}
        # the units holding gathered memory, kept by the units themselves (``CommUnit.live``)
        self.live: set[CommUnit] = set()
        # unit -> the unit after it in backward (None: the last), made once per recorded order
        self._backward_next: dict[CommUnit, CommUnit | None] | None = None

    # -- recording ------------------------------------------------------------------------
    def begin_forward(self) -> None:
        if self.pre_forward_order:
            self.last_forward_order = self.pre_forward_order
        self.pre_forward_order = []
        self.post_forward_order = []
        self._backward_next = None

    def record_pre_forward(self, unit: CommUnit) -> None:
        if not unit.optional:  # NOTE [Optional units]: gathered at the root's pre-forward
            self.pre_forward_order.append(unit)

    def record_post_forward(self, unit: CommUnit) -> None:
        if not unit.optional:
            self.post_forward_order.append(unit)
            self._backward_next = None

    # -- choosing -------------------------------------------------------------------------
    def forward_targets(self, unit: CommUnit) -> tuple[list[CommUnit], bool]:
        """What to prefetch when ``unit`` starts its forward, and whether that is an explicit
        list (NOTE [Gathered window]: not bounded by it)."""
        explicit = self.explicit.get(unit)
        if explicit is not None and explicit.forward is not None:
            return explicit.forward, True
        # Position in this forward = how many times we've seen units so far.
        pos = len(self.pre_forward_order)
        order = self.last_forward_order
        if pos < len(order) and order[pos - 1] is unit:
            return [order[pos]], False
        return [], False

    def backward_targets(self, unit: CommUnit) -> tuple[list[CommUnit], bool]:
        """As ``forward_targets``, for ``unit``'s backward."""
        explicit = self.explicit.get(unit)
        if explicit is not None and explicit.backward is not None:
            return explicit.backward, True
        following = self._backward_next
        if following is None:
            # backward runs the post-forward order reversed; a unit may run more than once per
            # forward, and the most recent place is the one we are at (a later key wins)
            order = self.post_forward_order[::-1]
            n = len(order)
            following = {u: order[i + 1] if i + 1 < n else None for i, u in enumerate(order)}
            self._backward_next = following
        nxt = following.get(unit)
        return ([nxt] if nxt is not None else []), False

    # -- the window -----------------------------------------------------------------------
    def counts_in_window(self, unit: CommUnit) -> bool:
        return unit is not self.root and bool(unit.reshard_after_forward) and not unit.optional

    def window(self) -> int:
        """Non-root units gathered (or gathering) that count against NOTE [Gathered window]."""
        root = self.root  # ``counts_in_window`` of each, inline
        n = 0
        for u in self.live:
            if u is not root and u.reshard_after_forward and not u.optional:
                n += 1
        return n

    def prefetch(
        self, targets: Sequence[CommUnit], phase: Phase, explicit: bool = False
    ) -> list[CommUnit]:
        """Start the gathers of ``targets`` that fit the window (all of an ``explicit`` list);
        returns the ones started."""
        started = []
        for target in targets:
            if target.state is not _SHARDED:  # ``gathered``, inline (each prefetch)
                continue
            if phase is Phase.BACKWARD and not target.unshard_in_backward:
                continue  # FSDPModule.set_unshard_in_backward(False)
            bounded = not explicit and self.counts_in_window(target)
            if bounded and self.window() >= self.max_gathered:
                break
            target.unshard(phase)
            started.append(target)
        return started


# Reduce-scatters in flight at once, by default (FSDPModule.set_reduce_scatter_max_input_buffers
# raises a unit's): each holds a full copy of its unit's gradients.
MAX_REDUCES_IN_FLIGHT = 1


class Point(enum.Enum):
    """A moment of a step that observers (``fullshard.observe``) are told about."""

    # A unit's gathered parameters are ready and its forward computes.
    FORWARD_START = "forward_start"
    # A unit's forward returned.
    FORWARD_END = "forward_end"
    # A unit's gathered storage was freed.
    FREE = "free"
    # A unit's backward starts (its parameters are gathered again).
    BACKWARD_START = "backward_start"
    # A unit's backward is over (its gradients go to the reduce-scatter).
    BACKWARD_END = "backward_end"
    # The whole backward is over (reported for the root).
    BACKWARD_DONE = "backward_done"

    @property
    def phase(self) -> Phase:
        """Which pass the point belongs to: ``Phase.FORWARD`` (FREE included, wherever it
        happens) or ``Phase.BACKWARD``."""
        return Phase.BACKWARD if self in _BACKWARD_POINTS else Phase.FORWARD


_BACKWARD_POINTS = frozenset({Point.BACKWARD_START, Point.BACKWARD_END, Point.BACKWARD_DONE})


Listener = Callable[[Point, CommUnit], None]


class StepSchedule:
    """The root's view of all its units across one training step."""

    def __init__(self, root: CommUnit, units: list[CommUnit]) -> None:
        self.root = root
        self.units = units
        self.stats = CommStats()
        # NOTE [Units every rank runs]: the store keys of this root's checks on the host path,
        # and the first forward's fingerprints
        self.key = _check_key(root)
        self.forwards = 0
        # on the CUDA path the first forward's checks read on the host: not under live
        # recovery, which rebuilds the root in what is a quiet step of the run
        on_host = not cuda_semantics(root.mesh.device)
        self.host_path = on_host  # gloo on CPU: every collective is waited for on the host
        self.check_first = on_host or interrupt_for(root.mesh.group) is None
        self.stats.check_forward = f"{self.key}/first" if self.check_first else ""
        self.check_next = False  # a unit ran on no rank: fingerprint the next forward's gathers
        self.verdict = Verdict()
        self.verdict.names = self.stats.names
        for i, unit in enumerate(units):
            # one set of counters per root (split by unit name), one verdict, and the index
            # every rank shares (NOTE [Collective positions])
            unit.bind(self.stats, self.verdict, i)
            self.stats.names[i] = unit.name
        self.prefetcher = Prefetcher(root)
        self.prefetcher.units = units
        for unit in units:
            unit.share_live(self.prefetcher.live)
        self.step = 0
        self._callback_task: int | None = None
        self._reducing: list[CommUnit] = []
        # per-backward bookkeeping: units whose backward started / finished
        self.backward_started: set[CommUnit] = set()
        self.backward_done: set[CommUnit] = set()
        # NOTE [Backwards restricted to inputs]: units this backward gives no gradient here,
        # and (graph task, whether that pass is restricted), as the first unit asked found
        self.no_gradients: set[CommUnit] = set()
        self.restricted: tuple[int, bool] | None = None
        self.forwarded: set[CommUnit] = set()
        self.listeners: list[Listener] = []
        self.is_last_backward = True  # FSDPModule.set_is_last_backward
        # FSDPModule.set_manual_backward_finalization: finalize() waits for finalize_backward
        self.manual_finalization = False
        self.in_forward = False  # between the root's pre- and post-forward

    def _emit(self, point: Point, unit: CommUnit) -> None:
        for listener in self.listeners:
            listener(point, unit)

    # -- forward --------------------------------------------------------------------------
    def begin_forward(self, post_optim_event: torch.Event | None = None) -> None:
        """Root pre-forward: a new forward pass (and, when grad is on, a new step) starts.

        ``post_optim_event`` (``set_post_optim_event``): the gathers wait for it instead of for
        everything the compute stream has queued."""
        self._finish_all_reduces()
        self.verdict.poll()  # the last step's checks, read once their copy has landed
        streams = self.root.streams
        if post_optim_event is not None and streams.gather is not None:
            streams.gather.wait_event(post_optim_event)
        else:
            streams.gather_ready()  # NOTE [Streams and buffer lifetimes], rule 1
        self.prefetcher.begin_forward()
        self.forwarded.clear()
        self.in_forward = True
        if self.check_next:  # NOTE [Units every rank runs], check 3
            self.stats.check_forward = f"{self.key}/after{self.forwards}"
            self.check_next = False

    def pre_forward(self, unit: CommUnit) -> None:
        unit.sync_requires_grad()  # NOTE [Freezing after fully_shard]
        unit.wait_for_unshard(Phase.FORWARD)
        if unit is self.root and self.in_forward:
            for other in self.units:
                if other.optional:  # NOTE [Optional units]: every rank, right after the root
                    other.sync_requires_grad()
                    other.unshard(Phase.FORWARD)
        self.forwarded.add(unit)
        self.prefetcher.record_pre_forward(unit)
        if not unit.optional:
            targets, explicit = self.prefetcher.forward_targets(unit)
            self.prefetcher.prefetch(targets, Phase.FORWARD, explicit)
        if self.listeners:
            self._emit(Point.FORWARD_START, unit)

    def pre_recompute(self, unit: CommUnit) -> None:
        """A forward recomputed inside backward (activation checkpointing) needs the unit."""
        unit.wait_for_unshard(Phase.BACKWARD)

    def post_forward(self, unit: CommUnit, reshard: bool, grad_enabled: bool = True) -> None:
        if self.listeners:
            self._emit(Point.FORWARD_END, unit)
        self.prefetcher.record_post_forward(unit)
        if reshard and not (unit.optional and grad_enabled):  # NOTE [Optional units]
            # a backward will come: a unit with a post-forward group keeps its rows there
            unit.reshard(after_forward=grad_enabled)
            if self.listeners:
                self._emit(Point.FREE, unit)

    def end_forward(self, grad_enabled: bool) -> None:
        """Root post-forward: free what was prefetched but not used (a changed unit order)."""
        self.in_forward = False
        self.stats.check_forward = ""
        keep = grad_enabled
        for unit in self.units:
            if unit.optional and keep and unit.gathered:
                # NOTE [Optional units]: kept through backward, also where it did not run
                unit.wait_for_unshard(Phase.BACKWARD)
        self.root.streams.release_held()  # the last forward all-gather's buffers (rule 2)
        for unit in self.units:
            # ``gathered``, inline: a test of every unit each forward
            if (
                unit.state is not _SHARDED
                and unit not in self.forwarded
                and not (unit.optional and keep)
            ):
                unit.reshard()
        check_units_ran(self)  # NOTE [Units every rank runs]
        if not grad_enabled:
            # No backward will come to free the units kept for it (the root, SHARD_GRAD_OP),
            # nor to close this forward's checks.
            for unit in self.units:
                unit.reshard()
            self.verdict.close()

    # -- backward -------------------------------------------------------------------------
    def ensure_end_of_backward_callback(self) -> None:
        """Queue NOTE [End of backward] once per backward pass."""
        task = torch._C._current_graph_task_id()
        if self._callback_task == task:
            return
        self._callback_task = task
        Variable._execution_engine.queue_callback(self.end_backward)

    def pre_backward(self, unit: CommUnit, accumulates: bool = True) -> None:
        """The unit's backward starts; ``accumulates=False``: a backward restricted to inputs
        that gives its parameters no gradient on this rank, which it does not reduce (NOTE
        [Backwards restricted to inputs], hooks.py)."""
        self.ensure_end_of_backward_callback()
        self.backward_started.add(unit)
        self.backward_done.discard(unit)
        if accumulates:
            self.no_gradients.discard(unit)
        else:
            self.no_gradients.add(unit)
        if unit.unshard_in_backward:
            unit.wait_for_unshard(Phase.BACKWARD)
        targets, explicit = self.prefetcher.backward_targets(unit)
        self.prefetcher.prefetch(targets, Phase.BACKWARD, explicit)
        if self.listeners:
            self._emit(Point.BACKWARD_START, unit)

    def post_backward(self, unit: CommUnit) -> None:
        """The unit's backward is over: reduce-scatter its gradients and free it."""
        if unit in self.backward_done:
            return
        self.requested_post_backward(unit)

    def requested_post_backward(self, unit: CommUnit) -> None:
        """The unit's post-backward, also when asked for outside autograd (FSDP2's
        ``FSDPParamGroup.post_backward()``, which pipelining calls at REDUCE_GRAD once its
        microbatches accumulated without sync: NOTE [What pipelining reads from an FSDP2
        module]); the root's ``end_backward`` then lands the reductions."""
        self.backward_done.add(unit)
        if self.listeners:
            self._emit(Point.BACKWARD_END, unit)
        if unit.optional:
            return  # NOTE [Optional units]: reduced at the end of backward, on every rank
        if unit not in self.no_gradients:
            self._reduce(unit)
        if unit.reshard_after_backward:
            unit.reshard()
            if self.listeners:
                self._emit(Point.FREE, unit)

    def _reduce(self, unit: CommUnit) -> None:
        if unit.requires_grad_sync and unit.trainable:
            while len(self._reducing) >= unit.max_reduces_in_flight:
                self._reducing.pop(0).finish_reduce()
            unit.reduce_grads()
            self._reducing.append(unit)
        elif unit.trainable:
            unit.accumulate_unsynced()  # NOTE [Accumulating without sync]

    def end_backward(self) -> None:
        """The root's end-of-backward callback (NOTE [End of backward]); under manual
        finalization it only ends this backward pass (``finalize`` does the rest)."""
        if self.manual_finalization:
            # units whose backward did not finish stay for finalize(); the others may run
            # their backward again in the next pass
            self.backward_started -= self.backward_done
            self.backward_done.clear()
            if self.host_path:  # CUDA: reductions still on their streams hold checks to read
                self.verdict.close()
            self._callback_task = None
            return
        self.finalize()

    def reduce_unsynced(self) -> None:
        """``FSDPModule.finalize_backward``: with gradient sync on, reduce the gradients that
        backwards without sync left on the rank, also for units this backward did not reach
        (a pipeline stage's last micro-batch); the reductions stay in flight."""
        for unit in self.units:
            if unit in self.backward_started and unit not in self.backward_done:
                self.post_backward(unit)  # reduces, or keeps accumulating without sync
            elif unit.requires_grad_sync and not unit.optional and unit.has_unreduced_grads():
                self._reduce(unit)

    def finalize(self) -> None:
        """Finish backward (NOTE [End of backward]): at the end of every backward pass, or
        under manual finalization at ``finalize_backward``."""
        for unit in self.units:
            if unit in self.backward_started and unit not in self.backward_done:
                self.post_backward(unit)
        for unit in self.units:
            if unit.optional and unit.gathered:  # NOTE [Optional units]: every rank, in order
                self._reduce(unit)
                if unit.reshard_after_backward:
                    unit.reshard()
                    if self.listeners:
                        self._emit(Point.FREE, unit)
        # set_is_last_backward(False): on CUDA the reductions are queued whole already
        # (``.grad`` included), and their waits move to the next backward or forward; on the
        # host path the host waits for each anyway, so it does now: ``.grad`` is set after
        # every backward, as in FSDP2
        waited = self.is_last_backward or self.host_path
        if waited:
            self._finish_all_reduces()
            offloaded = False
            for unit in self.units:
                unit.end_reduces()  # CUDA: compute waits for the reductions queued on streams
                offloaded = unit.take_offload_event() or offloaded
            if offloaded:
                # The CPU optimizer reads the offloaded gradients: the host waits once per
                # backward for every copy (compute has waited for each reduction, so one event
                # covers all; FSDP2 synchronises one event per parameter here).
                event = self.root.streams.record_compute()
                assert event is not None
                event.synchronize()
        for unit in self.units:
            unit.post_forward_shard = None  # kept for a backward that has now passed
            if unit.reshard_after_backward and unit.state is not _SHARDED:  # ``gathered``
                unit.reshard()  # kept for a backward that never reached it
                if self.listeners:
                    self._emit(Point.FREE, unit)
        if waited:  # CUDA: the reductions' checks are read once compute has waited for them
            self.verdict.close()
        if self.listeners:
            self._emit(Point.BACKWARD_DONE, self.root)
        self.backward_started.clear()
        self.backward_done.clear()
        self.no_gradients.clear()
        self._callback_task = None
        self.step += 1
        self.stats.step = self.step

    def reset(self) -> None:
        """Forget an iteration an exception cut short (``FSDPModule.reset_iter_state``): land
        every collective in flight (each was issued on every rank, so waiting keeps them paired)
        and drop its result, drop gradients not yet reduced, and reshard every unit."""
        for unit in self.units:
            flight, unit.reduce_in_flight = unit.reduce_in_flight, None
            if flight is not None and flight.pending is not None:
                flight.pending.wait()
            for p in unit.trainable:
                p.pop_grad()
            unit.accumulated.clear()
            unit.partial_reduce = None
            unit.post_forward_shard = None
            unit.reshard()  # waits for a gather in flight first
        self._reducing.clear()
        self.backward_started.clear()
        self.backward_done.clear()
        self.no_gradients.clear()
        self.forwarded.clear()
        self._callback_task = None
        self.in_forward = False

    def _finish_all_reduces(self) -> None:
        while self._reducing:
            self._reducing.pop(0).finish_reduce()


def check_units_ran(schedule: StepSchedule) -> None:
    """NOTE [Units every rank runs]: at the root's post-forward, every rank learns which units
    each rank forwarded, and all raise when an undeclared one ran on some ranks only."""
    root = schedule.root
    mesh = root.mesh
    first = schedule.step == 0 and schedule.check_first
    if cuda_semantics(mesh.device) and not (first or schedule.stats.debug):
        return  # reading the bits would synchronise the host every step
    units = [u for u in schedule.units if not u.optional and u is not root]
    groups = [g for g in (mesh.group, mesh.replicate_group) if g is not None and moves_data(g)]
    groups = [g for g in groups if dist.get_world_size(g) > 1]
    if not units or not groups:
        return
    schedule.forwards += 1
    mine = [1 if u in schedule.forwarded else 0 for u in units]
    for group in groups:
        what = "fullshard's check of the units every rank ran"
        rows = _exchange(schedule, mine, group, what)
        bad = [j for j in range(len(units)) if len({r[j] for r in rows}) > 1]
        if not bad:
            # check 3: a unit that ran on no rank is in no recorded order; if some ranks run it
            # in the next forward, its gather meets another unit's there (every rank sees the
            # same rows, so all decide alike; on the host path only: the store is free there)
            nowhere = any(not any(r[j] for r in rows) for j in range(len(units)))
            schedule.check_next |= nowhere and not cuda_semantics(mesh.device)
            continue
        ranks = dist.get_process_group_ranks(group)
        lines = []
        for j in bad:
            ran = [r for r, row in zip(ranks, rows, strict=True) if row[j]]
            skipped = [r for r in ranks if r not in ran]
            lines.append(
                f"unit '{units[j].name}' ran on rank(s) {_ranks(ran)} and not on rank(s) "
                f"{_ranks(skipped)}"
            )
        raise DesyncError(
            f"rank {dist.get_rank()}: in the forward of step {schedule.step}, "
            + "; ".join(lines)
            + ". Every rank must run a unit's forward (its collectives pair across ranks), "
            "unless it is declared optional: call module.set_optional() on that unit on every "
            "rank before the forward (it is then gathered when the forward starts and "
            "reduce-scattered when backward ends, with zero gradients where it did not run), "
            "or run it on every rank. Nothing of this step was reduced."
        )


def _check_key(root: CommUnit) -> str:
    """This root's prefix of store keys (NOTE [Units every rank runs]): alike on every rank."""
    mesh = root.mesh
    if cuda_semantics(mesh.device) or mesh.world_size == 1 or not moves_data(mesh.group):
        return "fullshard/check/collectives"  # all-gathers there: no keys
    n = store_round("roots", mesh.group)
    return f"fullshard/check/{n}"


def _exchange(
    schedule: StepSchedule, mine: list[int], group: dist.ProcessGroup, what: str
) -> list[list[int]]:
    """Every rank's bits: through the store on the host path (no collective is added to a
    step), by an all-gather on the CUDA path (where this runs at the first forward only)."""
    mesh = schedule.root.mesh
    if not cuda_semantics(mesh.device):
        ranks = dist.get_process_group_ranks(group)
        key = f"{schedule.key}/units/{'-'.join(map(str, ranks))}"
        got = store_exchange(f"{key}/{schedule.forwards}", mine, group, mesh.timeout, what)
        if got is not None:
            if schedule.forwards > 2:  # every rank has read those: it passed the next check
                store = dist.distributed_c10d._get_default_store()
                store.delete_key(f"{key}/{schedule.forwards - 2}/{dist.get_rank()}")
            return got
    rows = all_gather_values([float(b) for b in mine], group, what=what, timeout=mesh.timeout)
    return [[int(v) for v in row] for row in rows.tolist()]


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))
