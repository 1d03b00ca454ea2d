"""Launching ranks and joining the process group.

``fullshard train --nproc N`` re-invokes itself through ``torch.distributed.run`` (torchrun) with
the same arguments; under torchrun (ours or an external ``torchrun --nnodes ...``) the environment
variables ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT`` say who we are,
and the same code path runs.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.rendezvous import rendezvous

__all__ = [
    "DistInfo",
    "init_distributed",
    "launch_local",
    "leave_together",
    "rank_session",
    "under_torchrun",
    "world_size_from_env",
]


@dataclass(frozen=True)
class DistInfo:
    """Who this process is in the job, and where it computes."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def under_torchrun() -> bool:
    """True when a launcher already set this process's rank and world size."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def world_size_from_env(default: int) -> int:
    """The job's world size: torchrun's ``WORLD_SIZE``, else what we are about to launch."""
    return int(os.environ["WORLD_SIZE"]) if under_torchrun() else default


def launch_local(
    nproc: int,
    argv: list[str],
    *,
    max_restarts: int = 0,
    module: str = "fullshard.app.cli",
    env: dict[str, str] | None = None,
    timeout_s: float | None = None,
) -> int:
    """Run ``python -m <module> <argv>`` on ``nproc`` local ranks through torch.distributed.run.

    Returns the launcher's exit status (non-zero when any rank failed; torchrun then stops the
    others rather than letting them wait for a dead peer). With ``timeout_s`` the launcher runs
    in its own session, and on timeout it and its ranks are ended together (status 124).
    """
    env = dict(os.environ if env is None else env)
    # Local CPU runs talk over loopback; without this gloo may pick an interface that does not
    # route to itself (containers, VPNs).
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # Set it ourselves so torchrun does not print its OMP_NUM_THREADS warning; the drivers set
    # torch's thread count from --threads anyway.
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        "-m",
        module,
        *argv,
    ]
    proc = subprocess.Popen(cmd, env=env, start_new_session=timeout_s is not None)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        print(f"fullshard: launch timed out after {timeout_s:.0f} s: {argv}", file=sys.stderr)
        return 124


def init_distributed(device_pref: str, timeout_s: float) -> DistInfo:
    """Join the process group torchrun describes: NCCL, one GPU per rank, or gloo on CPU.

    ``timeout_s`` bounds every collective wait, so a dead or stuck peer fails the run instead of
    hanging it.
    """
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device_pref == "cuda" or (device_pref == "auto" and torch.cuda.is_available())
    if use_cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        store, _, _ = next(rendezvous("env://", rank, world_size, timeout=timeout))
        # A restarted attempt (torchrun --max-restarts) may reach a store that still holds the
        # previous attempt's keys; gloo then dialled the dead ranks' addresses (seen as
        # "connection refused", and as a hang when another process had taken the port). Keys of
        # our own, per attempt, cannot be stale.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(
            backend=backend,
            store=dist.PrefixStore(f"fullshard/attempt_{attempt}", store),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
    return DistInfo(rank, world_size, local_rank, device, backend)


def leave_together() -> None:
    """NOTE [Leaving together]: call on every rank just before the process group goes.

    A rank that tears down its gloo connections while a peer still works (writing plots, files)
    aborted on its way out ("terminate called without an active exception") about half the time
    under load; so did process-group handles left in reference cycles to interpreter shutdown.
    Collect those cycles now, then wait for every rank.
    """
    gc.collect()
    dist.barrier()


@contextlib.contextmanager
def rank_session(device_pref: str, timeout_s: float) -> Iterator[DistInfo]:
    """Join the process group for one rank's work, and leave it together with the others."""
    info = init_distributed(device_pref, timeout_s)
    try:
        yield info
        leave_together()
    finally:
        dist.destroy_process_group()
