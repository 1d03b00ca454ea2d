"""This process's resident set: the one reader every report uses (trainer, bench, plan --check).

On Linux the figures come from ``/proc/self/status`` (``VmRSS``: now; ``VmHWM``: the peak since
start or since :func:`reset_peak_rss`). Elsewhere only ``getrusage``'s peak exists
(``ru_maxrss``: kibibytes on Linux, bytes on macOS), and it stands in for both.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

__all__ = ["peak_rss_bytes", "reset_peak_rss", "rss_bytes"]

_STATUS = Path("/proc/self/status")


def _status_bytes(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` in bytes; ``None`` where there is none."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _rusage_peak_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def rss_bytes() -> int:
    """The resident set now, in bytes (without ``/proc``: the peak so far)."""
    now = _status_bytes("VmRSS")
    return now if now is not None else _rusage_peak_bytes()


def peak_rss_bytes() -> int:
    """The peak resident set in bytes, since start or since the last :func:`reset_peak_rss`."""
    peak = _status_bytes("VmHWM")
    return peak if peak is not None else _rusage_peak_bytes()


def reset_peak_rss() -> bool:
    """Reset the kernel's peak mark (``VmHWM``) to the current resident set; ``False`` where
    that is not supported (then :func:`peak_rss_bytes` keeps counting from the start)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True
