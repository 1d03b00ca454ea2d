"""Settling the generation after a loss (layer 9): every survivor checks in, one of them
decides, and a rank that is lost though its process lives is fenced (NOTE [Generations],
NOTE [Fencing] in ``watcher.py``).

The first survivor to claim generation g+1 (``JobStore.decider``) decides it; the others wait
for its record on the store (no polling) and take the deciding over if the decider itself dies.
The decider reads the check-ins, the launcher's exit reports, the watchers' suspects and the
fences: a few store reads per look whatever the world size, and the heartbeats and step
counters of the members still unsettled only, once the others had time to check in.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fullshard.elastic.membership import JobStore, Lost, after_loss
from fullshard.elastic.pieces import Unrecoverable, choose_boundary
from fullshard.elastic.watcher import DEAD_S, HEARTBEAT_S

__all__ = ["Settle", "fence_after"]

LOOK_S = 0.02  # how often the decider looks
WAIT_S = 0.1  # how often the others look for the decided record
REPLACEMENT_WAIT_S = 2.0  # after a fence, how long to wait for the launcher to report a kill


def fence_after(timeout_s: float) -> float:
    """How long after its first check-in a generation waits for a member that still beats
    before fencing it as hung: every live member's waits give up within a moment of the first
    check-in (NOTE [Interrupts]), but one busy in a long computation reaches its next wait only
    when it is done; a quarter of the collectives' bound, at least twice DEAD_S."""
    return max(2 * DEAD_S, timeout_s / 4)


@dataclass
class _Liveness:
    """The unsettled members' heartbeats and step counters as the decider last saw them, and
    since when they have not moved."""

    beats: dict[int, tuple[int, float]] = field(default_factory=dict)
    steps: dict[int, tuple[int | None, float]] = field(default_factory=dict)
    looked: float = 0.0

    def stuck(self, jobs: JobStore, unsettled: list[int], now: float, hung_s: float) -> dict:
        """The members among ``unsettled`` to fence, with why: a heartbeat unchanged for
        DEAD_S (frozen), or a step counter unchanged for ``hung_s`` (hung)."""
        if now - self.looked < HEARTBEAT_S:
            return {}
        self.looked = now
        beats, steps = jobs.beats(unsettled), jobs.progress(unsettled)
        out = {}
        for x in unsettled:
            if self.beats.get(x, (None,))[0] != beats[x]:
                self.beats[x] = (beats[x], now)
            if x not in self.steps or self.steps[x][0] != steps.get(x):
                self.steps[x] = (steps.get(x), now)
            if now - self.beats[x][1] > DEAD_S:
                out[x] = "its heartbeat stopped (frozen, or dead without an exit report)"
            elif now - self.steps[x][1] > hung_s:
                out[x] = (
                    f"it did not check in, and its training loop stayed at step {steps.get(x)} "
                    f"for {hung_s:.0f} s while its heartbeat went on (hung)"
                )
        return out


@dataclass
class Settle:
    """One member's part in settling generation ``target`` after generation ``old``'s loss."""

    jobs: JobStore
    member: int
    target: int
    old: list[int]  # the lost generation's members, in rank order
    timeout_s: float
    accepts: Callable[[int], bool]
    check_abort: Callable[[], None]

    def run(self, info: dict[str, Any], error: str) -> dict[str, Any]:
        """Check in (with ``info``: the boundaries this member holds...) and return the record
        of generation ``target`` once written; raises :class:`Lost` when none comes in time."""
        jobs = self.jobs
        jobs.check_in(self.target, self.member, info)
        start = time.monotonic()
        holder = jobs.decider(self.target, self.member)
        last_beat: tuple[int, float] | None = None  # the decider's heartbeat, as last seen
        live = _Liveness()
        while (record := jobs.generation(self.target)) is None:
            self.check_abort()
            now = time.monotonic()
            if holder == self.member:
                if self._decide(start, now, live, error):
                    continue
                time.sleep(LOOK_S)
                continue
            # the others look for the record now and then, and take over from a decider that
            # died (its heartbeat unchanged for DEAD_S)
            time.sleep(WAIT_S)
            if last_beat is None or now - last_beat[1] > DEAD_S:
                beat = jobs.beats([holder])[holder]
                if last_beat is not None and last_beat[0] == beat:
                    holder = jobs.decider(self.target, self.member, replaces=holder)
                    last_beat = None
                else:
                    last_beat = (beat, now)
            if time.monotonic() - start > 2 * self.timeout_s:
                raise Lost(
                    f"{error}, and no generation {self.target} was decided within "
                    f"{2 * self.timeout_s:.0f} s (member {holder} was deciding it)"
                )
        return record

    def _decide(self, start: float, now: float, live: _Liveness, error: str) -> bool:
        """One look, as the decider: True once the record is written."""
        jobs, old = self.jobs, self.old
        ready = {x: r for x, r in jobs.check_ins(self.target).items() if x in old}
        exits, suspects, fenced = jobs.exits(), jobs.suspects(), jobs.fenced()
        dead = {x for x in old if x not in ready and (x in exits or x in fenced)}
        for x in sorted(suspects & set(old) - ready.keys() - dead):
            jobs.fence(x, "its heartbeat stopped (frozen, or dead without an exit report)")
            dead.add(x)
        unsettled = [x for x in old if x not in ready and x not in dead]
        if unsettled and now - start > fence_after(self.timeout_s):
            for x, why in live.stuck(jobs, unsettled, now, fence_after(self.timeout_s)).items():
                jobs.fence(x, why)
                dead.add(x)
            unsettled = [x for x in unsettled if x not in dead]
        replacements = {e["replacement"] for x, e in exits.items() if x in dead}
        waiting_for = {r for r in replacements if r} - {j.member for j in jobs.joins()}
        # a member fenced (not exited) may be killed and replaced by its launcher right away
        fresh = [at for x, at in jobs.fenced_at().items() if x in dead and x not in exits]
        grace = any(time.time() - at < REPLACEMENT_WAIT_S for at in fresh)
        late = now - start > self.timeout_s
        ready_to_write = not unsettled and (not (waiting_for or grace) or late)
        if ready_to_write and self._write(ready, exits, late):
            return True
        if late and (unsettled or waiting_for):
            ranks = [old.index(x) for x in unsettled]
            what = (
                f"rank(s) {ranks} neither checked in nor died"
                if unsettled
                else (f"the replacement(s) {sorted(waiting_for)} never asked to join")
            )
            raise Lost(f"{error}, and {what} within {self.timeout_s:.0f} s (stuck?)")
        return False

    def _write(self, ready: dict[int, dict[str, Any]], exits: dict[int, Any], late: bool) -> bool:
        """Decide the generation from the check-ins and write it; ``False`` when no world the
        job accepts can be formed yet (joiners may still come, until the timeout: ``late``)."""
        jobs = self.jobs
        joiners = jobs.waiting(self.old, exits)
        layouts = {int(g): n for r in ready.values() for g, n in r["held"]["layouts"].items()}

        def covered(kept: list[int]) -> bool:
            return choose_boundary({x: ready[x]["held"] for x in kept}, layouts) is not None

        record = after_loss(self.old, ready, exits, joiners, self.accepts, covered)
        if record is None and not late:
            return False
        if record is None:
            raise Unrecoverable(
                f"{len(ready)} rank(s) survive and {len(joiners)} wait to join, and the job runs "
                f"at no world size up to {len(ready) + len(joiners)} (none came within "
                f"{self.timeout_s:.0f} s)"
            )
        fenced = sorted(self.old.index(x) for x in jobs.fenced() if x in self.old)
        jobs.write_generation(self.target, {**record, "fenced": fenced})
        return True
