"""The loss curves of several ``fullshard train`` runs in one figure, and their figures.

Reads each run folder's ``metrics.jsonl`` (what ``fullshard train`` writes), draws train loss
(a line) and validation loss (points) against step, one colour per run, and prints and saves
(``--json``) each run's first and last train loss, its last and best validation loss, its
median tokens/s and its training time.

    python scripts/compare_losses.py runs/adamw runs/muon --out docs/optimizers_loss.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from fullshard.observe.plot import pyplot


def _records(run: Path) -> list[dict[str, Any]]:
    lines = (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    train = [r for r in records if "loss" in r]
    val = [r for r in records if "val_loss" in r]
    out: dict[str, Any] = {"steps": train[-1]["step"] if train else 0}
    if train:
        out["first_loss"], out["last_loss"] = train[0]["loss"], train[-1]["loss"]
    if val:
        out["last_val_loss"] = val[-1]["val_loss"]
        out["best_val_loss"] = min(r["val_loss"] for r in val)
    speeds = [r["tokens_per_s"] for r in train if "tokens_per_s" in r]
    if speeds:
        out["median_tokens_per_s"] = statistics.median(speeds)
    if train and "elapsed_s" in train[-1]:
        out["elapsed_s"] = train[-1]["elapsed_s"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run folders (each with metrics.jsonl)")
    ap.add_argument("--out", type=Path, required=True, help="the PNG to write")
    ap.add_argument("--json", type=Path, default=None, help="the figures, as JSON")
    ap.add_argument("--title", default="")
    args = ap.parse_args()
    runs = {run.name: _records(run) for run in args.runs}
    figures = {name: summary(records) for name, records in runs.items()}
    for name, fig in figures.items():
        print(name, json.dumps(fig))
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1) + "\n", encoding="utf-8")
    plt = pyplot(args.out.name)
    if plt is None:
        return 1
    fig, ax = plt.subplots(figsize=(7, 4))
    for k, (name, records) in enumerate(runs.items()):
        color = f"C{k}"
        train = [(r["step"], r["loss"]) for r in records if "loss" in r]
        val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
        if train:
            ax.plot(*zip(*train, strict=True), color=color, alpha=0.8, label=f"{name} train")
        if val:
            ax.plot(*zip(*val, strict=True), "o--", color=color, label=f"{name} validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(args.title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    plt.close(fig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
