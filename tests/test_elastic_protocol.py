"""The membership protocol of ``fullshard.elastic`` with members simulated as threads on one
``TCPStore`` (no model, no process group): one decider per generation and its take-over,
NOTE [Fencing] (a hung member fenced, a zombie refused), a boundary before the first update
recovered from any survivor, the watcher's news, suspects and self-fencing, and reused
boundary buffers. Waits are shortened (monkeypatched), never raced against: each test waits
for the outcome, bounded."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fullshard.comm.desync import Interrupted
from fullshard.elastic import manager, settle, watcher
from fullshard.elastic.manager import Manager
from fullshard.elastic.membership import JobFinished, JobStore, Membership
from fullshard.elastic.pieces import Copies, HostCopy, choose_boundary, pieces_of
from fullshard.elastic.settle import Settle

pytestmark = pytest.mark.fast

OLD = [0, 1, 2, 3]


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> Iterator[dist.TCPStore]:
    """A job's store, generation 0 written, the protocol's waits shortened."""
    monkeypatch.setattr(settle, "DEAD_S", 0.3)
    monkeypatch.setattr(settle, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(settle, "fence_after", lambda timeout_s: 0.6)
    monkeypatch.setattr(settle, "REPLACEMENT_WAIT_S", 0.0)
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    JobStore(master).write_generation(0, {"members": OLD})
    yield master


def _client(master: dist.TCPStore) -> JobStore:
    return JobStore(dist.TCPStore("127.0.0.1", master.port, is_master=False))


class _BeatingBetweenLooks(JobStore):
    """A client whose reads of the heartbeats find ``beating``'s moved since the last read: a
    member whose heartbeat goes on, as seen by a decider however slowly its threads run (a
    thread beating on a clock lost that race on a loaded machine: DEAD_S is shortened here)."""

    def __init__(self, store: dist.Store, beating: int) -> None:
        super().__init__(store)
        self.beating = beating

    def beats(self, members: Iterable[int]) -> dict[int, int]:
        self.beat(self.beating)
        return super().beats(members)


def _settle(
    master: dist.TCPStore, member: int, out: dict[int, Any], beating: int | None = None
) -> threading.Thread:
    def run() -> None:
        jobs = _client(master)
        if beating is not None:
            jobs = _BeatingBetweenLooks(jobs.store, beating)
        s = Settle(jobs, member, 1, OLD, 30.0, lambda w: w >= 1, lambda: None)
        held = {"own": {}, "copy": {}, "layouts": {}}
        try:
            out[member] = s.run({"held": held, "error": "e", "failed_at": None}, "e")
        except Exception as exc:  # (reported by the test)
            out[member] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_hung_member_is_fenced_and_may_never_come_back(store: dist.TCPStore) -> None:
    JobStore(store).set_progress(3, 5)  # its step stays at 5, its heartbeat goes on: hung
    out: dict[int, Any] = {}
    for t in [_settle(store, m, out, beating=3) for m in (0, 1, 2)]:
        t.join(60)
    records = [out[m] for m in (0, 1, 2)]
    assert all(r == records[0] for r in records), records  # one decision, read by all
    record = records[0]
    assert (record["members"], record["lost"], record["fenced"]) == ([0, 1, 2], [3], [3])
    jobs = JobStore(store)
    assert "hung" in jobs.fenced()[3]
    jobs.ask_join(3, None)  # the zombie wakes and asks to join again: refused
    jobs.ask_join(9, None)
    assert [j.member for j in jobs.waiting([0, 1, 2], jobs.exits())] == [9]


def test_a_suspected_member_is_fenced_at_once_and_a_dead_decider_is_replaced(
    store: dist.TCPStore,
) -> None:
    jobs = JobStore(store)
    jobs.suspect(2, by=1)  # its ring neighbour saw its heartbeat stop
    assert jobs.decider(1, 0) == 0  # member 0 claims the deciding, then dies (no heartbeat)
    out: dict[int, Any] = {}
    for t in [_settle(store, m, out) for m in (1, 3)]:
        t.join(20)
    record = out[1]
    assert record == out[3] and (record["members"], record["lost"]) == ([1, 3], [0, 2])
    assert jobs.decider(1, 7) in (1, 3)  # taken over from the dead one
    assert set(jobs.fenced()) == {0, 2}


def test_a_boundary_before_the_first_update_is_everyones() -> None:
    """Lost in the first step (its copy of boundary 0 never sent): any survivor's holds it."""
    held = {p: {"own": {0: "0:*"}, "copy": {}} for p in (0, 1, 2)}
    assert choose_boundary(held, {0: 4}) == (0, {"0:*": 0})


def test_the_watcher_follows_the_news_suspects_its_neighbour_and_ends_when_fenced(
    store: dist.TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(watcher, "DEAD_S", 0.3)
    monkeypatch.setattr(watcher, "HEARTBEAT_S", 0.05)
    fenced: list[str] = []
    w = watcher.Watcher(
        "127.0.0.1",
        store.port,
        1,
        lambda: 0,
        members=lambda: OLD,
        neighbour=lambda: 2,
        progress=lambda: 4,
        on_fenced=lambda m, why: fenced.append(why),
    )
    jobs = JobStore(store)
    try:
        deadline = time.monotonic() + 10
        while not jobs.suspects() and time.monotonic() < deadline:
            time.sleep(0.02)  # member 2 never beats: its neighbour (1) reports it
        assert jobs.suspects() == {2}
        while not w.changed(0) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert w.changed(0) and jobs.progress([1]) == {1: 4}  # its step, published
        jobs.fence(1, "a drill")
        while not fenced and time.monotonic() < deadline:
            time.sleep(0.02)
        assert fenced == ["a drill"]
    finally:
        w.stop()


def test_a_dropped_boundary_buffer_is_filled_again() -> None:
    copies = Copies()
    model = torch.nn.Linear(4, 4)
    flats = []
    for step in range(4):
        spare = copies.spare()
        pieces, _, flat = pieces_of(model.state_dict(), {}, {}, torch.device("cpu"), spare=spare)
        flats.append(flat)
        copies.add_own(step, HostCopy(0, "0:0", pieces, None, flat), 1)
        copies.take_unsent()  # (sent)
    # two buffers in turn: boundary 2 fills boundary 0's, 3 fills 1's
    assert flats[2] is flats[0] and flats[3] is flats[1] and flats[1] is not flats[0]
    assert sorted(copies.own) == [2, 3]


def test_a_process_waiting_to_join_outlives_the_timeout_and_leaves_when_the_job_ends(
    store: dist.TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 43: a process waiting to join (a replacement, a survivor left out of a smaller
    world) never gives up on a timeout of its own, whose Lost ended a job that went on without
    it; it leaves when the job finishes (JobFinished: the trainer exits 0). The clock runs a
    thousand seconds per look (a 1 s timeout long past after the first), and the job finishes
    only once the waiting process has looked three times."""
    clock = itertools.count(0.0, 1000.0)
    monkeypatch.setattr(manager.time, "monotonic", lambda: next(clock))
    mgr = Manager(_client(store).store, 9, world=4, joining=True, timeout_s=1.0)
    looked = threading.Semaphore(0)
    note = mgr.jobs.note

    def counted(name: str) -> str | None:
        looked.release()
        return note(name)

    monkeypatch.setattr(mgr.jobs, "note", counted)
    out: dict[str, Any] = {}

    def wait() -> None:
        try:
            out["got"] = mgr._admission(0, "left out of the smaller world")
        except Exception as exc:  # (reported by the test)
            out["got"] = exc

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    for _ in range(3):
        assert looked.acquire(timeout=20), out
    JobStore(store).set_note("finished", "1")
    t.join(20)
    assert isinstance(out["got"], JobFinished), out
    assert "left out of the smaller world; the job finished" in str(out["got"])


def test_a_member_left_out_of_a_world_that_finished_exits_with_status_0() -> None:
    """Issue 43: JobFinished in a recovery is not a failed one (the left-out survivor used to
    count it as a fourth failed recovery, and its give-up failed a job that trained to the end);
    and the launcher reports a job that noted its end as a success."""
    from fullshard.app.launch.elastic import job_status
    from fullshard.app.train.elastic import _next_membership

    class LeftOut:
        member = 3

        def recover(self, error: BaseException) -> None:
            raise JobFinished("left out of the smaller world; the job finished")

    with pytest.raises(SystemExit) as ended:
        _next_membership(LeftOut(), RuntimeError("a peer was lost"), lambda: None)  # type: ignore[arg-type]
    assert ended.value.code == 0
    assert job_status([0, 0], finished=True, preempted=False) == 0
    assert job_status([0, 1], finished=True, preempted=False) == 0  # one that ended badly after
    assert job_status([0, 1], finished=False, preempted=False) == 1
    assert job_status([75, 75], finished=False, preempted=True) == 75


def test_a_generation_forms_only_once_every_member_arrived(store: dist.TCPStore) -> None:
    """Issue 43: a member lost between a generation's decision and its process group's
    rendezvous (the decider, the instant it wrote it) left the others in gloo's rendezvous for
    the whole timeout. They wait for each other's arrival on the store instead, and give up as
    soon as the membership moves on (here: member 0's exit reported), to settle the next."""
    members = [0, 1, 2]
    moved = threading.Event()

    class Watching:
        def changed(self, generation: int) -> bool:
            return moved.is_set()

    out: dict[int, Any] = {}

    def arrive(member: int) -> None:
        mgr = Manager(_client(store).store, member, world=3, timeout_s=300.0)
        mgr._watcher = Watching()  # type: ignore[assignment]
        try:
            mgr._arrive(Membership(1, members, members.index(member)))
            out[member] = "formed"
        except Exception as exc:  # (reported by the test)
            out[member] = exc

    threads = [threading.Thread(target=arrive, args=(m,), daemon=True) for m in (1, 2)]
    for t in threads:
        t.start()
    jobs = JobStore(store)
    deadline = time.monotonic() + 20
    while jobs.not_arrived(1, members) != [0] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert jobs.not_arrived(1, members) == [0]  # members 1 and 2 wait; member 0 never comes
    moved.set()  # its exit is reported
    for t in threads:
        t.join(20)
    assert all(isinstance(out[m], Interrupted) for m in (1, 2)), out
