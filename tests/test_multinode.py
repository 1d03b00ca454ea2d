"""Two torchrun agents on one host as two "nodes" (c10d rendezvous): hybrid_shard shards within
a node and replicates across nodes; its checkpoint resumes on one node with another world size."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from harness import run_command
from test_app_cli import records

# launches torchrun agents as subprocesses: the top of the test pyramid
pytestmark = pytest.mark.e2e

TRAIN = [
    *["train", "--model", "tiny", "--max-steps", "8", "--seq-len", "32"],
    *["--batch-size", "8", "--warmup-steps", "2", "--log-every", "1"],
    *["--eval-every", "0", "--sample-tokens", "0", "--timeout", "120"],
    "--no-progress",
]
DEADLINE_S = 240.0


def _free_port() -> int:
    with socket.socket() as s:  # the kernel picks a free port; the rendezvous takes it next
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    return env


def _two_nodes(args: list[str], logs: Path) -> list[tuple[int, str]]:
    """Run ``fullshard ARGS`` on two agents x 2 ranks; (status, output) per agent."""
    port = _free_port()
    cmd = [
        sys.executable,
        *["-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2"],
        *["--rdzv-backend", "c10d", "--rdzv-endpoint"],
        f"127.0.0.1:{port}",
        "--rdzv-id",
        f"fullshard-test-{port}",
        "-m",
        "fullshard.app.cli",
        *args,
    ]
    procs: list[subprocess.Popen[bytes]] = []
    paths = [logs / f"node{i}.txt" for i in range(2)]
    try:
        for path in paths:
            with path.open("wb") as out:
                procs.append(
                    subprocess.Popen(
                        cmd,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env=_env(),
                        start_new_session=True,
                    )
                )
        statuses = [p.wait(timeout=DEADLINE_S) for p in procs]
    finally:
        for p in procs:  # a hung agent (and its ranks) must not outlive the test
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return [(s, path.read_text()) for s, path in zip(statuses, paths, strict=True)]


def test_hybrid_shard_on_two_nodes_then_resume_on_one(tmp_path: Path) -> None:
    run = tmp_path / "multi"
    out = ["--runs-dir", str(tmp_path), "--name", "multi"]
    nodes = _two_nodes([*TRAIN, *out, "--strategy", "hybrid_shard", "--stop-after", "4"], tmp_path)
    text = "\n".join(t for _, t in nodes)
    assert [s for s, _ in nodes] == [0, 0], text
    # one shard group per node (the node's 2 ranks), replicated across the 2 nodes
    assert "4 ranks (gloo), hybrid_shard over mesh (2, 2)" in text, text
    assert "stopped after step 4" in text
    assert sorted(os.listdir(run / "checkpoints")) == ["step_00000004"]

    # The same run resumed on one node of 2 ranks: the data is split another way on another
    # world size (not bit-exact), but it continues from step 4 and finishes.
    proc = run_command(
        [
            sys.executable,
            "-m",
            "fullshard.app.cli",
            *TRAIN,
            *out,
            *["--nproc", "2", "--strategy", "full_shard", "--resume", "latest"],
        ],
        deadline_s=DEADLINE_S,
        what="resume on one node",
        env=_env(),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resumed from step 4" in proc.stdout and "2 ranks (gloo)" in proc.stdout
    recs = records(run)
    assert [r["step"] for r in recs] == list(range(1, 9))
    assert all(math.isfinite(r["loss"]) for r in recs)
    assert recs[-1]["loss"] < recs[0]["loss"]
    assert sorted(os.listdir(run / "checkpoints"))[-1] == "step_00000008"
