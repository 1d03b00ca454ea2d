"""A member's watcher thread on the job's store (layer 9): its heartbeat, its training loop's
progress, and what the others did, seen without polling every key (NOTE [Generations]).

NOTE [Fencing]
A rank can be lost while its process lives: hung (in a stuck collective, a stalled data loader,
a GPU fault) or frozen (a stopped container). Its peers' collectives with it outlive their
bound and fail; they check in for the next generation, and the one that decides it finds the
rank neither checked in nor dead. It is then *fenced*, lost though alive: when its heartbeat
has stopped (frozen), or when it still beats but its training loop's step has not moved since
the others checked in (hung). A fenced member may never take part again: the decision leaves
it out, its launcher (fullshard's) kills it and starts a replacement, and its own watcher ends
its process when it sees itself fenced, which also ends a zombie that wakes later (a frozen
process continued); a fenced member that asks to join is refused.

Detection does not wait for a collective's bound when the store says a rank is gone: each
member's watcher watches its ring neighbour's heartbeat and reports it as suspect when it stops,
and sees the launcher's exit reports; either makes the membership "move on", so this rank's
waits give up (NOTE [Interrupts] in ``comm/desync.py``) and it checks in at once (on NCCL the
watcher also aborts the communicators: a kernel waiting for a dead peer ends now, not at the
watchdog's timeout).

A member's store traffic is a few operations a second whatever the world size: the heartbeat,
its neighbour's, and one counter (``news``) that every noteworthy write raises (a generation, a
check-in, a join, an exit, a suspect, a fence); the details are read only when it moves.

NOTE [Losing the store]
The job's store lives in fullshard's launcher (or the first node's torchrun agent); the ranks'
process groups do not need it once formed, so its loss ends no step. The watcher, which talks to
the store every POLL_S, is the first to see it go: it records why (:attr:`Watcher.store_lost`)
and stops. Without the store no membership can be decided, so the trainer stops the way a stop
signal does (NOTE [Preemption]): the ranks vote on it in the next step, save a checkpoint with
their own collectives and exit, rank 0 naming the checkpoint and the command that resumes it.
A loss that comes with the store's (a node that hosted it) ends in recovery, which finds the
store unreachable and names the newest checkpoint instead. Each failed store operation also
made c10d log a warning with a C++ stack (measured: about 300 lines for 4 ranks, all of them
saying "Broken pipe"); since fullshard reports every failure of the job's store itself, an
elastic rank raises c10's C++ log threshold to errors (:func:`quiet_cpp_warnings`), unless
``TORCH_CPP_LOG_LEVEL`` asks otherwise.
"""

from __future__ import annotations

import atexit
import ctypes
import glob
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from fullshard.elastic.membership import JobStore

__all__ = ["DEAD_S", "HEARTBEAT_S", "POLL_S", "Watcher", "quiet_cpp_warnings"]

HEARTBEAT_S = 0.2  # a member's watcher raises its heartbeat this often
DEAD_S = 3.0  # a heartbeat unchanged this long: the member is dead (or frozen)
POLL_S = 0.05  # how often a watcher reads the news counter


def quiet_cpp_warnings() -> None:
    """NOTE [Losing the store]: c10's C++ warnings (each with a stack) off for this process, unless
    ``TORCH_CPP_LOG_LEVEL`` was set; errors still print. A no-op where libc10 is not found."""
    if "TORCH_CPP_LOG_LEVEL" in os.environ:
        return
    import torch

    for path in glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.*")):
        try:
            level = ctypes.c_int.in_dll(ctypes.CDLL(path), "FLAGS_caffe2_log_level")
        except (OSError, ValueError):
            continue
        level.value = max(level.value, 2)  # 0 info, 1 warning, 2 error
        return


def _why(error: BaseException) -> str:
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"


def _end_fenced(member: int, why: str) -> None:
    """The default for a fenced member: say so, and end the process at once (its main thread
    may be stuck where no exception reaches it)."""
    print(
        f"fullshard: member {member} was fenced ({why}); this process ends",
        file=sys.stderr,
        flush=True,
    )
    os.kill(os.getpid(), signal.SIGKILL)


class Watcher:
    """A member's thread on the job's store (NOTE [Generations], NOTE [Fencing]).

    It raises the member's heartbeat, publishes ``progress()`` (the training loop's step) when it
    moves, watches ``neighbour()``'s heartbeat (a member id of the current generation, or
    ``None``), and follows the news: the newest generation written, the newest being recovered
    to, the join requests, the members exited or suspected, and whether this member was fenced
    (``on_fenced``). ``on_change`` is called (here) once per generation the membership moves on
    from (given that generation). ``store``: a store client of its own (default: a new connection to ``host:port``; the
    main thread's may be blocked in a call)."""

    def __init__(
        self,
        host: str,
        port: int,
        member: int,
        current: Callable[[], int],
        on_change: Callable[[int], None] | None = None,
        *,
        progress: Callable[[], int] | None = None,
        neighbour: Callable[[], int | None] | None = None,
        members: Callable[[], list[int]] | None = None,
        on_fenced: Callable[[int, str], None] = _end_fenced,
        store: dist.Store | None = None,
    ) -> None:
        self.member, self.current, self.on_change = member, current, on_change
        self.progress = progress or (lambda: -1)
        self.neighbour = neighbour or (lambda: None)
        self.members = members or (lambda: [])
        self.on_fenced = on_fenced
        self._told = -1  # the last generation on_change was called for
        self.newest = -1  # the newest generation seen written
        self.recovering_to = -1  # the newest generation some rank has checked in for
        self.joins = 0  # join requests seen
        self.gone: set[int] = set()  # members reported exited or suspected
        # why the store stopped answering (NOTE [Losing the store])
        self.store_lost: str | None = None
        self._client = (host, port)
        self._given = store
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fullshard-elastic", daemon=True)
        self._thread.start()
        atexit.register(self.stop)  # a process that leaves without close()

    def _run(self) -> None:
        host, port = self._client
        try:
            store = self._given or dist.TCPStore(
                host, port, is_master=False, wait_for_workers=False
            )
        except dist.DistError as exc:
            self.store_lost = _why(exc)
            return
        jobs = JobStore(store)
        last_beat, news, published = 0.0, -1, None
        watched: tuple[int | None, int, float] = (None, -1, 0.0)  # (member, its beat, since)
        while not self._stop.is_set():
            try:
                now = time.monotonic()
                g = self.current()
                if now - last_beat >= HEARTBEAT_S:
                    jobs.beat(self.member)
                    last_beat = now
                    watched = self._watch_neighbour(jobs, watched, now)
                step = self.progress()
                if step != published:
                    jobs.set_progress(self.member, step)
                    published = step
                seen = jobs.news()
                if seen != news:
                    news = seen
                    self._read_news(jobs, g)
                if self.on_change is not None and self.changed(g) and self._told < g:
                    self._told = g
                    self.on_change(g)
            except dist.DistError as exc:  # the store is gone: its host was lost
                self.store_lost = _why(exc)
                return
            except Exception:  # (the main thread's own calls fail with the reason)
                return
            self._stop.wait(POLL_S)

    def _read_news(self, jobs: JobStore, g: int) -> None:
        self.newest = max(self.newest, jobs.latest())
        if jobs.recovering(g + 1):
            self.recovering_to = max(self.recovering_to, g + 1)
        self.joins = jobs.join_count()
        self.gone = set(jobs.exits()) | jobs.suspects()
        why = jobs.why_fenced(self.member)
        if why is not None:
            self.on_fenced(self.member, why)

    def _watch_neighbour(
        self, jobs: JobStore, watched: tuple[int | None, int, float], now: float
    ) -> tuple[int | None, int, float]:
        """One look at the ring neighbour's heartbeat (one store read): reported as suspect
        once it has not moved for DEAD_S (unless it announced that it leaves)."""
        nb = self.neighbour()
        if nb is None or nb == self.member:
            return (None, -1, now)
        beat = jobs.beats([nb])[nb]
        member, last, since = watched
        if member != nb or beat != last:
            return (nb, beat, now)
        if now - since > DEAD_S and nb not in self.gone and not jobs.is_leaving(nb):
            jobs.suspect(nb, self.member)
            self.gone.add(nb)
        return watched

    def changed(self, generation: int) -> bool:
        """Whether the membership moved on from ``generation``: a later one is written or being
        decided, or one of its members was reported exited or suspected."""
        if self.newest > generation or self.recovering_to > generation:
            return True
        return any(m in self.gone for m in self.members())

    def stop(self) -> None:
        """End the thread and wait for it: a daemon thread still inside a store call when the
        interpreter exits is ended in C++ code, which aborts the process ("terminate called
        without an active exception")."""
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)
