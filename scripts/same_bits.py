"""The same bits at any world size: ``fullshard train --deterministic`` across world sizes,
strategies and precisions, and stopped at N ranks then resumed at M, compared by the sha256 of
the exported safetensors (``fullshard convert``).

    python scripts/same_bits.py                       # 1, 2, 4, 8 ranks; fp32 and bf16
    python scripts/same_bits.py --worlds 1,2,4 --precisions none

Every run trains the same model on the same data for ``--steps`` steps with one global batch
and micro-batch size; each precision's runs must all give one sha256 (exit status 1 if not).
The default mode is run at the first two world sizes too, for contrast: its ranks read
different slices of the text, so its weights differ with the world size. The table and every
run's figures are printed and saved to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "fullshard.app.cli", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(
            f"failed ({proc.returncode}): {' '.join(args)}\n{proc.stdout}{proc.stderr}"
        )
    return proc


def _sha(run: Path, step: int, work: Path) -> str:
    out = work / f"{run.name}.safetensors"
    _cli("convert", str(run / "checkpoints" / f"step_{step:08d}"), str(out))
    return hashlib.sha256(out.read_bytes()).hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--worlds", default="1,2,4,8", help="world sizes (powers of two)")
    ap.add_argument("--strategies", default="full_shard,shard_grad_op,hybrid_shard,no_shard")
    ap.add_argument("--precisions", default="none,bf16", help="--mixed-precision values")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--out", default="runs/same_bits.json")
    args = ap.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    common = [
        "--model",
        args.model,
        "--max-steps",
        str(args.steps),
        "--batch-size",
        str(args.batch_size),
        "--seq-len",
        str(args.seq_len),
        *["--sample-tokens", "0", "--no-progress", "--log-every", "1", "--eval-every", "0"],
    ]
    fixed = ["--deterministic", "--micro-batch-size", str(args.micro_batch_size)]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)

        def train(name: str, *extra: str) -> tuple[Path, float]:
            t0 = time.perf_counter()
            _cli("train", *common, "--runs-dir", str(work), "--name", name, *extra)
            return work / name, time.perf_counter() - t0

        for precision in args.precisions.split(","):
            for strategy in args.strategies.split(","):
                for world in worlds:
                    if strategy.startswith("hybrid") and world < 4:
                        continue  # a hybrid mesh of 2 x 2 or more
                    if strategy == "no_shard" and world == 1:
                        continue
                    name = f"{precision}-{strategy}-{world}"
                    # hybrid: shard groups of 2, so 8 ranks are 4 replicas (the all-reduce's
                    # tree over replicas has more than one level)
                    hybrid = ["--shard-size", "2"] if strategy.startswith("hybrid") else []
                    run, wall = train(
                        name,
                        *fixed,
                        "--strategy",
                        strategy,
                        "--nproc",
                        str(world),
                        "--mixed-precision",
                        precision,
                        *hybrid,
                    )
                    rows.append(
                        {
                            "precision": precision,
                            "strategy": strategy,
                            "world": world,
                            "mode": "deterministic",
                            "sha256": _sha(run, args.steps, work),
                            "wall_s": round(wall, 1),
                        }
                    )
                    print(_line(rows[-1]), flush=True)
            # stopped at N ranks, resumed at M: equal to the uninterrupted runs above
            for a, b in ((4, 2), (2, 4)):
                if a not in worlds or b not in worlds:
                    continue
                name = f"{precision}-resume-{a}to{b}"
                extra = (*fixed, "--mixed-precision", precision, "--save-every", "2")
                train(name, *extra, "--nproc", str(a), "--stop-after", str(args.steps // 2))
                run, wall = train(name, *extra, "--nproc", str(b), "--resume", "latest")
                rows.append(
                    {
                        "precision": precision,
                        "strategy": "full_shard",
                        "world": f"{a}->{b}",
                        "mode": "deterministic, resumed",
                        "sha256": _sha(run, args.steps, work),
                        "wall_s": round(wall, 1),
                    }
                )
                print(_line(rows[-1]), flush=True)
            for world in worlds[:2]:  # the default mode, for contrast
                name = f"{precision}-default-{world}"
                run, wall = train(name, "--nproc", str(world), "--mixed-precision", precision)
                rows.append(
                    {
                        "precision": precision,
                        "strategy": "full_shard",
                        "world": world,
                        "mode": "default",
                        "sha256": _sha(run, args.steps, work),
                        "wall_s": round(wall, 1),
                    }
                )
                print(_line(rows[-1]), flush=True)
    ok = True
    print()
    for precision in args.precisions.split(","):
        mine = [r for r in rows if r["precision"] == precision and r["mode"] != "default"]
        shas = {r["sha256"] for r in mine}
        same = len(shas) == 1
        ok = ok and same
        print(
            f"{'PASS' if same else 'FAIL'}  --mixed-precision {precision}: {len(mine)} "
            f"deterministic runs, {len(shas)} distinct sha256"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "runs": rows}, indent=2) + "\n")
    print(f"saved {out}")
    return 0 if ok else 1


def _line(r: dict[str, Any]) -> str:
    return (
        f"{r['mode']:<24} {r['precision']:<5} {r['strategy']:<14} world {r['world']!s:<5} "
        f"sha256 {r['sha256'][:16]}  ({r['wall_s']} s)"
    )


if __name__ == "__main__":
    sys.exit(main())
