"""The application's input error, and how a rank hands one to the launcher.

:class:`ConfigError` lives here, importing nothing of the application, so that every app module
(config, data, launch, wrap, ...) can raise it without importing another's dependencies; that is
what keeps ``fullshard.app`` free of import cycles.

NOTE [Input errors on the ranks]: most bad input is refused before launch
(``fullshard.app.commands.validate``), but some is found only on the ranks: a checkpoint file whose
SHA-256 does not match its manifest (each rank hashes its share), a tokenizer larger than the
model's vocabulary. torchrun knows no exit statuses: a failed rank is its ``ChildFailedError``
traceback and status 1. So when ``fullshard train --nproc N`` launched the ranks, a rank's
:class:`ConfigError` is written to the file named by :data:`ERROR_MARKER_ENV` (the first rank to
write wins) and the rank exits with :data:`RANK_INPUT_EXIT`, printing nothing; the launcher
prints that one message and exits with status 2, as for bad input found before launch. Under an
external torchrun (no marker) every rank prints the message itself.
"""

from __future__ import annotations

import os

__all__ = [
    "ERROR_MARKER_ENV",
    "RANK_INPUT_EXIT",
    "VALIDATED_ENV",
    "ConfigError",
    "read_error",
    "report_error",
]

# Set by the launcher for its ranks: where a rank writes the input error that ends the run.
ERROR_MARKER_ENV = "FULLSHARD_ERROR_MARKER"

# Set by the launcher for its ranks: the arguments they get were validated before launch, so
# they skip ``fullshard.app.commands.validate`` (one validation pass per launch, not one per process).
VALIDATED_ENV = "FULLSHARD_VALIDATED"

# EX_DATAERR in sysexits.h ("the input data was incorrect"): a rank's exit status for bad input,
# distinct from a crash (1) and from a preemption (75).
RANK_INPUT_EXIT = 65


class ConfigError(ValueError):
    """Bad input: the message says what is wrong, where (the flag or the file) and what to do."""


def report_error(message: str) -> bool:
    """Hand ``message`` to the launcher (NOTE [Input errors on the ranks]); ``False`` when no
    launcher waits for it (an external torchrun), and the caller should print it instead."""
    path = os.environ.get(ERROR_MARKER_ENV)
    if not path:
        return False
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


def read_error(path: str) -> str | None:
    """The message a rank reported at ``path``, or ``None`` when none did."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None
