"""Launching ranks and joining the process group.

``fullshard train --nproc N`` re-invokes itself through ``torch.distributed.run`` (torchrun) with
the same arguments; under torchrun (ours or an external ``torchrun --nnodes ...``) the environment
variables ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT`` say who we are,
and the same code path runs.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.rendezvous import rendezvous

from fullshard.app.config import ConfigError
from fullshard.app.preempt import MARKER_ENV, PREEMPTED_EXIT, ForwardSignals, read_marker
from fullshard.comm import control
from fullshard.comm.device import cuda_usable

__all__ = [
    "BACKENDS",
    "DistInfo",
    "add_device_arguments",
    "check_devices",
    "forward_flags",
    "init_distributed",
    "launch_local",
    "leave_together",
    "rank_device",
    "rank_session",
    "resolve_backend",
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


def forward_flags(
    parser: argparse.ArgumentParser, args: argparse.Namespace, *, exclude: tuple[str, ...] = ()
) -> list[str]:
    """The options of ``args`` that differ from ``parser``'s defaults, as full-name flags.

    What launched ranks get instead of our raw argv: torchrun's own parser reads every token
    that looks like an option, and claims a prefix of one of its own ("--nproc" is ambiguous
    with its --nproc-per-node). ``--name=value`` keeps a value starting with "-" a value.
    ``exclude``: destinations the ranks must not get (e.g. ``nproc``).
    """
    flags: list[str] = []
    for action in parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if not longs or action.dest in exclude or action.dest == "help":
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default or value is None:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            flags.append(longs[0] if value else "--no-" + longs[0][2:])
        elif action.nargs == 0:  # store_true / store_false: the flag itself says it
            flags.append(longs[0])
        else:
            flags.append(f"{longs[0]}={value}")
    return flags


def _signal_flags() -> list[str]:
    """torchrun's agent turns the signals it handles into "pass the signal to the workers, wait,
    then SIGKILL"; by default SIGUSR1 (SLURM's usual warning) is not among them and would kill
    it. Older torch (before ``--signals-to-handle``) gets SIGTERM forwarded instead (see
    :class:`fullshard.app.preempt.ForwardSignals`)."""
    from torch.distributed.run import get_args_parser

    if "--signals-to-handle" not in get_args_parser()._option_string_actions:
        return []
    return ["--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"]


def launch_local(
    nproc: int,
    argv: list[str],
    *,
    max_restarts: int = 0,
    module: str = "fullshard.app.cli",
    env: dict[str, str] | None = None,
    timeout_s: float | None = None,
) -> int:
    """Run ``python -m <module> <argv>`` on ``nproc`` local ranks through torch.distributed.run
    (wrapped by :func:`fullshard.app.preempt.run_torchrun`).

    Returns the launcher's exit status (non-zero when any rank failed; torchrun then stops the
    others rather than letting them wait for a dead peer), or ``PREEMPTED_EXIT`` (75) when the
    ranks stopped on a stop signal with a complete checkpoint (NOTE [Preemption]): SIGTERM or
    SIGUSR1 sent to this process is passed on to torchrun, whose agent passes it to the ranks.
    With ``timeout_s`` the launcher runs in its own session, and on timeout it and its ranks
    are ended together (status 124).
    """
    env = dict(os.environ if env is None else env)
    # Local CPU runs talk over loopback; without this gloo may pick an interface that does not
    # route to itself (containers, VPNs).
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # Set it ourselves so torchrun does not print its OMP_NUM_THREADS warning; the drivers set
    # torch's thread count from --threads anyway.
    env.setdefault("OMP_NUM_THREADS", "1")
    signal_flags = _signal_flags()
    cmd = [
        sys.executable,
        "-m",
        "fullshard.app.preempt",  # torch.distributed.run, with a quiet preempted status
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        *signal_flags,
        "-m",
        module,
        *argv,
    ]
    with tempfile.TemporaryDirectory(prefix="fullshard-launch-") as tmp:
        # torchrun reports a preempted rank (status 75) and a failed one alike (status 1):
        # rank 0 writes this file once the preemption checkpoint is committed
        marker = env[MARKER_ENV] = os.path.join(tmp, "preempted.json")
        proc = subprocess.Popen(cmd, env=env, start_new_session=timeout_s is not None)
        with ForwardSignals(proc, send=None if signal_flags else signal.SIGTERM) as forwarded:
            try:
                status = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                print(
                    f"fullshard: launch timed out after {timeout_s:.0f} s: {argv}", file=sys.stderr
                )
                return 124
        if read_marker(marker) is not None:
            return PREEMPTED_EXIT
    if forwarded.requested and status != 0:
        print(
            f"fullshard: {forwarded.name()} passed on to the ranks, but they did not report a "
            f"complete checkpoint (launcher status {status})",
            file=sys.stderr,
        )
    return status


BACKENDS = ("auto", "nccl", "gloo")


def add_device_arguments(p: argparse.ArgumentParser) -> None:
    """``--device`` and ``--backend``, as ``fullshard train`` has them (trace and bench)."""
    p.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="auto (CUDA if visible, else CPU), cpu or cuda (default: auto)",
    )
    p.add_argument(
        "--backend",
        default="auto",
        choices=BACKENDS,
        help="auto (NCCL on CUDA, gloo on CPU), nccl, or gloo (on CUDA: the ranks share the "
        "visible GPUs, rank r on cuda:(r %% GPUs)) (default: auto)",
    )


def _local_world_size(default: int) -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", default))


def resolve_backend(
    device_pref: str, backend_pref: str, *, flag: str = "--device"
) -> tuple[str, str]:
    """The device type and backend that ``--device`` and ``--backend`` ask for.

    ``auto`` device: CUDA when it is visible, else CPU. ``auto`` backend: NCCL on CUDA, gloo on
    CPU. Raises :class:`ConfigError` for a choice that cannot work here (the same answer on every
    rank: nothing rank-specific is looked at). ``flag``: the device option's name, for messages.
    """
    if device_pref not in ("auto", "cpu", "cuda") or backend_pref not in BACKENDS:
        raise ConfigError(
            f"{flag} {device_pref} / --backend {backend_pref}: choose {flag} auto|cpu|cuda "
            f"and --backend {'|'.join(BACKENDS)}"
        )
    cuda_visible = torch.cuda.is_available()
    if device_pref == "cuda" and not cuda_visible:
        raise ConfigError(f"{flag} cuda: {cuda_usable(0)}")
    use_cuda = device_pref == "cuda" or (device_pref == "auto" and cuda_visible)
    backend = backend_pref if backend_pref != "auto" else ("nccl" if use_cuda else "gloo")
    if backend == "nccl" and not use_cuda:
        why = "no CUDA device is visible here" if not cuda_visible else f"{flag} cpu was asked for"
        raise ConfigError(
            f"--backend nccl moves CUDA tensors only, but {why}: use --backend gloo (or auto) "
            "to run on the CPU"
        )
    return ("cuda" if use_cuda else "cpu"), backend


def check_devices(
    device_pref: str, backend_pref: str, local_ranks: int, *, flag: str = "--device"
) -> tuple[str, str]:
    """:func:`resolve_backend`, plus the rule that NCCL needs one GPU per local rank.

    Cheap and the same on every rank (no device is touched), so the CLI calls it before
    launching and every rank again before joining the process group.
    """
    device_type, backend = resolve_backend(device_pref, backend_pref, flag=flag)
    if backend == "nccl":
        count = torch.cuda.device_count()
        if local_ranks > count:
            raise ConfigError(
                f"{local_ranks} ranks on this machine but only {count} CUDA device(s) visible: "
                f"NCCL needs one GPU per rank. Launch at most {count} rank(s) per machine "
                "(--nproc), or let the ranks share the GPUs over gloo (--backend gloo)"
            )
    return device_type, backend


def rank_device(
    device_pref: str, backend_pref: str, local_rank: int, local_ranks: int
) -> tuple[torch.device, str]:
    """This rank's device and the backend, or a :class:`ConfigError` saying what to change.

    NCCL: ``cuda:LOCAL_RANK`` (one GPU per rank). gloo on CUDA: ranks share the visible GPUs,
    rank r on ``cuda:(r % device_count)``; gloo moves CUDA tensors through host copies, which
    is what lets 2-4 ranks exercise CUDA memory and streams on one GPU (NCCL refuses two ranks on
    one device).
    """
    device_type, backend = check_devices(device_pref, backend_pref, local_ranks)
    if device_type == "cpu":
        return torch.device("cpu"), backend
    index = local_rank if backend == "nccl" else local_rank % torch.cuda.device_count()
    problem = cuda_usable(index)
    if problem:
        raise ConfigError(f"local rank {local_rank}: {problem}")
    return torch.device("cuda", index), backend


def _accepts_device_id() -> bool:
    # torch >= 2.3: NCCL binds the device (and creates its communicator) eagerly, so a rank on
    # the wrong GPU fails at init instead of in its first collective.
    return "device_id" in inspect.signature(dist.init_process_group).parameters


def init_distributed(device_pref: str, timeout_s: float, backend: str = "auto") -> DistInfo:
    """Join the process group torchrun describes: NCCL (one GPU per rank), gloo on CPU, or
    gloo with ranks sharing GPUs (``backend="gloo"`` on CUDA).

    Device problems (no CUDA, fewer GPUs than NCCL ranks, a busy GPU) raise
    :class:`ConfigError` *before* the process group is joined, so no rank waits for a peer
    that will never come. ``timeout_s`` bounds every collective wait (on NCCL: the process
    group's watchdog), so a dead or stuck peer fails the run instead of hanging it.
    """
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device, backend = rank_device(device_pref, backend, local_rank, _local_world_size(world_size))
    # fullshard's own bounded waits (engine and control) get the same bound as the process
    # group, unless the user set one (fullshard.comm.mesh.default_timeout reads it)
    os.environ.setdefault("FULLSHARD_TIMEOUT_S", str(timeout_s))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        store, _, _ = next(rendezvous("env://", rank, world_size, timeout=timeout))
        # A restarted attempt (torchrun --max-restarts) may reach a store that still holds the
        # previous attempt's keys; gloo then dialled the dead ranks' addresses (seen as
        # "connection refused", and as a hang when another process had taken the port). Keys of
        # our own, per attempt, cannot be stale.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        extra: dict[str, Any] = {}
        if backend == "nccl" and _accepts_device_id():
            extra["device_id"] = device
        dist.init_process_group(
            backend=backend,
            store=dist.PrefixStore(f"fullshard/attempt_{attempt}", store),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            **extra,
        )
    return DistInfo(rank, world_size, local_rank, device, backend)


def leave_together() -> None:
    """NOTE [Leaving together]: call on every rank just before the process group goes.

    A rank that tears down its gloo connections while a peer still works (writing plots, files)
    aborted on its way out ("terminate called without an active exception") about half the time
    under load; so did process-group handles left in reference cycles to interpreter shutdown.
    Collect those cycles now, then wait for every rank (hosts included: NCCL work still queued
    on the device would otherwise outlive the communicator).
    """
    gc.collect()
    control.host_barrier(what="leave-together barrier")


@contextlib.contextmanager
def rank_session(device_pref: str, timeout_s: float, backend: str = "auto") -> Iterator[DistInfo]:
    """Join the process group for one rank's work, and leave it together with the others."""
    info = init_distributed(device_pref, timeout_s, backend)
    try:
        yield info
        leave_together()
    finally:
        dist.destroy_process_group()
