"""Who is in an elastic job (layer 9): the generations kept in the job's c10d store, the one
rule that decides the next one (:func:`decide`), and each member's watcher thread.

NOTE [Generations]
The job's ``TCPStore`` outlives every rank: fullshard's elastic launcher hosts it
(``app/launch/elastic.py``); under torchrun, with ``--rdzv-backend fullshard``, the first node's
agent does.
Membership is a sequence of generations, each written once (``compare_set``) under ``gen/<g>``:
the member ids in rank order, the ranks lost, joined and left out, and why. Generation 0 is
ranks 0..N-1, written by rank 0. The ranks decide every later one themselves, so one protocol
runs under either launcher:

- *A loss.* A rank whose wait fails aborts its process groups (its peers' waits fail in turn)
  and checks in for g+1 (``ready/<g+1>``, with the boundaries it holds). A member is dead when a
  launcher reported its exit (``exits``), or when its heartbeat (``hb/<member>``, a counter its
  watcher raises every HEARTBEAT_S) has not moved for DEAD_S. Once every member of g has checked
  in or is dead, and every replacement a launcher announced for the dead has asked to join, the
  survivor of lowest rank writes g+1 (:func:`decide`): survivors keep their order, a
  replacement takes the slot of the member it replaces, other joiners come last, and the world
  is the largest the job accepts (``--deterministic``: a power of two), leaving out survivors
  whose shards others also hold (they ask to join again) or joiners (they wait).
- *A join.* A new process appends itself to ``joins`` and waits. Rank 0 of the current
  generation admits it at a step boundary, once that boundary's copies are taken, by writing g+1
  and regrouping (``Regroup``); the other ranks' waits give up when their watchers see g+1, and
  every member restores that boundary, the newcomer included.

A rank joins generation g's process group under a key prefix of g's own, so no key of a dead
generation is read again. A member's watcher thread has a store client of its own (the main
thread's may be blocked in a call); it raises the heartbeat and notices a newer generation, or
a check-in for one, which makes this rank's host waits give up (NOTE [Interrupts] in
``comm/desync.py``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from fullshard.policies import FullshardError

__all__ = [
    "DEAD_S",
    "HEARTBEAT_S",
    "Decision",
    "Joiner",
    "JobFinished",
    "JobStore",
    "Lost",
    "Membership",
    "admission",
    "after_loss",
    "decide",
]

PREFIX = "fullshard/elastic/"
HEARTBEAT_S = 0.2  # a member's watcher raises its heartbeat this often
DEAD_S = 3.0  # a heartbeat unchanged this long, seen by a survivor: the member is dead
MEMBER_ENV = "FULLSHARD_ELASTIC_MEMBER"  # a process's member id, when its launcher gives one
JOIN_ENV = "FULLSHARD_ELASTIC_JOIN"  # set for a process that joins a running job
REPLACES_ENV = "FULLSHARD_ELASTIC_REPLACES"  # the member a launcher's replacement stands in for


class Lost(FullshardError):
    """Ranks were lost and the job cannot go on in memory (or no new membership came)."""


class JobFinished(FullshardError):
    """The job ended before this process was admitted to it."""


@dataclass(frozen=True)
class Membership:
    """One generation: who is in the job, and this process's place in it."""

    generation: int
    members: list[int]  # member ids, in rank order
    rank: int
    lost: list[int] = field(default_factory=list)  # ranks of the previous generation lost
    joined: list[int] = field(default_factory=list)  # ranks of this one that are new
    left: list[int] = field(default_factory=list)  # previous ranks alive but left out
    dead_at: float | None = None  # wall-clock time the change began
    reason: str = "start"  # start, loss or join

    @property
    def world(self) -> int:
        return len(self.members)

    @property
    def joined_now(self) -> bool:
        """True for a process new in this generation (it holds no state yet)."""
        return self.rank in self.joined

    @classmethod
    def of(cls, generation: int, record: dict[str, Any], member: int) -> Membership:
        members = list(record["members"])
        return cls(
            generation,
            members,
            members.index(member),
            list(record.get("lost", [])),
            list(record.get("joined", [])),
            list(record.get("left", [])),
            record.get("dead_at"),
            record.get("reason", "start"),
        )


@dataclass(frozen=True)
class Joiner:
    """A process that asked to join: its member id, and the member it replaces (if any)."""

    member: int
    replaces: int | None = None


@dataclass(frozen=True)
class Decision:
    """The next generation's members (rank order), and how it differs from the last."""

    members: list[int]
    lost: list[int]  # old ranks that are dead
    joined: list[int]  # new ranks of processes that were not members
    left: list[int]  # old ranks alive but left out (they ask to join again)


def decide(
    old: list[int],
    alive: Iterable[int],
    joiners: list[Joiner],
    accepts: Callable[[int], bool],
    covered: Callable[[list[int]], bool],
) -> Decision | None:
    """The next generation after ``old`` (member ids in rank order), given the members that
    checked in (``alive``; the rest are dead), the processes waiting to join, the world sizes
    the job ``accepts``, and whether survivors ``covered`` every shard of the newest boundary.

    Survivors keep their order; a replacement takes the slot of the member it replaces, other
    joiners come after. The world is the largest accepted one: joiners fill it after the
    survivors; when the survivors alone are too many, those of highest rank whose shards the
    others also hold are left out. ``None`` when no accepted world can be formed.
    """
    alive = set(alive)
    pending = list(joiners)
    slots: list[int] = []
    for m in old:
        if m in alive:
            slots.append(m)
            continue
        stand_in = next((j for j in pending if j.replaces == m), None)
        if stand_in is not None:
            slots.append(stand_in.member)
            pending.remove(stand_in)
    slots += [j.member for j in pending]
    survivors = [m for m in slots if m in alive]
    new = [m for m in slots if m not in alive]
    for total in range(len(slots), 0, -1):
        if not accepts(total):
            continue
        if total >= len(survivors):
            admitted = set(new[: total - len(survivors)])
            members = [m for m in slots if m in alive or m in admitted]
        else:
            members = list(survivors)
            for m in reversed(survivors):
                trial = [x for x in members if x != m]
                if len(members) > total and covered(trial):
                    members = trial
            if len(members) != total:
                continue
        return Decision(
            members,
            lost=[r for r, m in enumerate(old) if m not in alive],
            joined=[r for r, m in enumerate(members) if m not in old],
            left=[r for r, m in enumerate(old) if m in alive and m not in members],
        )
    return None


def after_loss(
    old: list[int],
    ready: dict[int, dict[str, Any]],
    exits: dict[int, dict[str, Any]],
    joiners: list[Joiner],
    accepts: Callable[[int], bool],
    covered: Callable[[list[int]], bool],
) -> dict[str, Any] | None:
    """The record of the generation after ``old`` once its members have checked in
    (``ready``: member -> check-in) or died (``exits``: a launcher's reports), by
    :func:`decide`; ``None`` when no world the job accepts can be formed. Nobody lost and nobody
    waiting: the failure was not a loss, and the record says so, with every rank's error."""
    if len(ready) == len(old) and not joiners:
        errors = [(old.index(x), r["error"]) for x, r in ready.items()]
        return {"members": old, "unchanged": True, "errors": errors}
    d = decide(old, ready, joiners, accepts, covered)
    if d is None:
        return None
    starts = [r["failed_at"] for r in ready.values() if r.get("failed_at")]
    starts += [exits[x]["at"] for x in old if x in exits]
    return {
        "members": d.members,
        "lost": d.lost,
        "joined": d.joined,
        "left": d.left,
        "dead_at": min(starts, default=time.time()),
        "reason": "loss",
    }


def admission(
    members: list[int], waiting: list[Joiner], accepts: Callable[[int], bool]
) -> dict[str, Any] | None:
    """The record of the generation that admits as many of ``waiting`` (in the order they
    asked) as make a world the job accepts, after ``members``; ``None`` when none can come."""
    world = len(members)
    fits = [n for n in range(len(waiting), 0, -1) if accepts(world + n)]
    if not fits:
        return None
    admitted = [j.member for j in waiting[: fits[0]]]
    return {
        "members": members + admitted,
        "lost": [],
        "left": [],
        "joined": list(range(world, world + len(admitted))),
        "dead_at": time.time(),
        "reason": "join",
    }


def _key(*parts: object) -> str:
    return PREFIX + "/".join(str(p) for p in parts)


class JobStore:
    """The elastic job's keys in its c10d store (NOTE [Generations]); lists are appended JSON
    lines, so one ``get`` reads them whole."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store

    def _get(self, key: str) -> bytes | None:
        return self.store.get(key) if self.store.check([key]) else None

    def _lines(self, key: str) -> list[dict[str, Any]]:
        raw = self._get(key)
        return [json.loads(line) for line in raw.decode().splitlines() if line] if raw else []

    def _append(self, key: str, record: dict[str, Any]) -> None:
        self.store.append(key, json.dumps(record) + "\n")  # type: ignore[attr-defined]

    # generations
    def generation(self, g: int) -> dict[str, Any] | None:
        raw = self._get(_key("gen", g))
        return None if raw is None else dict(json.loads(raw.decode()))

    def write_generation(self, g: int, record: dict[str, Any]) -> bool:
        """Write generation ``g`` unless someone did first; True when this record won."""
        text = json.dumps({**record, "writer": f"{time.time_ns()}-{id(self)}"})
        won = self.store.compare_set(_key("gen", g), "", text).decode() == text
        if won:
            self.store.add(_key("latest"), 1)  # generations 0..latest-1 exist
            self._tell()
        return won

    # news: one counter every noteworthy write raises, which the members' watchers poll
    # instead of every key (NOTE [Generations]: a member's store traffic does not grow with
    # the world size)
    def _tell(self) -> None:
        self.store.add(_key("news"), 1)

    def news(self) -> int:
        return int(self.store.add(_key("news"), 0))

    def latest(self) -> int:
        """The newest generation written (-1 before generation 0)."""
        return int(self.store.add(_key("latest"), 0)) - 1

    def has_generation(self, g: int) -> bool:
        return bool(self.store.check([_key("gen", g)]))

    # forming a generation (Manager._arrive)
    def arrive(self, g: int, member: int) -> None:
        """``member`` is ready to form generation ``g``'s process group."""
        self.store.set(_key("arrived", g, member), "1")

    def all_arrived(self, g: int, members: list[int]) -> bool:
        return bool(self.store.check([_key("arrived", g, m) for m in members]))

    def not_arrived(self, g: int, members: list[int]) -> list[int]:
        return [m for m in members if not self.store.check([_key("arrived", g, m)])]

    # losses
    def check_in(self, g: int, member: int, info: dict[str, Any]) -> None:
        self._append(_key("ready", g), {"member": member, **info})
        self.store.add(_key("ready", g, "count"), 1)
        self._tell()

    def check_ins(self, g: int) -> dict[int, dict[str, Any]]:
        return {r["member"]: r for r in self._lines(_key("ready", g))}

    def decider(self, g: int, member: int, replaces: int | None = None) -> int:
        """Claim the deciding of generation ``g`` for ``member`` (or take it over from
        ``replaces``, a decider that died); the member who holds it now."""
        expected = "" if replaces is None else str(replaces)
        return int(self.store.compare_set(_key("decider", g), expected, str(member)).decode())

    def recovering(self, g: int) -> bool:
        """Whether any rank has checked in for generation ``g``."""
        return int(self.store.add(_key("ready", g, "count"), 0)) > 0

    def report_exit(self, member: int, status: int | None, replacement: int | None) -> None:
        """A launcher saw ``member``'s process exit (and started ``replacement`` for it)."""
        self._append(
            _key("exits"),
            {"member": member, "status": status, "replacement": replacement, "at": time.time()},
        )
        self._tell()

    def exits(self) -> dict[int, dict[str, Any]]:
        return {r["member"]: r for r in self._lines(_key("exits"))}

    def beat(self, member: int) -> None:
        self.store.add(_key("hb", member), 1)

    def beats(self, members: Iterable[int]) -> dict[int, int]:
        return {m: int(self.store.add(_key("hb", m), 0)) for m in members}

    def set_progress(self, member: int, step: int) -> None:
        """The step the member's training loop last reached (its watcher publishes it)."""
        self.store.set(_key("step", member), str(step))

    def progress(self, members: Iterable[int]) -> dict[int, int]:
        got = {m: self._get(_key("step", m)) for m in members}
        return {m: int(raw) for m, raw in got.items() if raw is not None}

    def suspect(self, member: int, by: int) -> None:
        """``by``'s watcher saw ``member``'s heartbeat stop (NOTE [Fencing])."""
        self._append(_key("suspects"), {"member": member, "by": by, "at": time.time()})
        self._tell()

    def suspects(self) -> set[int]:
        return {r["member"] for r in self._lines(_key("suspects"))}

    def fence(self, member: int, why: str) -> None:
        """``member`` is lost, though its process may live (hung, frozen): it may never take
        part again; its launcher kills it, and its own watcher ends it (NOTE [Fencing])."""
        self._append(_key("fenced"), {"member": member, "why": why, "at": time.time()})
        self.store.set(_key("fenced", member), why)
        self._tell()

    def fenced(self) -> dict[int, str]:
        return {r["member"]: r["why"] for r in self._lines(_key("fenced"))}

    def fenced_at(self) -> dict[int, float]:
        return {r["member"]: r["at"] for r in self._lines(_key("fenced"))}

    def why_fenced(self, member: int) -> str | None:
        raw = self._get(_key("fenced", member))
        return None if raw is None else raw.decode()

    def leaving(self, member: int) -> None:
        """``member`` ends normally: its heartbeat stops, and no one may suspect it for that."""
        self.store.set(_key("leaving", member), "1")

    def is_leaving(self, member: int) -> bool:
        return bool(self.store.check([_key("leaving", member)]))

    # joins
    def reserve_ids(self, n: int) -> None:
        """Member ids 0..n-1 are generation 0's (a no-op once any id was handed out)."""
        self.store.compare_set(_key("next_member"), "", str(n))

    def new_member_ids(self, n: int) -> int:
        """The first of ``n`` fresh member ids."""
        return int(self.store.add(_key("next_member"), n)) - n

    def ask_join(self, member: int, replaces: int | None) -> None:
        self._append(_key("joins"), {"member": member, "replaces": replaces})
        self.store.add(_key("joins", "count"), 1)
        self._tell()

    def join_count(self) -> int:
        return int(self.store.add(_key("joins", "count"), 0))

    def joins(self) -> list[Joiner]:
        """Processes that asked to join, in order, the newest request of each."""
        latest: dict[int, Joiner] = {}
        for r in self._lines(_key("joins")):
            latest.pop(r["member"], None)
            latest[r["member"]] = Joiner(r["member"], r.get("replaces"))
        return list(latest.values())

    def waiting(self, members: list[int], exits: dict[int, Any]) -> list[Joiner]:
        """The processes that asked to join, are not among ``members``, did not exit and were
        not fenced (a zombie that wakes and asks again is refused: NOTE [Fencing])."""
        fenced = self.fenced()
        return [
            j
            for j in self.joins()
            if j.member not in members and j.member not in exits and j.member not in fenced
        ]

    # the end
    def abort(self, message: str) -> None:
        """End the whole job: every rank waiting on the store reads ``message``."""
        self.store.compare_set(_key("abort"), "", message)
        self._tell()

    def aborted(self) -> str | None:
        raw = self._get(_key("abort"))
        return None if raw is None else raw.decode()

    def set_note(self, name: str, value: str) -> None:
        self.store.set(_key("note", name), value)

    def note(self, name: str) -> str | None:
        raw = self._get(_key("note", name))
        return None if raw is None else raw.decode()
