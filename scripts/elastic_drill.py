"""The ``--elastic`` drills (issue 20), each against the uninterrupted run, one after another on
this machine, on the same model and data:

- rank 2 SIGKILLed at ``--kill-step``, recovered in memory (a replacement joins), and the same
  run restarted by torchrun from its disk checkpoint (saved every step) instead;
- rank 0 killed; two failures in one run; HSDP losing a replica;
- a node lost under two torchrun agents (``--rdzv-backend fullshard``): the other node goes on
  at half the world until the node, started again, joins;
- ring neighbours lost together: the job ends with a message naming the newest checkpoint;
- issue 36: a rank lost in step 1 (``step1``), a hung rank (``hang``: alive, heartbeat beating),
  a rank frozen past its fencing that wakes later (``zombie``), a rank lost while the others
  recover from another loss (``during``);
- issue 43, with ``--timeout 30 --save-every 4`` as the issue ran them: rank 0 lost once a
  checkpoint's ``.metadata`` is written, before the commit (``commit``); rank 1 lost in the final
  save (``final``); rank 2 lost, then rank 0 the instant the next generation is written
  (``restore``); the same slot lost three times, one more than the replacements (``slot``); the
  launcher killed (``launcher``: the ranks stop with a checkpoint, and the command they print
  resumes it); a disk that fills (``disk``: a tmpfs holding two checkpoints where this process
  may mount one, else a write failing with ENOSPC; resumed after the oldest checkpoint is
  deleted, with ``--keep 1``);
- the steady-state cost of ``--elastic`` (step time, memory), runs alternated with the default.

    python scripts/elastic_drill.py [--nproc 4] [--steps 12] [--kill-step 6] [--model tiny]

Each run's weights are compared with a one-rank uninterrupted run (``--deterministic``: the same
bits at any world size) by the sha256 of ``fullshard convert``'s safetensors. Prints one line per
run and saves every figure to ``--out`` (default runs/elastic_drill.json).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
for _key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "FULLSHARD_FAULT"):
    ENV.pop(_key, None)


def _sha(work: Path, name: str, steps: int, folder: str | None = None) -> str:
    out = work / f"{name}.safetensors"
    ckpt = Path(folder or work / name / "checkpoints") / f"step_{steps:08d}"
    cmd = [sys.executable, "-m", "fullshard.app.cli", "convert", str(ckpt), str(out)]
    subprocess.run(cmd, env=ENV, check=True, capture_output=True)
    return hashlib.sha256(out.read_bytes()).hexdigest()


def _peak_mib(work: Path, name: str) -> float:
    """The largest per-rank resident set any logged step recorded (metrics.jsonl)."""
    peaks = [0.0]
    for line in (work / name / "metrics.jsonl").read_text().splitlines():
        peaks += [float(v) for v in json.loads(line)["mem_mib"]]
    return max(peaks)


def _row(
    work: Path, name: str, proc: Any, wall: float, steps: int, folder: str | None = None
) -> dict[str, Any]:
    row: dict[str, Any] = {"name": name, "status": proc.returncode, "wall_s": round(wall, 2)}
    summary_file = work / name / "summary.json"
    if summary_file.exists():
        summary = json.loads(summary_file.read_text())
        row.update(summary)
        last = Path(folder or work / name / "checkpoints") / f"step_{steps:08d}"
        if last.is_dir():
            row["sha256"] = _sha(work, name, steps, folder)
        row["peak_rss_mib"] = _peak_mib(work, name)
    return row


def _train(work: Path, name: str, args: list[str], fault: str = "") -> dict[str, Any]:
    cmd = [sys.executable, "-m", "fullshard.app.cli", "train", *args, "--runs-dir", str(work)]
    t0 = time.perf_counter()
    env = {**ENV, "FULLSHARD_FAULT": fault}
    # (the output ends when the last rank does: a rank outlives a launcher that was killed)
    proc = subprocess.run([*cmd, "--name", name], env=env, capture_output=True, text=True)
    folder = args[args.index("--checkpoint-dir") + 1] if "--checkpoint-dir" in args else None
    steps = int(args[args.index("--max-steps") + 1])
    row = _row(work, name, proc, time.perf_counter() - t0, steps, folder)
    row["stderr_tail"] = proc.stderr.strip().splitlines()[-1:] if proc.stderr else []
    row["stderr_full"] = proc.stderr
    row["tracebacks"] = proc.stderr.count("Traceback")
    row["stack_lines"] = sum(ln.startswith("frame #") for ln in proc.stderr.splitlines())
    # what the faults and the launcher said of them, in order (a zombie's wake, a fencing)
    row["fault_lines"] = [
        ln
        for ln in (proc.stdout + proc.stderr).splitlines()
        if ln.startswith("[fault]") or "fenced" in ln or "member" in ln
    ]
    launcher = [ln for ln in proc.stderr.splitlines() if "are pids" in ln]
    if launcher:
        row["pids_printed"] = json.loads(launcher[0].split("are pids ")[1])
    return row


def _said(stderr: str) -> list[str]:
    """What the job told the user on stderr, besides the launcher's pids and its loss lines."""
    return [
        ln
        for ln in stderr.splitlines()
        if ln.strip() and "are pids" not in ln and "the other ranks keep running" not in ln
    ]


def _resumed(work: Path, row: dict[str, Any], command: str, steps: int, extra: list[str]) -> None:
    """Run the resume command a stopped job printed (``python -m``/``fullshard`` as this
    interpreter), and record its status and weights in ``row``."""
    argv = shlex.split(command)
    argv = argv[3:] if argv[:3] == ["python", "-m", "fullshard.app.cli"] else argv[1:]
    proc = subprocess.run(
        [sys.executable, "-m", "fullshard.app.cli", *argv, *extra],
        env=ENV,
        capture_output=True,
        text=True,
    )
    row["resume_status"] = proc.returncode
    if proc.returncode == 0:
        name = argv[argv.index("--name") + 1]
        folder = argv[argv.index("--checkpoint-dir") + 1] if "--checkpoint-dir" in argv else None
        row["sha256"] = _sha(work, name, steps, folder)


def _stopped(
    work: Path,
    name: str,
    args: list[str],
    fault: str,
    resume_extra: list[str],
    before_resume: Any = None,
) -> dict[str, Any]:
    """A drill whose job stops (its launcher killed, a full disk): what it said, then the
    command it printed, run, to the end."""
    row = _train(work, name, args, fault)
    row["said"] = _said(row.pop("stderr_full", ""))
    steps = int(args[args.index("--max-steps") + 1])
    line = next((ln for ln in row["said"] if "--resume latest" in ln), "")
    command = line.split("Resume: ")[-1].split("then resume: ")[-1]
    if command.strip():
        if before_resume is not None:
            before_resume()
        _resumed(work, row, command, steps, resume_extra)
    return row


def _disk(work: Path, args: list[str], k: int) -> dict[str, Any]:
    """A disk that fills: a tmpfs sized for two of the run's checkpoints where one can be
    mounted here (root), else rank 1's write failing as on a full disk (``diskfull``)."""
    ref = work / "reference" / "checkpoints"
    size = sum(f.stat().st_size for f in ref.rglob("*") if f.is_file())
    disk = work / "disk-tmpfs"
    disk.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", f"size={int(2.6 * 1.4 * size)}", "tmpfs", str(disk)]
    mounted = subprocess.run(mount, capture_output=True).returncode == 0
    ckpts = disk / "checkpoints"
    fault = "" if mounted else f"diskfull:rank=1:step={k}"
    try:

        def free_oldest() -> None:
            oldest = sorted(ckpts.glob("step_*"))[0] if mounted else None
            if oldest is not None:
                shutil.rmtree(oldest)

        row = _stopped(
            work,
            "disk",
            [*args, "--checkpoint-dir", str(ckpts)],
            fault,
            ["--keep", "1"],
            free_oldest,
        )
        row["tmpfs"] = mounted
        return row
    finally:
        if mounted:
            subprocess.run(["umount", str(disk)], capture_output=True)


def _two_agents(
    work: Path, name: str, args: list[str], kill_step: int, lose: int = 1
) -> dict[str, Any]:
    """Two torchrun agents of nproc/2 ranks each; node ``lose`` lost at ``kill_step`` and
    started again (node 0's agent hosts the store: losing it ends the job)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nproc = int(args[args.index("--nproc") + 1])
    rest = [a for i, a in enumerate(args) if a != "--nproc" and args[i - 1] != "--nproc"]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        str(nproc // 2),
        "--rdzv-backend",
        "fullshard",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        f"drill{os.getpid()}",
        "-m",
        "fullshard.app.cli",
        "train",
        *rest,
        "--runs-dir",
        str(work),
        "--name",
        name,
    ]
    fault = f"node:rank={lose * nproc // 2}:step={kill_step}+hold:rank=0:step={kill_step + 3}"
    env = {**ENV, "GLOO_SOCKET_IFNAME": "lo"}

    def agent(tag: str, extra: dict[str, str]) -> subprocess.Popen[bytes]:
        log = (work / f"{name}-{tag}.log").open("wb")
        return subprocess.Popen(cmd, env={**env, **extra}, stdout=log, stderr=subprocess.STDOUT)

    t0 = time.perf_counter()
    node0 = agent("node0", {"FULLSHARD_FAULT": fault})
    time.sleep(1.0)  # node 0's agent hosts the rendezvous and the workers' store
    node1 = agent("node1", {"FULLSHARD_FAULT": fault})
    lost, kept = (node1, node0) if lose == 1 else (node0, node1)
    lost.wait()
    lost_at = time.perf_counter()
    # node 0 hosted the store and the rendezvous: started again it would begin another job
    restarted = agent(f"node{lose}-restarted", {}) if lose == 1 else kept
    while kept.poll() is None and restarted.poll() is None:
        time.sleep(0.2)
    ended_s = time.perf_counter() - lost_at
    for p in (kept, restarted):
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:  # torchrun's exit barrier, after its peer failed
            p.send_signal(signal.SIGKILL)
            p.wait()
    kept.returncode = kept.returncode or restarted.returncode
    steps = int(args[args.index("--max-steps") + 1])
    row = _row(work, name, kept, time.perf_counter() - t0, steps)
    row["lost_node_status"] = lost.returncode
    row["ended_s_after_loss"] = round(ended_s, 2)
    said = [
        ln
        for ln in (work / f"{name}-node{1 - lose}.log").read_text().splitlines()
        if ln.startswith("fullshard: ")
    ]
    row["stderr_tail"] = said[-1:]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--kill-step", type=int, default=6)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--rounds", type=int, default=2, help="steady-state pairs (A B A B ...)")
    ap.add_argument(
        "--only",
        default="",
        help="comma-separated drills to run (default: all; none: only the steady-state pairs)",
    )
    ap.add_argument("--out", default="runs/elastic_drill.json")
    a = ap.parse_args()
    k, n = a.kill_step, a.nproc
    common = [
        "--model",
        a.model,
        "--max-steps",
        str(a.steps),
        *["--batch-size", "16", "--micro-batch-size", "2", "--seq-len", "64"],
        *["--sample-tokens", "0", "--no-progress", "--log-every", "1"],
        *["--eval-every", "0", "--deterministic", "--timeout", "60"],
    ]
    run = [*common, "--nproc", str(n)]
    elastic = [*run, "--elastic"]
    save = 4
    issue43 = [*elastic, "--timeout", "30", "--save-every", str(save)]
    drills = {
        "rank2": lambda w: _train(w, "rank2", elastic, f"kill:rank=2:step={k}"),
        "restart": lambda w: _train(
            w,
            "restart",
            [*run, "--max-restarts", "1", "--save-every", "1"],
            f"kill:rank=2:step={k}",
        ),
        "rank0": lambda w: _train(w, "rank0", elastic, f"kill:rank=0:step={k}"),
        "twice": lambda w: _train(
            w, "twice", elastic, f"kill:rank=2:step={k // 2}+kill:rank=1:step={k + 2}"
        ),
        "hybrid": lambda w: _train(
            w,
            "hybrid",
            [*elastic, "--strategy", "hybrid_shard", "--shard-size", str(n // 2)],
            f"kill:rank={n // 2}:step={k}",
        ),
        "nodes": lambda w: _two_agents(w, "nodes", elastic, k),
        "storehost": lambda w: _two_agents(w, "storehost", [*elastic, "--save-every", "2"], k, 0),
        "neighbours": lambda w: _train(
            w,
            "neighbours",
            [*elastic, "--save-every", "2"],
            f"kill:rank=1:step={k}+kill:rank=2:step={k}",
        ),
        # issue 36: the failures clusters have
        "step1": lambda w: _train(w, "step1", elastic, f"kill:rank={n - 1}:step=1"),
        "hang": lambda w: _train(w, "hang", [*elastic, "--timeout", "30"], f"hang:rank=2:step={k}"),
        "zombie": lambda w: _train(
            w, "zombie", [*elastic, "--timeout", "30"], f"freeze:rank=2:step={k}:secs=45"
        ),
        "during": lambda w: _train(
            w, "during", elastic, f"kill:rank=2:step={k}+kill:rank=0:step={k}:at=recovery"
        ),
        # issue 43: losses outside the step, as the issue ran them
        "commit": lambda w: _train(w, "commit", issue43, f"kill:rank=0:step={save * 2}:at=commit"),
        "final": lambda w: _train(w, "final", issue43, f"kill:rank=1:step={a.steps}:at=save"),
        "restore": lambda w: _train(
            w, "restore", issue43, f"kill:rank=2:step={k}+kill:rank=0:step={k}:at=generation"
        ),
        "slot": lambda w: _train(w, "slot", issue43, f"kill:rank=2:step={k}:again=1"),
        "launcher": lambda w: _stopped(w, "launcher", issue43, f"launcher:step={k}", []),
        "disk": lambda w: _disk(w, issue43, save * 3),
    }
    chosen = [] if a.only == "none" else [d for d in (a.only.split(",") if a.only else drills)]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ref = _train(work, "reference", [*common, "--nproc", "1"])
        print(f"reference (1 rank, uninterrupted): sha256 {ref['sha256'][:16]}...", flush=True)
        steady: dict[str, list[dict[str, Any]]] = {"default": [], "elastic": []}
        for i in range(a.rounds):  # alternated: A B A B
            steady["default"].append(_train(work, f"default{i}", run))
            steady["elastic"].append(_train(work, f"elastic{i}", elastic))
        for name in chosen:
            rows.append(drills[name](work))
    base_wall = statistics.median([r["wall_s"] for r in steady["default"]] or [0.0])
    el_wall = statistics.median([r["wall_s"] for r in steady["elastic"]] or [0.0])
    for kind, runs in steady.items() if a.rounds else ():
        print(
            f"steady {kind}: training {statistics.median(r['train_wall_s'] for r in runs)} s, "
            f"{statistics.median(r['tokens_per_s'] for r in runs)} tok/s, peak RSS "
            f"{max(r['peak_rss_mib'] for r in runs)} MiB per rank"
            + (
                f", copies {statistics.median(r['elastic_copy_s'] for r in runs)} s in all, "
                f"{runs[0]['elastic_copy_bytes'] / 2**20:.2f} MiB per rank per boundary"
                if kind == "elastic"
                else ""
            ),
            flush=True,
        )
    for r in rows:
        twin = base_wall if r["name"] == "restart" else el_wall
        r["lost_s"] = round(r["wall_s"] - twin, 2)
        same = r.get("sha256") == ref["sha256"]
        kept = None
        if r.get("pids_at_start") and r.get("pids"):
            kept = [x for x in r["pids"] if x in r["pids_at_start"]]
        changes = "; ".join(
            f"step {c['step']} {c['reason']} world {c['world_size']} lost {c['ranks_lost']} "
            f"joined {c['ranks_joined']} in {c['recovery_s']} s"
            for c in r.get("membership", [])
        )
        print(
            f"{r['name']}: status {r['status']}, {r['wall_s']} s wall ({r['lost_s']:+.2f} s "
            f"against the uninterrupted run), same bits: {same}, process_restarts "
            f"{r.get('process_restarts')}, pids kept {kept}"
            + (f", {changes}" if changes else "")
            + (
                f", ended {r['ended_s_after_loss']} s after the loss"
                if r["status"] and "ended_s_after_loss" in r
                else ""
            )
            + (f" | {r['stderr_tail'][0]}" if r["status"] != 0 and r.get("stderr_tail") else ""),
            flush=True,
        )
        if r["name"] in ("step1", "hang", "zombie", "during"):
            for line in r["fault_lines"]:
                print(f"    {line}", flush=True)
        if r["name"] in ("commit", "final", "restore", "slot", "launcher", "disk"):
            print(
                f"    tracebacks {r['tracebacks']}, C++ stack lines {r['stack_lines']}"
                + (f", resumed: status {r['resume_status']}" if "resume_status" in r else "")
                + (f", on a tmpfs: {r['tmpfs']}" if "tmpfs" in r else ""),
                flush=True,
            )
            for line in r.get("said") or _said(r.get("stderr_full", "")):
                print(f"    said: {line}", flush=True)
        r.pop("stderr_full", None)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"reference": ref, "steady": steady, "drills": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
