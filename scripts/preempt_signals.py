"""The stop signals, as clusters send them (issue 36): SIGTERM, SIGUSR1 and SIGINT, each sent to
the whole process group (``timeout``, a terminal's Ctrl-C, a scheduler that signals every task)
and to the ``fullshard train`` process alone, under ``--nproc`` and under ``--elastic``.

    python scripts/preempt_signals.py [--nproc 2] [--model tiny] [--after-step 2]

Each run starts in its own session (``setsid``), is signalled once its metrics log shows step
``--after-step``, and is waited for. One line per run: the exit status (75: stopped with a
checkpoint), the step of the checkpoint(s) it left and whether ``fullshard.checkpoint.verify``
finds them complete, whether any traceback or "died unexpectedly" was printed, and the output's
last lines. Saves every row to ``--out`` (default runs/preempt_signals.json).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
for _key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "FULLSHARD_FAULT"):
    ENV.pop(_key, None)
DEADLINE_S = 180.0


def _logged_step(run: Path) -> int:
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    steps = [json.loads(ln)["step"] for ln in lines if ln.strip().endswith("}")]
    return max(steps, default=0)


def _one(
    work: Path, name: str, cmd: list[str], sig: signal.Signals, group: bool, after: int
) -> dict[str, Any]:
    from fullshard.checkpoint import verify

    run = work / name
    log = work / f"{name}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*cmd, "--runs-dir", str(work), "--name", name],
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            env=ENV,
            start_new_session=True,
        )
        deadline = time.monotonic() + DEADLINE_S
        while _logged_step(run) < after and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        sent_at = _logged_step(run)
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        try:
            status = proc.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            status = proc.wait()
    text = log.read_text()
    ckpts = sorted(p.name for p in (run / "checkpoints").glob("step_*")) if run.exists() else []
    complete = [verify(str(run / "checkpoints" / c)) == "" for c in ckpts]
    return {
        "name": name,
        "signal": sig.name,
        "to": "group" if group else "launcher",
        "signalled_after_logged_step": sent_at,
        "status": status,
        "checkpoints": ckpts,
        "complete": complete,
        "traceback": "Traceback" in text,
        "died_unexpectedly": "died unexpectedly" in text,
        "last_lines": text.strip().splitlines()[-3:],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--after-step", type=int, default=2)
    ap.add_argument("--out", default="runs/preempt_signals.json")
    a = ap.parse_args()
    train = [
        sys.executable,
        "-m",
        "fullshard.app.cli",
        "train",
        "--model",
        a.model,
        *["--max-steps", "400", "--seq-len", "32", "--batch-size", "8"],
        *["--micro-batch-size", "2", "--log-every", "1", "--eval-every", "0"],
        *["--sample-tokens", "0", "--no-progress", "--timeout", "120"],
        "--nproc",
        str(a.nproc),
    ]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for mode, extra in (("nproc", []), ("elastic", ["--elastic"])):
            for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
                for group in (True, False):
                    name = f"{mode}-{sig.name}-{'group' if group else 'launcher'}"
                    r = _one(work, name, [*train, *extra], sig, group, a.after_step)
                    rows.append(r)
                    print(
                        f"{name}: status {r['status']}, checkpoints {r['checkpoints']} complete "
                        f"{r['complete']}, traceback {r['traceback']}, died unexpectedly "
                        f"{r['died_unexpectedly']}",
                        flush=True,
                    )
                    for line in r["last_lines"]:
                        print(f"    {line}", flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
