"""The ``--elastic`` drill (issue 20): a rank SIGKILLed mid-run, recovered in memory, against the
same run restarted by torchrun from its disk checkpoint, and the steady-state cost of
``--elastic``; every run on the same model and data, one after another on this machine.

    python scripts/elastic_drill.py [--nproc 4] [--steps 12] [--kill-step 6]

Prints one line per run and saves the figures to ``--out`` (default runs/elastic_drill.json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _train(work: Path, name: str, args: list[str], fault: str = "") -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    env["FULLSHARD_FAULT"] = fault
    cmd = [sys.executable, "-m", "fullshard.app.cli", "train", *args, "--runs-dir", str(work)]
    t0 = time.perf_counter()
    proc = subprocess.run([*cmd, "--name", name], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    summary = json.loads((work / name / "summary.json").read_text())
    return {"name": name, "wall_s": round(wall, 2), **summary}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--kill-step", type=int, default=6)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--out", default="runs/elastic_drill.json")
    a = ap.parse_args()
    common = [
        "--model", a.model, "--max-steps", str(a.steps), "--batch-size", "16",
        "--micro-batch-size", "2", "--seq-len", "64", "--sample-tokens", "0", "--no-progress",
        "--log-every", "1", "--eval-every", "0", "--deterministic", "--nproc", str(a.nproc),
        "--timeout", "60",
    ]  # fmt: skip
    kill = f"kill:rank=2:step={a.kill_step}"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        # steady state: the same run with and without --elastic (every step copied)
        rows.append(_train(work, "default", common))
        rows.append(_train(work, "elastic", [*common, "--elastic"]))
        # a rank lost at --kill-step: recovered in memory, or torchrun restarts every rank
        # from the newest checkpoint (saved every step: the least it can replay)
        rows.append(_train(work, "elastic-killed", [*common, "--elastic"], kill))
        restart = [*common, "--max-restarts", "1", "--save-every", "1"]
        rows.append(_train(work, "restart-killed", restart, kill))
    base = {r["name"]: r for r in rows}
    for r in rows:
        extra = ""
        if r["name"].endswith("killed"):
            twin = base["elastic" if r["name"].startswith("elastic") else "default"]
            r["lost_s"] = round(r["wall_s"] - twin["wall_s"], 2)
            extra = f", {r['lost_s']:+.2f} s against the same run without the loss"
        if r.get("membership"):
            extra += f", recovery {r['membership'][0]['recovery_s']} s (death to step redone)"
        if "elastic_copy_bytes" in r:
            extra += (
                f", ring copies {r['elastic_copy_s']} s in all, "
                f"{r['elastic_copy_bytes'] / 2**20:.2f} MiB per rank per boundary"
            )
        print(
            f"{r['name']}: {r['wall_s']} s wall, {r['train_wall_s']} s training, "
            f"{r['tokens_per_s']} tok/s, process_restarts {r['process_restarts']}{extra}",
            flush=True,
        )
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
