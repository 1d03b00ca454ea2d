"""The application's input error, and how a rank hands one to the launcher.

:class:`ConfigError` lives here, importing nothing of the application, so that every app module
(config, data, launch, wrap, ...) can raise it without importing another's dependencies; that is
what keeps ``fullshard.app`` free of import cycles.

NOTE [Input errors on the ranks]: most bad input is refused before launch
(each command's ``validate``, ``fullshard.app.commands``), but some is found only on the ranks: a checkpoint file whose
SHA-256 does not match its manifest (each rank hashes its share), a tokenizer larger than the
model's vocabulary. torchrun knows no exit statuses: a failed rank is its ``ChildFailedError``
traceback and status 1. So when ``fullshard train --nproc N`` launched the ranks, a rank's
:class:`ConfigError` is written to the file named by :data:`ERROR_MARKER_ENV` (the first rank to
write wins) and the rank exits with :data:`RANK_INPUT_EXIT`, printing nothing; the launcher
prints that one message and exits with status 2, as for bad input found before launch. Under an
external torchrun (no marker) every rank prints the message itself.

A run can also end on an expected condition that is not bad input (a full disk, a store lost):
:class:`RunStopped` carries the one message and the exit status, handed over the same way
(:func:`report_error` with a ``status``), and printed once where no launcher takes it
(:func:`say_once`): no traceback, one message per job.
"""

from __future__ import annotations

import json
import os
import sys

__all__ = [
    "ERROR_MARKER_ENV",
    "RANK_INPUT_EXIT",
    "RESUME_ENV",
    "VALIDATED_ENV",
    "ConfigError",
    "RunStopped",
    "read_error",
    "read_report",
    "report_error",
    "resume_command",
    "resume_hint",
    "say_once",
]

# Set by the launcher for its ranks: where a rank writes the input error that ends the run.
ERROR_MARKER_ENV = "FULLSHARD_ERROR_MARKER"

# Set by the launcher for its ranks: the arguments they get were validated before launch, so
# they skip their command's validation (one validation pass per launch, not one per process).
VALIDATED_ENV = "FULLSHARD_VALIDATED"

# Set by the launcher for its ranks: the command that resumes this run (``--resume latest``, its
# run name pinned), for the messages that end a run (``resume_hint``).
RESUME_ENV = "FULLSHARD_RESUME_COMMAND"

# EX_DATAERR in sysexits.h ("the input data was incorrect"): a rank's exit status for bad input,
# distinct from a crash (1) and from a preemption (75).
RANK_INPUT_EXIT = 65


class ConfigError(ValueError):
    """Bad input: the message says what is wrong, where (the flag or the file) and what to do."""


class RunStopped(Exception):  # noqa: N818 (an ending, not a bug: no traceback)
    """The run ends on an expected condition (a full disk, the job's store lost): the message
    says what happened, which checkpoint to resume from and the command; ``status`` is the
    process's exit status. Raised on every rank alike."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def resume_command(argv: list[str], name: str) -> str:
    """The command line that resumes the run ``argv`` (a ``train`` command's arguments) started:
    the same arguments, its run ``name`` pinned, ``--resume latest``."""
    import shlex

    out: list[str] = []
    skip = False
    for arg in argv:
        if skip or arg.startswith("--resume="):
            skip = False
            continue
        skip = arg == "--resume"
        if not skip:
            out.append(arg)
    if not any(a == "--name" or a.startswith("--name=") for a in out):
        out += ["--name", name]
    main = sys.argv[0] if sys.argv else ""
    prog = ["python", "-m", "fullshard.app.cli"] if main.endswith("cli.py") else ["fullshard"]
    return shlex.join([*prog, *out, "--resume", "latest"])


def resume_hint() -> str:
    """The command that resumes this run, as the launcher gave it, or what to change."""
    return os.environ.get(RESUME_ENV) or "the same command with --resume latest"


def report_error(message: str, status: int | None = None) -> bool:
    """Hand ``message`` to the launcher (NOTE [Input errors on the ranks]; ``status``: the
    launcher's exit status for a :class:`RunStopped`, else bad input's); ``False`` when no
    launcher waits for it (an external torchrun), and the caller should print it instead."""
    path = os.environ.get(ERROR_MARKER_ENV)
    if not path:
        return False
    if status is not None:
        message = json.dumps({"message": message, "status": status})
    try:
        # O_EXCL: the first rank's message wins; the others' are the same verdict, or a
        # consequence of it
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return True
    except OSError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(message)
    return True


def read_report(path: str) -> tuple[str, int | None] | None:
    """The message a rank reported at ``path`` and its status (``None``: bad input), or ``None``
    when none did."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
    except OSError:
        return None
    if not text:
        return None
    try:
        report = json.loads(text)
    except ValueError:
        return text, None
    if isinstance(report, dict) and "message" in report:
        return str(report["message"]), int(report["status"])
    return text, None


def read_error(path: str) -> str | None:
    """The message a rank reported at ``path``, or ``None`` when none did."""
    report = read_report(path)
    return None if report is None else report[0]


def say_once(message: str, key: str) -> None:
    """Print ``message`` on stderr once for the job, from whichever of its processes gets here
    first: under fullshard's launchers, the first to create ``key`` beside the launcher's error
    marker (which outlives a launcher that died); elsewhere (an external torchrun), the first
    process of each node."""
    path = os.environ.get(ERROR_MARKER_ENV)
    if path:
        try:
            os.close(os.open(f"{path}.{key}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except FileExistsError:
            return
        except OSError:
            pass  # (the folder is gone): say it rather than not at all
    elif os.environ.get("LOCAL_RANK", "0") != "0":
        return
    print(message, file=sys.stderr, flush=True)
