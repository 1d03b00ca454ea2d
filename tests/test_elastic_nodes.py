"""``fullshard train --elastic`` under external torchrun agents, one per node, with
``--rdzv-backend fullshard``: a lost node's peers keep their processes and go on at a smaller
world, and the node, started again with the same command, joins them at a step boundary.

(A file of its own: its fresh interpreters, torchrun's agents and workers, are the suite's
slowest single test, which the xdist workers then balance against the rest.)
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_elastic import COMMON, _changes, _sha, uninterrupted_sha


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.e2e
def test_under_two_torchrun_agents_a_lost_node_is_survived_and_its_restart_joins(
    tmp_path: Path,
) -> None:
    """Two agents of one rank each (one machine standing in for two nodes; one rank a node
    keeps the fresh interpreters torchrun starts to three): node 1 is lost at step 3, node 0's
    rank goes on alone and holds step 5 until the restarted node 1 (the same command again)
    asks to join; it is admitted (at a boundary, or at once if it asks while the survivor still
    decides the membership) and the run ends at world 2."""
    port, run_id = _free_port(), f"job{os.getpid()}"
    cmd = [
        sys.executable,
        *["-m", "torch.distributed.run", "--nnodes", "1:2"],
        *["--nproc-per-node", "1", "--rdzv-backend", "fullshard"],
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        run_id,
        "-m",
        "fullshard.app.cli",
        "train",
        *COMMON,
        "--elastic",
        "--timeout",
        "60",
        "--runs-dir",
        str(tmp_path),
        "--name",
        "nodes",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update({"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"})
    fault = {**env, "FULLSHARD_FAULT": "node:rank=1:step=3+hold:rank=0:step=5"}
    out = tmp_path / "logs"
    out.mkdir()

    def agent(name: str, agent_env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = (out / f"{name}.log").open("wb")
        return subprocess.Popen(cmd, env=agent_env, stdout=log, stderr=subprocess.STDOUT)

    node0 = agent("node0", fault)
    time.sleep(1.0)  # node 0's agent hosts the rendezvous, and is group rank 0
    node1 = agent("node1", fault)
    restarted = None
    try:
        assert node1.wait(timeout=180) == -signal.SIGKILL  # the whole node, its agent too
        restarted = agent("node1-restarted", env)
        # (a failed agent leaves the other in torchrun's exit barrier: read the first to end)
        deadline = time.monotonic() + 180
        while node0.poll() is None and restarted.poll() is None:
            assert time.monotonic() < deadline, "the agents did not finish"
            time.sleep(0.2)
        for p, name in ((restarted, "node1-restarted"), (node0, "node0")):
            assert p.wait(timeout=60) == 0, (out / f"{name}.log").read_text()
    finally:
        for p in (node0, node1, restarted):
            if p is not None and p.poll() is None:
                p.kill()
    summary = json.loads((tmp_path / "nodes" / "summary.json").read_text())
    assert summary["process_restarts"] == 0
    changes = _changes(summary)
    # Two histories are valid, and which one happens depends on when the restarted node asks:
    # after the recovery (the survivor goes on alone, then admits it at a boundary), or while
    # the survivor is still deciding the next membership (it takes the lost slot at once)
    assert changes and {k: changes[0][k] for k in ("step", "reason", "ranks_lost")} == {
        "step": 2,
        "reason": "loss",
        "ranks_lost": [1],
    }, changes
    if changes[0]["world_size"] == 1:
        assert changes[0]["ranks_joined"] == [] and len(changes) == 2, changes
        assert {k: changes[1][k] for k in ("reason", "world_size", "ranks_joined")} == {
            "reason": "join",
            "world_size": 2,
            "ranks_joined": [1],
        }
    else:
        assert (changes[0]["world_size"], changes[0]["ranks_joined"], len(changes)) == (
            2,
            [1],
            1,
        ), changes
    pids = summary["pids"]  # node 0's rank kept its process; node 1's is a new one
    assert pids[0] == summary["pids_at_start"][0] and pids[1] != summary["pids_at_start"][1]
    ckpt = tmp_path / "nodes" / "checkpoints" / "step_00000008"
    assert _sha(ckpt, tmp_path / "nodes.safetensors") == uninterrupted_sha(tmp_path / "one")
