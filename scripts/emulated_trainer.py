"""``fullshard train`` on its CUDA code path, checked on CPU, in every configuration the engine's
emulated test runs (``tests/test_cuda_emulation_engine.py``) and the trainer's own modes, live
recovery from a rank lost in step 1 and from a hung rank included.

    python scripts/emulated_trainer.py                  # every configuration, 4 ranks
    python scripts/emulated_trainer.py --only offload,deterministic

Each run is ``FULLSHARD_CUDA_EMULATION=1 fullshard train`` (``fullshard.testing.cuda_emulation``:
virtual streams and events, the ordering checker, NOTE [Kernel contracts], the host
synchronisation counter). A run passes when it exits 0 (no ordering error, no broken kernel
contract), every quiet step (not the first, not a logged one, not the last) counts the
synchronisations the configuration accepts (0; CPU offload: 2, the offloaded gradients and the
step's verdict), and torch filled no new tensor (deterministic mode). The table and every run's
counts are printed and saved to ``--out`` (JSON).
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

COMMON = [
    *["--model", "tiny", "--seq-len", "64", "--batch-size", "16"],
    *["--max-steps", "6", "--log-every", "6", "--eval-every", "0"],
    *["--sample-tokens", "0", "--no-progress", "--timeout", "120"],
]

# name -> (flags, host synchronisations a quiet step may count)
CONFIGS: dict[str, tuple[list[str], int]] = {
    "full_shard": ([], 0),
    "shard_grad_op": (["--strategy", "shard_grad_op"], 0),
    "reshard_to_2": (["--reshard-after-forward", "2"], 0),
    "hybrid_shard": (["--strategy", "hybrid_shard", "--shard-size", "2"], 0),
    "bf16": (["--mixed-precision", "bf16"], 0),
    "fp16": (["--mixed-precision", "fp16"], 0),
    "offload": (["--cpu-offload"], 2),
    "offload_bf16": (["--cpu-offload", "--mixed-precision", "bf16"], 2),
    "grad_accum": (["--grad-accum", "2"], 0),
    "hybrid_accum": (["--strategy", "hybrid_shard", "--shard-size", "2", "--grad-accum", "2"], 0),
    "deterministic": (["--deterministic", "--micro-batch-size", "2"], 0),
    "deterministic_bf16": (
        ["--deterministic", "--micro-batch-size", "2", "--mixed-precision", "bf16"],
        0,
    ),
    "elastic": (["--elastic", "--deterministic", "--micro-batch-size", "2"], 0),
    # live recovery's mechanisms on the CUDA path (FAULTS): a loss in step 1, a hung rank fenced
    "elastic_step1": (["--elastic", "--deterministic", "--micro-batch-size", "2"], 0),
    "elastic_hang": (
        ["--elastic", "--deterministic", "--micro-batch-size", "2", "--timeout", "24"],
        0,
    ),
}
# name -> FULLSHARD_FAULT; the step a fault hits and the first step replayed after it are not
# quiet (the recovery and the rebuilt model's lazy init run there)
FAULTS = {"elastic_step1": "kill:rank=3:step=1", "elastic_hang": "hang:rank=2:step=3"}


def run(name: str, nproc: int, work: Path) -> dict[str, Any]:
    flags, accepted = CONFIGS[name]
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        "OMP_NUM_THREADS": "1",
        "FULLSHARD_CUDA_EMULATION": "1",
        "FULLSHARD_FAULT": FAULTS.get(name, ""),
    }
    cmd = [sys.executable, "-m", "fullshard.app.cli", "train", *COMMON, "--nproc", str(nproc)]
    cmd += [*flags, "--runs-dir", str(work), "--name", name]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    out: dict[str, Any] = {"flags": flags, "accepted": accepted, "status": proc.returncode}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    if proc.returncode != 0:
        lines = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        # the error itself (an ordering error, a kernel contract), else the output's end
        errors = [ln for ln in lines if "Error: " in ln and not ln.startswith(" ")]
        out["error"] = " | ".join(line[:400] for line in (errors[:1] or lines[-2:]))
        out["ok"] = False
        return out
    summary = json.loads((work / name / "summary.json").read_text())
    syncs = {int(k): v for k, v in summary["host_syncs_per_step"].items()}
    last = max(syncs)
    loud = {1, last}  # (log-every = the last step)
    if name in FAULTS:
        loud.add(int(FAULTS[name].split("step=")[1].split(":")[0]))
        loud |= {c["step"] for c in summary.get("membership", [])}
    quiet = {s: n for s, n in syncs.items() if s not in loud}
    out.update(syncs=syncs, quiet=sorted(set(quiet.values())), filled=summary["filled_bytes"])
    out["ok"] = set(quiet.values()) == {accepted} and summary["filled_bytes"] == 0
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated configurations")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--out", default="docs/bench/emulated_trainer.json")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(CONFIGS)
    results = {}
    with tempfile.TemporaryDirectory(prefix="fullshard-emulated-") as tmp:
        for name in names:
            r = results[name] = run(name, args.nproc, Path(tmp))
            detail = r.get("error") or (
                f"quiet steps {r['quiet']} (accepted {r['accepted']}), all {r['syncs']}, "
                f"filled {r['filled']} bytes"
            )
            print(
                f"{'PASS' if r['ok'] else 'FAIL'}  {name}: {detail} ({r['seconds']} s)", flush=True
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"nproc": args.nproc, "runs": results}, indent=2) + "\n")
    print(f"{sum(r['ok'] for r in results.values())} of {len(results)} passed; {args.out}")
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
