"""Fault injection for ``fullshard train`` (tests and drills): what the ranks and the launcher
do when ``FULLSHARD_FAULT`` asks them to misbehave.

``FULLSHARD_FAULT="KIND:rank=R:step=S"`` makes rank R misbehave at the start of step S:

- ``kill``: the process SIGKILLs itself (as if killed, or out of memory);
- ``node``: the process SIGKILLs its launcher's agent, the agent's other workers and itself, at
  once (its node lost; for runs under torchrun, one agent per node);
- ``hang``: the process stops in a sleep longer than any timeout (a stuck rank; its threads,
  the heartbeat among them, go on);
- ``freeze``: the process stops (SIGSTOP) for ``secs`` seconds (default 30), then continues (a
  helper process sends SIGCONT): a rank frozen past its fencing that wakes later, a zombie.
  ``--elastic``'s launcher leaves a frozen rank alone (as a launcher that cannot reach it
  would), so that what ends the zombie is its own fencing when it wakes (NOTE [Fencing]);
- ``cudaerror``: the step raises the error a sticky CUDA fault gives (an illegal memory access:
  every later CUDA call of the process would fail too);
- ``hold``: the process waits until new processes that can be admitted ask to join the job
  (``--elastic``; not when it runs at its starting world already; at most half the process
  group's timeout), so that a drill's restarted node joins before the run ends;
- ``nan``: the rank's loss becomes NaN for that step (a numerical blow-up on one rank);
- ``signal``: the rank sends itself a stop signal (``sig=TERM`` or ``sig=USR1``, default TERM)
  as step S starts, as if preempted there; with ``repeat=2`` it sends the same signal again as
  the preemption checkpoint's save starts (a second signal during the save).

- ``launcher``: the process SIGKILLs fullshard's ``--elastic`` launcher, which hosts the job's
  store (NOTE [Losing the store]);
- ``diskfull``: the rank's write of step S's checkpoint fails as on a full disk (ENOSPC).

With ``at=`` a fault fires at another moment than the start of step S (``kill``, ``node``,
``hang``, ``freeze``):

- ``at=recovery``: when rank R (its rank in the generation that failed) starts recovering from a
  failure in step S or later, once the next generation has formed and before its state is
  restored (a loss during a recovery);
- ``at=generation``: when rank R has the record of the generation after a failure in step S or
  later, the instant it is written, before it forms (a loss while the others restore);
- ``at=save``: when rank R's files of step S's checkpoint are written, before the commit;
- ``at=commit``: on rank 0, when step S's checkpoint's ``.metadata`` is written, before the
  commit (a loss during a checkpoint's commit).

Faults fire only in the first attempt of a job (``TORCHELASTIC_RESTART_COUNT`` 0), so that a run
under ``torchrun --max-restarts`` can show its recovery, and only in the first process of a rank
(``--elastic``'s replacements get none), unless marked ``again=1``: then a replacement that
takes rank R's slot gets it too (the same slot lost again and again). Several faults are joined
with ``+``: ``kill:rank=2:step=4+kill:rank=0:step=7``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from fullshard.policies import FullshardError

__all__ = ["LAUNCHER_PID_ENV", "Fault", "Faults", "fault_from_env"]

KINDS = (
    "kill",
    "node",
    "hang",
    "freeze",
    "hold",
    "nan",
    "signal",
    "cudaerror",
    "launcher",
    "diskfull",
)
AT_RECOVERY = ("kill", "node", "hang", "freeze")  # the kinds that may fire at another moment
MOMENTS = ("step", "recovery", "generation", "save", "commit")
LAUNCHER_PID_ENV = (
    "FULLSHARD_LAUNCHER_PID"  # fullshard's --elastic launcher's pid, for ``launcher``
)


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int
    sig: signal.Signals = signal.SIGTERM
    repeat: int = 1
    secs: float = 30.0  # freeze
    at: str = "step"  # or one of MOMENTS
    again: bool = False  # a replacement in the slot gets it too

    def _send(self, rank: int, when: str) -> None:
        print(f"[fault] rank {rank} sends itself {self.sig.name} {when}", flush=True)
        os.kill(os.getpid(), self.sig)

    def at_step(self, step: int, rank: int, joining: Callable[[], bool] | None = None) -> bool:
        """Apply the fault if it is due; returns True when the loss must become NaN.
        ``joining``: whether a process waits to join the job (for ``hold``)."""
        if step != self.step or rank != self.rank or self.at != "step":
            return False
        return self._apply(step, rank, joining)

    def at_recovery(self, failed_step: int, rank: int, moment: str = "recovery") -> None:
        """Apply an ``at=recovery`` (or ``at=generation``: ``moment``) fault if it is due:
        ``rank`` (its rank in the generation that failed) recovers from a failure in step
        ``failed_step``."""
        if self.at == moment and rank == self.rank and failed_step >= self.step:
            print(
                f"[fault] rank {rank} is lost while recovering from step {failed_step} ({moment})",
                flush=True,
            )
            self._apply(failed_step, rank, None)

    def at_save(self, point: str, step: int, rank: int) -> None:
        """Apply a fault due in step ``step``'s checkpoint at ``point``: ``"write"`` (before
        this rank writes: ``diskfull``), ``"written"`` (``at=save``) or ``"metadata"``
        (``at=commit``, rank 0)."""
        if step != self.step or rank != self.rank:
            return
        if point == "write" and self.kind == "diskfull":
            print(
                f"[fault] rank {rank}'s disk is full as it writes step {step}'s checkpoint",
                flush=True,
            )
            raise OSError(errno.ENOSPC, "No space left on device (a drill)")
        moment = {"written": "save", "metadata": "commit"}.get(point)
        if moment is not None and self.at == moment:
            print(
                f"[fault] rank {rank} is lost during step {step}'s checkpoint ({point})", flush=True
            )
            self._apply(step, rank, None)

    def _apply(self, step: int, rank: int, joining: Callable[[], bool] | None) -> bool:
        if self.kind == "hold" and joining is not None:
            print(f"[fault] rank {rank} holds step {step} until a process asks to join", flush=True)
            # (the others wait in a collective meanwhile: well inside its timeout)
            deadline = time.monotonic() + float(os.environ.get("FULLSHARD_TIMEOUT_S", "300")) / 2
            while not joining() and time.monotonic() < deadline:
                time.sleep(0.05)
        if self.kind == "signal":
            self._send(rank, f"at step {step}")
        if self.kind == "kill":
            print(f"[fault] rank {rank} killed at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "node":
            print(f"[fault] rank {rank} takes its node down at step {step}", flush=True)
            _kill_node()
        if self.kind == "hang":
            print(f"[fault] rank {rank} hangs at step {step}", flush=True)
            time.sleep(10**6)
        if self.kind == "freeze":
            _freeze(rank, step, self.secs)
        if self.kind == "launcher":
            print(f"[fault] rank {rank} kills the launcher at step {step}", flush=True)
            os.kill(int(os.environ[LAUNCHER_PID_ENV]), signal.SIGKILL)
        if self.kind == "cudaerror":
            print(f"[fault] rank {rank}'s device fails at step {step}", flush=True)
            raise RuntimeError("CUDA error: an illegal memory access was encountered (a drill)")
        return self.kind == "nan"

    def at_preemption_save(self, rank: int) -> None:
        """The ``repeat=2`` signal: sent as the preemption checkpoint's save starts."""
        if self.kind == "signal" and self.repeat > 1 and rank == self.rank:
            self._send(rank, "again, during the preemption checkpoint's save")


@dataclass(frozen=True)
class Faults:
    """Several faults in one run (``+``-joined specs): each applies as a :class:`Fault` does."""

    faults: tuple[Fault, ...]

    def at_step(self, step: int, rank: int, joining: Callable[[], bool] | None = None) -> bool:
        poisons = [f.at_step(step, rank, joining) for f in self.faults]
        return any(poisons)

    def at_recovery(self, failed_step: int, rank: int, moment: str = "recovery") -> None:
        for f in self.faults:
            f.at_recovery(failed_step, rank, moment)

    def at_save(self, point: str, step: int, rank: int) -> None:
        for f in self.faults:
            f.at_save(point, step, rank)

    def at_preemption_save(self, rank: int) -> None:
        for f in self.faults:
            f.at_preemption_save(rank)

    def frozen_ranks(self) -> set[int]:
        """The ranks a ``freeze`` fault stops (the launcher leaves them alone)."""
        return {f.rank for f in self.faults if f.kind == "freeze"}


def _freeze(rank: int, step: int, secs: float) -> None:
    """Stop this whole process (every thread: the heartbeat too) for ``secs`` seconds."""
    pid = os.getpid()
    print(f"[fault] rank {rank} (pid {pid}) freezes at step {step} for {secs:g} s", flush=True)
    wake = f"sleep {secs:g}; echo '[fault] pid {pid} continued'; kill -CONT {pid}"
    subprocess.Popen(["sh", "-c", wake], start_new_session=True)  # outlives a stop signal too
    os.kill(pid, signal.SIGSTOP)
    print(f"[fault] rank {rank} (pid {pid}) woke", flush=True)


def _kill_node() -> None:
    """SIGKILL this process's parent (its node's agent), the parent's other children and this
    process: every process of the node at once (Linux: read from /proc)."""
    agent, me = os.getppid(), os.getpid()
    siblings = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in (agent, me):
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == agent:
                siblings.append(int(entry))
    for pid in (agent, *siblings, me):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def fault_from_env(env: Mapping[str, str] | None = None) -> Faults | None:
    """The faults ``FULLSHARD_FAULT`` asks for in ``env`` (default: this process's
    environment), or None where none fire (a restart, a replacement)."""
    env = os.environ if env is None else env
    spec = env.get("FULLSHARD_FAULT", "")
    if not spec or int(env.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return None
    faults = [_parse(part) for part in spec.split("+")]
    if env.get("FULLSHARD_ELASTIC_JOIN"):  # an --elastic replacement: only those marked again
        faults = [f for f in faults if f.again]
    return Faults(tuple(faults)) if faults else None


def _parse(spec: str) -> Fault:
    kind, *fields = spec.split(":")
    values = dict(f.split("=", 1) for f in fields)
    if kind not in KINDS:
        raise FullshardError(f"FULLSHARD_FAULT: unknown fault {kind!r} ({', '.join(KINDS)})")
    name = values.get("sig", "TERM").upper().removeprefix("SIG")
    if name not in ("TERM", "USR1"):
        raise FullshardError(f"FULLSHARD_FAULT: sig={name}: use sig=TERM or sig=USR1")
    at = values.get("at", "step")
    if at not in MOMENTS or (at != "step" and kind not in AT_RECOVERY):
        raise FullshardError(
            f"FULLSHARD_FAULT: {spec}: at= is step, or {', '.join(MOMENTS[1:])} for "
            f"{', '.join(AT_RECOVERY)}"
        )
    return Fault(
        kind,
        int(values.get("rank", 0)),
        int(values.get("step", 1)),
        signal.Signals["SIG" + name],
        int(values.get("repeat", 1)),
        float(values.get("secs", 30)),
        at,
        values.get("again", "0") == "1",
    )
