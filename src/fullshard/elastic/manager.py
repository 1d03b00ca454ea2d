"""One rank's side of live recovery (layer 9): :class:`Manager` joins generations (NOTE
[Generations]), keeps and exchanges a step boundary's copies (NOTE [Ring copies]), and after a
failure or a regroup restores the newest boundary the participants hold, at the new world size.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fullshard.comm.desync import Interrupted
from fullshard.elastic.membership import (
    JOIN_ENV,
    MEMBER_ENV,
    REPLACES_ENV,
    JobFinished,
    JobStore,
    Lost,
    Membership,
    admission,
)
from fullshard.elastic.pieces import (
    REPLICATED,
    Copies,
    HostCopy,
    pieces_of,
    update_after_copies,
)
from fullshard.elastic.restore import restore_boundary
from fullshard.elastic.settle import Settle
from fullshard.elastic.watcher import Watcher, quiet_cpp_warnings

__all__ = ["Aborted", "Layout", "Manager", "Regroup", "abort_groups"]

MEMBERSHIP = "_fullshard_membership"  # the loop state's key for the history of changes
ENTRY_ATTEMPTS = 4  # generations in a row that may lose a member before they form
ADMISSION_LOOK_S = 0.1  # how often a process waiting to join looks for its admission


class Aborted(Lost):
    """The job was ended by the launcher or another rank (the message is theirs, said once)."""


class Regroup(Exception):  # noqa: N818 (not an error: the leader admits new ranks)
    """Raised on rank 0 at a step boundary after it wrote a generation that admits joiners:
    every rank then goes through :meth:`Manager.recover`, which joins it."""


@dataclass(frozen=True)
class Layout:
    """Where a world's copies live (NOTE [Ring copies]): ``keys`` distinct shard keys (the
    world; under HSDP the shard group, the replicas holding each other's shards), and the
    distance to the rank that keeps this rank's copy."""

    keys: int
    ring_step: int = 1

    def key(self, rank: int) -> int:
        return rank % self.keys


# Process groups given up by abort_groups: kept referenced, never shut down (see there).
_ABANDONED: list[Any] = []


# one abort at a time: the watcher thread's (NCCL) and the main thread's (recovery) may meet
_ABORTING = threading.RLock()


def _abort_all(groups: list[Any]) -> None:
    """``abort()`` every group of ``groups``, the newest first; NCCL communicators within one
    NCCL group call, as torch's ``_abort_process_group`` does, so that their aborts cannot
    deadlock each other (pytorch/pytorch#119797)."""
    nccl = None
    for pg in groups:
        with contextlib.suppress(Exception):  # a group without a CUDA backend, or torn down
            backend = pg._get_backend(torch.device("cuda"))
            if type(backend).__name__ == "ProcessGroupNCCL":
                nccl = backend
                break
    if nccl is not None:
        with contextlib.suppress(Exception):
            nccl._group_start()
    try:
        for pg in reversed(groups):
            abort = getattr(pg, "abort", None)
            if abort is not None:
                with contextlib.suppress(Exception):  # already failed or torn down
                    abort()
    finally:
        if nccl is not None:
            with contextlib.suppress(Exception):
                nccl._group_end()


def abort_groups() -> None:
    """Abort every process group of this rank (a peer blocked in a synchronous gloo collective
    with it fails at once), and forget them, so that a new default group can be made.

    Not ``destroy_process_group``: its ``shutdown`` joins gloo's worker threads, one of which
    may sit in a collective with the dead rank until the timeout (measured: 29 s of a 30 s
    timeout). The groups are kept referenced instead, so that their destructors never wait
    either; a lost generation costs its groups' memory. Safe to call when none is initialised.
    """
    with _ABORTING:
        if not dist.is_initialized():
            return
        c10d = dist.distributed_c10d
        groups = list(c10d._world.pg_map.keys())
        _abort_all(groups)
        forget = (
            getattr(c10d, "_update_default_pg", None),
            getattr(c10d, "_unregister_all_process_groups", None),
        )
        if None in forget:  # an older torch: the slow way, bounded by the timeout
            dist.destroy_process_group()
            return
        _ABANDONED.extend(groups)
        c10d._update_default_pg(None)
        for name in (
            "pg_map",
            "pg_names",
            "pg_group_ranks",
            "pg_backend_config",
            "pg_to_tag",
            "tags_to_pg",
            "pg_coalesce_state",
        ):
            table = getattr(c10d._world, name, None)
            if table is not None:
                table.clear()
        c10d._unregister_all_process_groups()
        c10d._world.group_count = 0


@contextlib.contextmanager
def _store_alive(address: tuple[str, int] | None) -> Iterator[None]:
    """A store that cannot be reached ends recovery: its host is what was lost."""
    try:
        yield
    except dist.DistNetworkError as exc:
        where = "" if address is None else f" at {address[0]}:{address[1]}"
        raise Lost(
            f"the job's store{where} is unreachable ({_why(exc)}): its host (fullshard's "
            "launcher, or the first node's torchrun agent) was lost"
        ) from None


def _why(error: BaseException) -> str:
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"


class Manager:
    """One rank's side of live recovery (see ``fullshard.elastic``).

    ``store``: the job's store (hosted by a launcher, not by a rank); ``member``: this process's
    member id; ``world``: the ranks of generation 0; ``joining``: this process joins a running
    job (``replaces``: the member it stands in for); ``backend``: the process groups'
    backend (the copies always travel over gloo, on the host); ``timeout_s``: how long to wait
    for a collective and for a membership; ``every``: copy at every ``every``-th boundary;
    ``accepts(world)``: the world sizes the job can run at; ``layout(world)``: where copies live
    (:class:`Layout`; default every rank its own key, ring neighbours); ``device``: the model's
    device (CUDA: copies on a side stream, NOTE [Ring copies]); ``address``: the store's
    ``(host, port)`` for the watcher thread (default ``MASTER_ADDR``/``MASTER_PORT``);
    ``hook(point, generation)``, for fault drills: called with ``"settled"`` once the record of a
    generation this member enters is in hand, before it forms.
    """

    def __init__(
        self,
        store: dist.Store,
        member: int,
        *,
        world: int = 1,
        joining: bool = False,
        replaces: int | None = None,
        backend: str = "gloo",
        timeout_s: float = 300.0,
        every: int = 1,
        accepts: Callable[[int], bool] | None = None,
        layout: Callable[[int], Layout] | None = None,
        device: torch.device | None = None,
        address: tuple[str, int] | None = None,
        hook: Callable[[str, int], None] | None = None,
    ) -> None:
        self.jobs = JobStore(store)
        self.hook = hook
        self.store, self.member, self.world0 = store, member, world
        self.joining, self.replaces = joining, replaces
        self.backend, self.timeout_s, self.every = backend, timeout_s, max(1, every)
        self.accepts = accepts or (lambda w: w >= 1)
        self.layout = layout or (lambda w: Layout(w))
        self.device = device or torch.device("cpu")
        if address is None and "MASTER_ADDR" in os.environ:
            address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        self.address = address
        self.generation = -1
        self.membership: Membership | None = None
        self.host_group: Any = None  # gloo: the copies' and restore's group
        self.copies = Copies()  # the boundaries this rank holds (NOTE [Ring copies])
        self.changes: list[dict[str, Any]] = []  # one entry per membership change
        self.snapshot_s = 0.0  # time spent copying and exchanging, all boundaries together
        self.copy_bytes = 0  # host bytes of one boundary: this rank's copy and the one it keeps
        self._failed_at: float | None = None
        self.progress = -1  # the training loop's newest step boundary
        self.restored_bytes = 0  # bytes this rank received in its last restore
        self.restored = False  # whether this process restored a boundary (it holds state)
        self._formed = -1  # the newest generation whose process group this member formed
        self._joins_seen = 0
        self._watcher: Watcher | None = None
        self._stream: Any = None
        self._hooked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()

    @classmethod
    def from_env(cls, **kwargs: Any) -> Manager:
        """The manager of a rank started by an elastic launcher: the store at ``MASTER_ADDR``:
        ``MASTER_PORT``; the member id ``FULLSHARD_ELASTIC_MEMBER`` (default ``RANK``, or a
        fresh one for a process that joins a running job, ``FULLSHARD_ELASTIC_JOIN``)."""
        timeout = timedelta(seconds=kwargs.get("timeout_s", 300.0))
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timeout,
            wait_for_workers=False,
        )
        quiet_cpp_warnings()  # NOTE [Losing the store]: fullshard reports the store's failures
        joining = bool(os.environ.get(JOIN_ENV))
        member = os.environ.get(MEMBER_ENV)
        if member is None:
            member = str(JobStore(store).new_member_ids(1) if joining else os.environ["RANK"])
        replaces = os.environ.get(REPLACES_ENV)
        kwargs.setdefault("world", int(os.environ.get("WORLD_SIZE", "1")))
        return cls(
            store,
            int(member),
            joining=joining,
            replaces=None if not replaces else int(replaces),
            **kwargs,
        )

    # -- membership ---------------------------------------------------------------------------

    def join(self) -> Membership:
        """Join generation 0 (written by rank 0), or, for a process joining a running job,
        the generation that admits it."""
        with _store_alive(self.address):
            self.jobs.beat(self.member)
            if self.joining:
                newest = self.jobs.latest()  # before asking: the admission may come at once
                self.jobs.ask_join(self.member, self.replaces)
                return self._join_settled(*self._admission(newest, "asked to join"))
            if self.member == 0 and not self.jobs.has_generation(0):
                self.jobs.reserve_ids(self.world0)
                self.jobs.write_generation(0, {"members": list(range(self.world0))})
            try:
                return self._enter(0, self._wait_for(0, "joining"))
            except Interrupted:
                raise Lost("a rank was lost before the job's first step") from None

    def _wait_for(self, g: int, why: str) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout_s
        while (record := self.jobs.generation(g)) is None:
            self._check_abort()
            if time.monotonic() > deadline:
                raise Lost(f"{why}, and generation {g} was not written within {self._t()}")
            time.sleep(0.02)
        return record

    def _admission(self, newest: int, why: str) -> tuple[int, dict[str, Any]]:
        """The first generation after ``newest`` that has this member, and its record. A process
        waiting to join waits as long as the job runs: it ends when the job ends
        (:class:`JobFinished`, :class:`Aborted`), never on a timeout of its own, so that it
        cannot end a job that goes on without it."""
        g = newest + 1
        while True:
            record = self.jobs.generation(g)
            if record is not None and self.member in record["members"]:
                return g, record
            if record is not None:
                g += 1
                continue
            self._check_abort()
            if self.jobs.note("finished"):
                raise JobFinished(
                    f"{why}; the job finished before member {self.member} was admitted"
                )
            time.sleep(ADMISSION_LOOK_S)

    def _join_settled(self, g: int, record: dict[str, Any]) -> Membership:
        """Enter generation ``g`` (settled: its record is written). A member of it lost before
        it formed makes the others settle the next generation, this member among them (it may
        be left out: it then waits to join again), and so on, at most ENTRY_ATTEMPTS times."""
        for _ in range(ENTRY_ATTEMPTS):
            if self.member not in record["members"]:
                self.copies.clear()  # left out: its state is no one's now; back as a joiner
                self.jobs.ask_join(self.member, None)
                g, record = self._admission(g, "left out of the smaller world")
                continue
            self._at("settled", g)
            try:
                return self._enter(g, record)
            except Interrupted as exc:  # a member of g was lost before g formed
                g += 1
                record = self.jobs.generation(g) or self._settle(g, exc)
                if record.get("unchanged"):
                    raise Lost(f"generation {g - 1} did not form, and no rank was lost") from None
        raise Lost(f"{ENTRY_ATTEMPTS} generations in a row lost a member before they formed")

    def _t(self) -> str:
        return f"{self.timeout_s:.0f} s"

    def _check_abort(self) -> None:
        message = self.jobs.aborted()
        if message is not None:
            raise Aborted(message)

    def _at(self, point: str, generation: int) -> None:
        if self.hook is not None:
            self.hook(point, generation)

    def _enter(self, g: int, record: dict[str, Any]) -> Membership:
        """Join generation ``g``'s process group (a key prefix of its own), once every member
        has arrived (:meth:`_arrive`)."""
        m = Membership.of(g, record, self.member)
        with _ABORTING:  # a watcher's abort of the last generation's groups is over, or moot
            self.generation = g
        self.membership = m
        self._start_watcher()
        self._arrive(m)
        if self.backend == "nccl":  # the watchdog aborts a failed communicator, but leaves
            # the process alive to recover (torch's default tears it down)
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        dist.init_process_group(
            backend=self.backend,
            store=dist.PrefixStore(f"fullshard/elastic_{g}", self.store),
            rank=m.rank,
            world_size=m.world,
            timeout=timedelta(seconds=self.timeout_s),
        )
        gloo = self.backend == "gloo"
        self.host_group = None if gloo else dist.new_group(backend="gloo")
        self._formed = g
        self._watch()
        return m

    def _arrive(self, m: Membership) -> None:
        """Wait until every member of ``m``'s generation has arrived to form its process group.
        The group's own rendezvous (gloo's, NCCL's) waits for every member in C++, where only
        its timeout ends the wait: a member lost between the generation's decision and its
        rendezvous (the decider itself, the instant it wrote it) left the others there for the
        whole timeout. This wait looks at the store and gives up when the membership moves on
        (:class:`Interrupted`: the others settle the next generation)."""
        g = m.generation
        self.jobs.arrive(g, self.member)
        deadline = time.monotonic() + self.timeout_s
        watcher = self._watcher
        while not self.jobs.all_arrived(g, m.members):
            self._check_abort()
            if watcher is not None and watcher.changed(g):
                raise Interrupted(f"the job's membership changed while generation {g} formed")
            if time.monotonic() > deadline:
                missing = self.jobs.not_arrived(g, m.members)
                raise Lost(f"member(s) {missing} did not arrive for generation {g} in {self._t()}")
            time.sleep(0.02)

    def _start_watcher(self) -> None:
        """Start the watcher thread (once): heartbeat, progress, the news (NOTE
        [Generations])."""
        if self._watcher is None and self.address is not None:
            host, port = self.address
            on_change = self._abort_device_groups if self.backend == "nccl" else None
            self._watcher = Watcher(
                host,
                port,
                self.member,
                lambda: self.generation,
                on_change,
                progress=lambda: self.progress,
                neighbour=self._neighbour,
                members=self._members,
            )

    def _watch(self) -> None:
        """Give this generation's groups a way out of their waits that fires once the watcher
        sees the membership move past it (NOTE [Interrupts]: their units' and the control
        plane's waits poll it)."""
        from fullshard.comm.desync import Interrupt, set_interrupt

        watcher = self._watcher
        if watcher is not None:
            g = self.generation
            set_interrupt(Interrupt(lambda: watcher.changed(g), "the job's membership changed"))

    @property
    def store_lost(self) -> str | None:
        """Why the job's store became unreachable (its host, the launcher, was lost), as the
        watcher saw it; ``None`` while it answers."""
        return None if self._watcher is None else self._watcher.store_lost

    def _members(self) -> list[int]:
        return [] if self.membership is None else self.membership.members

    def _neighbour(self) -> int | None:
        """The member whose heartbeat this one's watcher watches (the next rank's), once this
        generation has formed: before, a newcomer to it may not beat yet (a process waiting to
        join has no watcher), and its silence is no sign of a loss."""
        m = self.membership
        if m is None or m.world < 2 or self._formed != m.generation:
            return None
        return m.members[(m.rank + 1) % m.world]

    @property
    def stateless(self) -> bool:
        """Whether this process holds no train state yet: a process that joined a running job
        and has not restored a boundary. (It may be a member of a later generation than the one
        that admitted it, when a member of that one was lost before it formed: it is then no
        newcomer to the generation, but still has everything to receive.)"""
        return self.joining and not self.restored

    def join_waiting(self) -> bool:
        """Whether processes wait to join that the next boundary can admit (enough of them
        for a world the job accepts)."""
        members = [] if self.membership is None else self.membership.members
        waiting = self.jobs.waiting(members, self.jobs.exits())
        return admission(members, waiting, self.accepts) is not None

    def close(self) -> None:
        """Stop this rank's watcher thread (before the process exits)."""
        from fullshard.comm.desync import set_interrupt

        with contextlib.suppress(Exception):  # (the store may be what was lost)
            self.jobs.leaving(self.member)  # its heartbeat stops now: no one may suspect it
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        if dist.is_initialized():
            set_interrupt(None)

    def join_waiting_or_whole(self) -> bool:
        """:meth:`join_waiting`, or the job back at generation 0's world (nothing to wait for)."""
        whole = self.membership is not None and self.membership.world >= self.world0
        return whole or self.join_waiting()

    def finish(self, *, complete: bool = True) -> None:
        """The job is done (rank 0, at the end): processes still waiting to join leave.
        ``complete``: it trained to the end (not stopped early), which its launcher reports as a
        success whatever a process does afterwards."""
        if complete:
            self.jobs.set_note("complete", "1")
        self.jobs.set_note("finished", "1")

    def _abort_device_groups(self, generation: int) -> None:
        """From the watcher thread, when the membership moves on from ``generation`` (NCCL
        only): abort that generation's NCCL communicators, so that the kernels waiting for a
        dead peer end now and the host's next wait or read fails, instead of at the process
        group's timeout. Only that generation's: when this rank has moved on already (its
        recovery aborted them and made the next one's), nothing. (On gloo an abort wakes no
        async work; host waits poll their NOTE [Interrupts] token instead.) Not run on a GPU
        yet: no device was lent."""
        with _ABORTING:
            if self.generation != generation or not dist.is_initialized():
                return
            groups = []
            for pg in list(dist.distributed_c10d._world.pg_map):
                with contextlib.suppress(Exception):  # torn down meanwhile
                    if "nccl" in str(dist.get_backend(pg)).lower():
                        groups.append(pg)
            _abort_all(groups)

    def abort(self, message: str) -> None:
        """Stop the whole job: every rank waiting for a membership reads ``message``."""
        self.jobs.abort(message)

    def recover(self, error: BaseException) -> Membership:
        """After ``error`` in a step (or a :class:`Regroup`): abort this rank's groups (so its
        peers fail at once too), settle the next generation with the others, and join it. A
        process left out of it asks to join again and waits. Raises :class:`Lost` when no rank
        was lost (the error is a failure of its own), when no membership comes within the
        timeout, or when the job was ended."""
        from fullshard.comm import device

        regroup = isinstance(error, Regroup)
        if not regroup and self._failed_at is None:
            self._failed_at = time.time()
        abort_groups()
        # the failed step's work (an aborted collective, a prefetch) drains before the old
        # model's buffers are freed or reused (recovery, not a steady-state step: the host waits)
        device.synchronize(self.device)
        target = self.generation + 1
        with _store_alive(self.address):
            record = self.jobs.generation(target) or self._settle(target, error)
            if record.get("unchanged"):
                raise Lost(
                    "a step failed, and no rank was lost: "
                    + "; ".join(f"rank {r}: {why}" for r, why in record["errors"])
                )
            return self._join_settled(target, record)

    def _settle(self, target: int, error: BaseException) -> dict[str, Any]:
        """Check in for generation ``target`` and wait until it is written (NOTE
        [Generations]; its decider fences a member lost though alive: NOTE [Fencing])."""
        m = self.membership
        assert m is not None, "join() first"
        info = {"held": self.copies.held(), "error": _why(error), "failed_at": self._failed_at}
        settle = Settle(
            self.jobs,
            self.member,
            target,
            m.members,
            self.timeout_s,
            self.accepts,
            self._check_abort,
        )
        return settle.run(info, _why(error))

    def _admit(self) -> None:
        """Rank 0 at a boundary whose copies are taken: admit waiting processes by writing the
        next generation (as many as make a world the job accepts), then regroup."""
        m, watcher = self.membership, self._watcher
        if m is None or m.rank != 0 or watcher is None or watcher.joins <= self._joins_seen:
            return
        self._joins_seen = watcher.joins
        record = admission(m.members, self.jobs.waiting(m.members, self.jobs.exits()), self.accepts)
        if record is not None and self.jobs.write_generation(m.generation + 1, record):
            raise Regroup(f"admitting rank(s) {record['joined']}")

    # -- redundancy ---------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """True when the boundary after ``step`` steps gets copies."""
        return step % self.every == 0

    def _layout(self) -> Layout:
        m = self.membership
        assert m is not None, "join() first"
        return self.layout(m.world)

    def snapshot(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        state: dict,
        *,
        restored: bool = False,
    ) -> None:
        """The step boundary after ``step`` steps (call on every rank before the step's first
        collective): send the previous boundary's copy to the ring neighbour, and copy this
        one's shards to the host. On rank 0 it may then raise :class:`Regroup` to admit
        waiting processes. ``restored``: the boundary a recovery just restored, whose copy is
        sent at once (no one else holds it: another loss before the next boundary is sent
        would find it nowhere), and no one is admitted here."""
        self.progress = step  # the watcher publishes it (NOTE [Fencing])
        if not restored and (not self.due(step) or step in self.copies.own):
            return
        from fullshard.checkpoint.state_dict import get_state_dict
        from fullshard.comm import device

        t0 = time.perf_counter()
        m = self.membership
        assert m is not None, "join() first"
        self._send_newest()
        if optimizer.state:
            model_sd, optim_sd = get_state_dict(model, optimizer)
        else:  # before the first update: what the model is built with (NOTE [Ring copies])
            model_sd, optim_sd = {}, {"state": {}, "param_groups": None}
        built_now = not self.copies.boxes  # the first copy of this generation's model
        stream = None
        if device.cuda_semantics(self.device):
            if self._stream is None:
                self._stream = device.new_stream(self.device, "elastic copy")
            stream = self._stream
            self._order_updates(optimizer)
        # the membership history travels with the state: a new rank 0 reports it all
        pieces, event, flat = pieces_of(
            model_sd,
            optim_sd,
            {**state, MEMBERSHIP: self.changes},
            self.device,
            stream,
            self.copies.boxes,
            spare=None if restored else self.copies.spare(),
        )
        if event is not None and not built_now:
            self._order_gathers(model, event)
        elif event is not None:  # a model built for this generation: its first forward's lazy
            # init writes every shard buffer's tag columns on compute, and the gathers wait for
            # compute as usual
            device.current_stream(self.device).wait_event(event)
        layout = self._layout()
        # before the first update no shard is held (NOTE [Ring copies]): everyone's copy is
        # everyone's, so a rank lost in the first step is recovered from any survivor
        mine = REPLICATED if not pieces["chunks"] else layout.key(m.rank)
        key = f"{m.generation}:{mine}"
        self.copies.add_own(step, HostCopy(m.generation, key, pieces, event, flat), layout.keys)
        if restored:
            self._send_newest()
        self.copy_bytes = flat.numel() + self.copies.received
        self.snapshot_s += time.perf_counter() - t0
        if not restored:
            self._admit()

    @staticmethod
    def _order_gathers(model: nn.Module, event: Any) -> None:
        """The next forward's all-gathers write each unit's shard buffer (its tag columns) on
        the gather stream: they wait for the copy, which reads that buffer, through the root's
        post-optimizer event. The copy's event follows everything the compute stream had queued
        (its stream waited for it), so nothing the gathers waited for before is lost; the copy
        is a few milliseconds of device-to-host bandwidth before the first gather."""
        from fullshard.engine.fsdp_module import FSDPModule

        if isinstance(model, FSDPModule):
            model.set_post_optim_event(event)

    def _order_updates(self, optimizer: torch.optim.Optimizer) -> None:
        """On the CUDA path the optimizer's updates wait for the newest copy (once per
        optimizer: a rebuilt one is hooked again)."""
        if optimizer in self._hooked:
            return

        update_after_copies(optimizer, self.copies.newest_event, self.device)
        self._hooked.add(optimizer)

    def _send_newest(self) -> None:
        """Send the newest own copy not yet sent to the rank that keeps it (its host buffers
        are filled by now: a step has passed), and keep the copy that comes in."""
        m = self.membership
        assert m is not None
        layout = self._layout()
        step = self.copies.take_unsent()
        if step is None or layout.keys < m.world or m.world == 1:
            return  # (HSDP: the replicas hold it; alone: no one can)
        if self.copies.own[step].key.endswith(f":{REPLICATED}"):
            return  # every rank holds this boundary already
        from fullshard.comm import control

        sent = self.copies.own[step].packed()
        meta, flat = control.ring_exchange(
            sent, self.host_group, distance=layout.ring_step, reuse=self.copies.spare_received()
        )
        src = (m.rank - layout.ring_step) % m.world
        self.copies.keep(step, f"{m.generation}:{layout.key(src)}", meta, flat)

    def restore(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> int:
        """Load the newest boundary the participants hold into ``model``, ``optimizer`` and
        ``state`` (call on every rank of the new generation); returns its step."""
        m = self.membership
        assert m is not None, "join() first"
        step, loop_state, self.restored_bytes = restore_boundary(
            model, optimizer, self.copies, self.member, m.rank, m.generation, self.host_group
        )
        self.changes = list(loop_state.pop(MEMBERSHIP, []))
        self.restored = True
        state.clear()
        state.update(loop_state)
        self.copies.clear()  # another generation's layout: the next boundary copies anew
        if m.generation > 0:
            self.changes.append(
                {
                    "step": step + 1,
                    "generation": m.generation,
                    "reason": m.reason,
                    "world_size": m.world,
                    "ranks_lost": m.lost,
                    "ranks_joined": m.joined,
                    "ranks_left": m.left,
                    "recovery_s": round(time.time() - (m.dead_at or self._failed_at or 0), 3),
                }
            )
        self._failed_at = None
        return step
