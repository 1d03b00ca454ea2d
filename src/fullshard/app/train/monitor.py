"""What a user sees of a run: per-rank memory, the metrics log and its lines, the progress bar,
the loss plot, the run folder."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, TextIO

import torch

from fullshard.comm import control
from fullshard.observe.plot import CLI_EXTRA, pyplot  # matplotlib, when installed
from fullshard.observe.rss import rss_bytes  # the one resident-set reader

__all__ = [
    "MetricsLog",
    "format_mem",
    "gather_memory",
    "log_line",
    "make_run_dir",
    "plot_losses",
    "progress_bar",
    "record",
    "rss_bytes",
]


def gather_memory(device: torch.device) -> dict[str, list[float]]:
    """Every rank's memory in MiB, gathered with one tiny all_gather (a collective: call on all).

    Returns ``{"rss_mib": [...]}`` and, on CUDA, ``{"cuda_peak_mib": [...]}``, indexed by rank.
    Reads the result on the host (a synchronisation): call it on logged steps only.
    """
    values = [rss_bytes() / 2**20]
    if device.type == "cuda":
        values.append(torch.cuda.max_memory_allocated(device) / 2**20)
    table = control.all_gather_values(values, what="memory all-gather").tolist()
    result = {"rss_mib": [round(row[0], 1) for row in table]}
    if device.type == "cuda":
        result["cuda_peak_mib"] = [round(row[1], 1) for row in table]
    return result


def format_mem(mem: dict[str, list[float]]) -> str:
    """Compact per-rank memory for the progress bar, e.g. ``r0 312M r1 309M``."""
    key = "cuda_peak_mib" if "cuda_peak_mib" in mem else "rss_mib"
    return " ".join(f"r{i} {v:.0f}M" for i, v in enumerate(mem[key]))


def make_run_dir(runs_dir: str, name: str | None) -> Path:
    """Create ``runs_dir/name`` (default name: a timestamp, made unique if taken)."""
    base = Path(runs_dir)
    if name is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path, i = base / stamp, 1
        while path.exists():
            path, i = base / f"{stamp}-{i}", i + 1
    else:
        path = base / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def progress_bar(total: int, initial: int, enabled: bool, file: TextIO | None = None) -> Any:
    """The rank-0 progress bar, or ``None`` when ``enabled`` is false (or tqdm, an optional
    extra, is not installed: the plain log lines are printed instead).

    ``disable=None`` is tqdm's "only on a terminal": redirected to a log file (or under a
    launcher that pipes it), a bar would write one line per update; the plain log lines of
    :func:`log_line` say the same on each logged step instead.
    """
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # an optional extra: the plain log lines say the same
        print(f"fullshard: no progress bar: tqdm is not installed ({CLI_EXTRA})", flush=True)
        return None
    return tqdm(
        total=total, initial=initial, unit="step", dynamic_ncols=True, disable=None, file=file
    )


def log_line(step: int, total: int, loss: float, tok_s: float, mem: str) -> str:
    """One logged step as plain text (what the progress bar shows, for logs and pipes)."""
    return f"step {step}/{total}: loss {loss:.4f} | {tok_s:,.0f} tok/s | mem {mem}"


def record(
    step: int,
    loss: float,
    lr: Any,  # what the scheduler holds: a float (a tensor for capturable optimizers)
    grad_norm: float,
    tok_s: float,
    elapsed: float,
    mem: dict[str, Any],
    val_loss: float | None,
) -> dict[str, Any]:
    """One logged step's line of metrics.jsonl."""
    line: dict[str, Any] = {
        "step": step,
        "loss": round(loss, 5),
        "lr": lr,
        "grad_norm": round(grad_norm, 5),
        "tokens_per_s": round(tok_s, 1),
        "elapsed_s": round(elapsed, 2),
        "mem_mib": mem["rss_mib"],
    }
    if "cuda_peak_mib" in mem:
        line["cuda_peak_mib"] = mem["cuda_peak_mib"]
    if val_loss is not None:
        line["val_loss"] = round(val_loss, 5)
    return line


class MetricsLog:
    """``metrics.jsonl``: one JSON object per logged step, flushed at once (tail -f works)."""

    def __init__(self, path: Path, *, append: bool = False) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = []
        if append and path.is_file():  # a resumed run continues its log (and its loss curve)
            lines = path.read_text(encoding="utf-8").splitlines()
            self.records = [json.loads(line) for line in lines if line.strip()]
        self._file = path.open("a" if append else "w", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def plot_losses(records: list[dict[str, Any]], path: Path, title: str) -> None:
    """Train (and validation) loss against step, saved as a PNG; without matplotlib (an optional
    extra) one line says how to get it and nothing is drawn."""
    plt = pyplot(path.name)
    if plt is None:
        return
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train, strict=True), label="train")
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
