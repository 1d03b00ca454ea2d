"""Preemption: a stop signal becomes "finish this step, checkpoint, exit 75" on every rank.

NOTE [Preemption]: SLURM (``--signal``, ``scancel``) and Kubernetes (pod eviction) announce the
end of a job with a signal, then kill it after a grace period. ``fullshard train`` handles
SIGTERM and SIGUSR1 like this:

- on a rank, the handler only records the signal (Python runs handlers on the main thread
  between bytecodes, so the step in flight is never cut in half);
- each step's existing MAX all-reduce on the device (the non-finite vote of
  :func:`fullshard.app.train.verdict.agree_step`) carries this rank's flag as a second element, so "any
  rank got a signal" becomes "every rank stops after the same step" with no new collective and
  no new host read (the flag tensor is filled on the device, not copied from the host). With
  fp16 the scaler makes its own non-finite decision and there was no vote: that path now runs
  this one small all-reduce per step, read in the step's existing synchronisation;
- after that step's optimizer step every rank saves a checkpoint synchronously (an async save
  is waited for), leaves the process group together and exits with :data:`PREEMPTED_EXIT`;
- the handlers stay installed until the save is committed: a second signal during the save
  is recorded and ignored, it neither kills the rank nor tears the checkpoint;
- the launcher side (``fullshard train --nproc N``) runs torchrun's agent in its own process
  (``fullshard.app.launch.local.launch_local``); the first signal it gets becomes the agent's
  ``SignalException``, so the agent passes it to the ranks and waits for them, and later
  signals are dropped (see :class:`AgentSignals`).

The launch's helper processes ignore the stop signals (NOTE [Helpers ignore stop signals]), so a
signal to the whole process group (a terminal's Ctrl-C, ``timeout``, a scheduler that signals
every task) ends the same way as one to the launcher.

torchrun knows no exit statuses: a rank's 75 is a failure to it. A signal at the agent (what
SLURM and Kubernetes send) makes it stop the workers and exit without a restart; a signal at
one rank only, with ``--max-restarts`` left, makes it restart the group, which resumes from the
preemption checkpoint (one restart per signal: the flag lives in the process, so a restarted
attempt starts clean and there is no restart loop).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, TypeVar

import torch

__all__ = [
    "MARKER_ENV",
    "PREEMPTED_EXIT",
    "SIGNALS",
    "AgentSignals",
    "ForwardSignals",
    "StopSignals",
    "clear_marker",
    "default_stop_signals",
    "helpers_ignore_stop_signals",
    "read_marker",
    "signal_name",
    "write_marker",
]

# EX_TEMPFAIL in sysexits.h: "a temporary failure; the user is invited to retry". Not 0 (the
# run is unfinished: a scheduler must not count it done) and not 1 (nothing failed).
PREEMPTED_EXIT = 75

# SIGTERM: what SLURM, Kubernetes and torchrun's agent send before SIGKILL. SIGUSR1: the usual
# advance warning (``#SBATCH --signal=USR1@120``). SIGINT: Ctrl-C at a terminal reaches the whole
# foreground process group, as a scheduler's signal to every task does.
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

# Set by ``fullshard train --nproc N`` for its ranks: a file that rank 0 writes once the
# preemption checkpoint is committed, so the launcher can tell "preempted" from "failed"
# (torchrun reports both as status 1).
MARKER_ENV = "FULLSHARD_PREEMPT_MARKER"

_S = TypeVar("_S", bound="_Signals")
_Handler = Any  # what signal.signal returns: a callable, SIG_DFL, SIG_IGN or None


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class _Signals:
    """Install a handler for :data:`SIGNALS` on enter; restore the previous ones on exit."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, _Handler] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)

    def __enter__(self: _S) -> _S:
        # signal.signal works on the main thread only; elsewhere (a rank run in a thread by a
        # test harness) preemption is simply not handled, as before.
        if _on_main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    @property
    def requested(self) -> bool:
        """True once a stop signal arrived."""
        return bool(self.received)

    def name(self) -> str:
        """The first signal's name (``SIGTERM``), or ``""`` when none arrived."""
        return signal.Signals(self.received[0]).name if self.received else ""


class StopSignals(_Signals):
    """A rank's stop request: the handlers only record the signal (see NOTE [Preemption]).

    Use as a context manager around the training loop and the save that follows a stop.
    """

    def flag(self, device: torch.device) -> torch.Tensor:
        """This rank's vote, a 1-element float64 tensor on ``device``: the first signal's
        number, or 0 (after a MAX all-reduce every rank knows that some rank got a stop
        signal, and which: the highest number).

        ``torch.full`` passes the value as a kernel argument: no host-to-device copy, so no
        host synchronisation on CUDA (``torch.tensor(x, device="cuda")`` would copy from
        pageable memory and wait for the stream).
        """
        value = float(self.received[0]) if self.received else 0.0
        return torch.full((1,), value, dtype=torch.float64, device=device)


def signal_name(signum: float) -> str:
    """``SIGTERM`` for 15.0: the name of a signal number carried by a vote."""
    try:
        return signal.Signals(int(signum)).name
    except ValueError:
        return f"signal {int(signum)}"


class AgentSignals(_Signals):
    """The launcher's handlers while torchrun's agent runs in this process (and is told to
    leave :data:`SIGNALS` to us): the first stop signal raises torchrun's ``SignalException``
    carrying ``send`` (default: the signal received), on which the agent passes that signal to
    the ranks and waits for them (its ``--shutdown-timeout``); later signals are recorded and
    dropped, since a second exception would break the agent out of that wait and orphan ranks
    that are still saving.

    ``timeout_s``: after that many seconds, the same exception with SIGKILL (the agent kills
    the ranks at once) and :attr:`timed_out` set. Main thread only, as ``signal.signal``.
    """

    def __init__(self, *, send: int | None = None, timeout_s: float | None = None) -> None:
        super().__init__()
        self.send = send
        self.timeout_s = timeout_s
        self.timed_out = False
        self._alarm: list[_Handler] = []  # the previous SIGALRM handler, while ours is set

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        first = not self.received and not self.timed_out
        super()._handle(signum, frame)
        if first:
            self._raise(signal.Signals(signum if self.send is None else self.send))

    def _on_alarm(self, signum: int, frame: FrameType | None) -> None:
        if not self.received and not self.timed_out:
            self.timed_out = True
            self._raise(signal.SIGKILL)

    @staticmethod
    def _raise(sig: signal.Signals) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        raise SignalException(f"fullshard launcher: {sig.name} for the ranks", sigval=sig)

    def __enter__(self) -> AgentSignals:
        super().__enter__()
        if self.timeout_s is not None and _on_main_thread():
            self._alarm.append(signal.signal(signal.SIGALRM, self._on_alarm))
            signal.setitimer(signal.ITIMER_REAL, self.timeout_s)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            previous = self._alarm.pop()
            signal.signal(signal.SIGALRM, previous if previous is not None else signal.SIG_DFL)
        super().__exit__(exc_type, exc, tb)


class ForwardSignals(_Signals):
    """A launcher's handlers while it runs ranks itself (``fullshard train --elastic``): the
    first stop signal is passed to the ranks (``forward(signum)``), later ones are recorded and
    dropped, as :class:`AgentSignals` does for torchrun's agent."""

    def __init__(self, forward: Any) -> None:
        super().__init__()
        self.forward = forward

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        first = not self.received
        super()._handle(signum, frame)
        if first:
            self.forward(signum)


@contextlib.contextmanager
def helpers_ignore_stop_signals() -> Iterator[None]:
    """NOTE [Helpers ignore stop signals]: a scheduler (``timeout``, a terminal's Ctrl-C, SLURM's
    ``--signal``) signals the launch's whole process group, helper processes included:
    multiprocessing's forkserver and resource tracker, which die of SIGTERM or SIGUSR1 (the
    tracker then floods the output with tracebacks) and take the ranks' exit statuses with them.
    Inside this block they are started with the stop signals ignored (a disposition inherited
    across ``exec``); a rank forked from the server puts the defaults back first thing
    (:func:`default_stop_signals`) and installs its own handlers when it trains. Main thread
    only, as ``signal.signal``; elsewhere the block does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def default_stop_signals() -> None:
    """The interpreter's own handling of the stop signals (in a rank forked from a server that
    ignores them: :func:`helpers_ignore_stop_signals`)."""
    for sig in SIGNALS:
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


def write_marker(step: int, checkpoint: str | None, by: str) -> None:
    """Record a committed preemption checkpoint where the launcher looks (rank 0 only)."""
    path = os.environ.get(MARKER_ENV)
    if not path:
        return
    info = {"preempted_after": step, "checkpoint": checkpoint, "signal": by}
    tmp = path + ".tmp"
    Path(tmp).write_text(json.dumps(info) + "\n", encoding="utf-8")
    os.replace(tmp, path)  # the launcher never reads half a marker


def clear_marker() -> None:
    """Forget an earlier attempt's preemption (a restarted attempt that runs on)."""
    path = os.environ.get(MARKER_ENV)
    if path:
        Path(path).unlink(missing_ok=True)


def read_marker(path: str) -> dict[str, Any] | None:
    """The preemption a launch ended with, or ``None`` when its ranks were not preempted."""
    try:
        return dict(json.loads(Path(path).read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return None
