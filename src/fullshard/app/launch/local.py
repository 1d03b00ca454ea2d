"""Launching ranks and joining the process group.

``fullshard train --nproc N`` re-invokes itself through ``torch.distributed.run`` (torchrun) with
the same arguments; under torchrun (ours or an external ``torchrun --nnodes ...``) the environment
variables ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT`` say who we are,
and the same code path runs.

NOTE [Ranks from a forkserver]: our launcher's ranks are forked from one ``forkserver`` process
that imported torch and the rank code once (:data:`RANK_PRELOAD`), instead of N fresh
interpreters importing them side by side (about 5 s of CPU each). The server is a fresh
interpreter, started by the agent inside the launch's environment, with no threads and no CUDA
context, so a fork of it is as clean as a new process; a rank still runs ``python -m <module>``'s
code path (:func:`run_rank`). Launches whose ranks read the environment at process start (bench's
memory launches set glibc's malloc variables) ask for ``fresh_interpreters``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import logging
import os
import signal
import sys
import tempfile
import traceback
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.rendezvous import rendezvous

from fullshard.app.config import BACKENDS, DEVICES
from fullshard.app.dims import ParallelDims, under_torchrun
from fullshard.app.errors import ERROR_MARKER_ENV, VALIDATED_ENV, ConfigError, read_report
from fullshard.app.launch.preempt import (
    MARKER_ENV,
    PREEMPTED_EXIT,
    AgentSignals,
    default_stop_signals,
    helpers_ignore_stop_signals,
    read_marker,
)
from fullshard.comm.device import cuda_usable

__all__ = [
    "BACKENDS",
    "DistInfo",
    "check_devices",
    "forward_flags",
    "init_distributed",
    "launch_local",
    "leave_together",
    "prepare_rank",
    "rank_device",
    "rank_session",
    "resolve_backend",
    "run_rank",
    "start_helpers",
    "under_torchrun",
    "validated_by_launcher",
]


def validated_by_launcher() -> bool:
    """True on a rank that :func:`launch_local` started: its arguments were validated before
    launch (one validation pass per launch), so the rank does not validate them again."""
    return under_torchrun() and os.environ.get(VALIDATED_ENV) == "1"


@dataclass(frozen=True)
class DistInfo:
    """Who this process is in the job, and where it computes."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


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


def _torchrun_signal_flags() -> tuple[list[str], int | None]:
    """The ``--signals-to-handle`` flag that leaves :data:`~fullshard.app.launch.preempt.SIGNALS` to
    our :class:`~fullshard.app.launch.preempt.AgentSignals`, and the signal it passes to the ranks
    (``None``: the one received). Older torch (before ``--signals-to-handle``) handles SIGTERM
    itself and knows no SIGUSR1 (SLURM's usual warning), which we pass on as SIGTERM."""
    from torch.distributed.run import get_args_parser

    if "--signals-to-handle" not in get_args_parser()._option_string_actions:
        return [], signal.SIGTERM
    return ["--signals-to-handle=SIGHUP,SIGQUIT"], None


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """``os.environ`` is ``env`` inside (torchrun's agent hands it to the ranks), as before after."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


class _QuietAfterInputError(logging.Filter):
    """Drops the agent's log records once a rank reported an input error: its "failed
    (exitcode: 65)" lines would bury the one message the launcher prints."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker = marker

    def filter(self, record: logging.LogRecord) -> bool:
        return not os.path.exists(self.marker)


class _NoExitTraceback(logging.Filter):
    """Keeps the agent's "failed (exitcode: N) local_rank: R" line for a forked rank but drops
    the traceback it attaches: that is the agent's own poll loop noticing the exit status, which
    says nothing the line does not (a rank's own traceback is on its stderr already)."""

    def filter(self, record: logging.LogRecord) -> bool:
        from torch.multiprocessing.spawn import ProcessExitedException

        if record.exc_info and isinstance(record.exc_info[1], ProcessExitedException):
            record.exc_info = None
            record.exc_text = None
        return True


@contextlib.contextmanager
def _agent_logs_filtered(marker: str) -> Iterator[None]:
    """:class:`_QuietAfterInputError` and :class:`_NoExitTraceback` on every handler torch's
    loggers write through."""
    filters = [_QuietAfterInputError(marker), _NoExitTraceback()]
    # torch's loggers write through handlers of their own (torch._logging), not the root's
    loggers = [logging.getLogger(), logging.getLogger("torch")] + [
        lg
        for name, lg in logging.Logger.manager.loggerDict.items()
        if name.startswith("torch.distributed") and isinstance(lg, logging.Logger)
    ]
    handlers = {h for lg in loggers for h in lg.handlers}
    if logging.lastResort is not None:
        handlers.add(logging.lastResort)
    for h in handlers:
        for f in filters:
            h.addFilter(f)
    try:
        yield
    finally:
        for h in handlers:
            for f in filters:
                h.removeFilter(f)


# What the forkserver imports once for every rank it forks (NOTE [Ranks from a forkserver]): the
# heavy imports of a training rank, torch._dynamo included (DTensor imports it on first use: 0.8 s
# of CPU per rank). A name that fails to import is skipped by multiprocessing; the rank then
# imports it itself (slower, not wrong).
RANK_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "torch._dynamo",
    "fullshard.app.launch.local",
    "fullshard.app.cli",
    "fullshard.app.train.trainer",
]


# A forked rank runs the launcher's ``-m`` module again (multiprocessing's fix-up of __main__, and
# run_rank's ``python -m``), which runpy warns is imported already: the server preloaded it on
# purpose. Set here, the filter is in the server and every rank forked from it.
warnings.filterwarnings("ignore", r"'fullshard\.[\w.]+' found in sys\.modules", RuntimeWarning)


def run_rank(env: dict[str, str], module: str, argv: list[str]) -> None:
    """One rank of :func:`launch_local`, forked from the forkserver: ``python -u -m <module>
    <argv>`` in this process.

    The environment becomes the launch's ``env`` plus what torchrun's agent set for this rank
    (``RANK``, ``LOCAL_RANK``, ...): the server's own copy may be older than this launch; the
    search path gets the working directory and ``PYTHONPATH``, as ``python -m`` has them. An
    exception ends the rank with its traceback on stderr and status 1, as the interpreter does
    (torch's wrapper would only write it to an error file).
    """
    default_stop_signals()  # the server ignores them (NOTE [Helpers ignore stop signals])
    merged = {**{k: v for k, v in os.environ.items() if k not in env}, **env}
    os.environ.clear()
    os.environ.update(merged)
    for stream in (sys.stdout, sys.stderr):  # -u: lines reach the launch's output as they come
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True, write_through=True)
    # the search path ``python -m`` would have: the working directory, then PYTHONPATH
    wanted = [os.getcwd(), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    sys.path[:0] = [p for p in wanted if p not in sys.path]
    sys.argv = [module, *argv]
    import runpy

    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        sys.exit(130)  # torch's wrapper would turn it into status 0
    except BaseException:
        traceback.print_exc()
        sys.exit(1)


def _run_agent(args: argparse.Namespace, env: dict[str, str], module: str, argv: list[str]) -> None:
    """What ``torch.distributed.run.run`` does for ``--standalone``, with :func:`run_rank` as the
    workers' entry point and a forkserver to start them."""
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args

    args.rdzv_backend = "c10d"
    args.rdzv_endpoint = "localhost:0"
    args.rdzv_id = str(uuid.uuid4())
    config, _, _ = config_from_args(args)
    config.start_method = "forkserver"
    start_helpers(RANK_PRELOAD)
    elastic_launch(config=config, entrypoint=run_rank)(env, module, list(argv))


def start_helpers(preload: list[str] | None) -> None:
    """Start multiprocessing's resource tracker (and, with ``preload``, the forkserver that
    imports it) now, with the stop signals ignored (NOTE [Helpers ignore stop signals]); no
    effect on ones already running (a second launch in one process reuses them)."""
    import multiprocessing
    import multiprocessing.forkserver
    import multiprocessing.resource_tracker

    with helpers_ignore_stop_signals():
        multiprocessing.resource_tracker.ensure_running()
        if preload is not None:
            multiprocessing.set_forkserver_preload(preload)
            multiprocessing.forkserver.ensure_running()


def launch_local(
    nproc: int,
    argv: list[str],
    *,
    max_restarts: int = 0,
    module: str = "fullshard.app.cli",
    env: dict[str, str] | None = None,
    timeout_s: float | None = None,
    fresh_interpreters: bool = False,
) -> int:
    """Run ``python -m <module> <argv>`` on ``nproc`` local ranks through torch.distributed.run,
    whose agent runs in this process (one interpreter and one torch import fewer per launch).
    The ranks are forked from a forkserver that imported torch once (NOTE [Ranks from a
    forkserver]); ``fresh_interpreters``: each rank is a new interpreter instead, for ranks that
    read their environment at process start.

    Call it after validating ``argv``: the ranks are told not to validate again. Returns 0 when
    every rank succeeded; :data:`~fullshard.app.launch.preempt.PREEMPTED_EXIT` (75) when the ranks
    stopped on a stop signal with a complete checkpoint (NOTE [Preemption]: SIGTERM or SIGUSR1
    sent to this process is passed on to the ranks by the agent); 2 with one message when a
    rank found bad input (NOTE [Input errors on the ranks]); 1 when a rank failed (torchrun
    stops the others rather than letting them wait for a dead peer). With ``timeout_s`` the
    ranks are killed after that many seconds (status 124).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    signal_flags, send = _torchrun_signal_flags()
    args = parse_args(
        [
            "--standalone",
            f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}",
            *signal_flags,
            "-m",
            module,
            *argv,
        ]
    )
    env = dict(os.environ if env is None else env)
    # Local CPU runs talk over loopback; without this gloo may pick an interface that does not
    # route to itself (containers, VPNs).
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # Set it ourselves so torchrun does not print its OMP_NUM_THREADS warning; the drivers set
    # torch's thread count from --threads anyway.
    env.setdefault("OMP_NUM_THREADS", "1")
    env[VALIDATED_ENV] = "1"
    failure: ChildFailedError | None = None
    status = 0
    with tempfile.TemporaryDirectory(prefix="fullshard-launch-") as tmp:
        # torchrun reports a preempted rank (status 75), a rank with bad input (65) and a
        # failed one alike: the ranks leave these files to tell them apart
        marker = env[MARKER_ENV] = os.path.join(tmp, "preempted.json")
        error = env[ERROR_MARKER_ENV] = os.path.join(tmp, "input-error.txt")
        signals = AgentSignals(send=send, timeout_s=timeout_s)
        try:
            with _environ(env), _agent_logs_filtered(error), signals:
                if fresh_interpreters:
                    start_helpers(None)
                    run(args)
                else:
                    _run_agent(args, env, module, argv)
        except ChildFailedError as exc:
            failure, status = exc, 1
        except SignalException:
            status = 1
        if read_marker(marker) is not None:
            return PREEMPTED_EXIT
        report = read_report(error)
    if report is not None:
        message, stopped = report
        command = argv[0] if argv else module
        if stopped is not None:  # a run that ended on an expected condition (RunStopped)
            print(f"fullshard {command}: {message}", file=sys.stderr)
            return stopped
        print(f"fullshard {command}: error: {message}", file=sys.stderr)
        return 2
    if signals.timed_out:
        print(f"fullshard: launch timed out after {timeout_s:.0f} s: {argv}", file=sys.stderr)
        return 124
    if signals.requested and status != 0:
        print(
            f"fullshard: {signals.name()} passed on to the ranks, but they did not report a "
            f"complete checkpoint",
            file=sys.stderr,
        )
    elif failure is not None:
        rank, first = failure.get_first_failure()
        print(
            f"fullshard: rank {rank} failed (exit status {first.exitcode}; its output is above), "
            "and the launcher stopped the other ranks",
            file=sys.stderr,
        )
    return status


def resolve_backend(
    device_pref: str, backend_pref: str, *, flag: str = "--device"
) -> tuple[str, str]:
    """The device type and backend that ``--device`` and ``--backend`` ask for.

    ``auto`` device: CUDA when it is visible, else CPU. ``auto`` backend: NCCL on CUDA, gloo on
    CPU. Raises :class:`ConfigError` for a choice that cannot work here (the same answer on every
    rank: nothing rank-specific is looked at). ``flag``: the device option's name, for messages.
    """
    if device_pref not in DEVICES or backend_pref not in BACKENDS:
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


def prepare_rank(device_pref: str, backend: str, timeout_s: float) -> tuple[int, torch.device, str]:
    """This rank's local rank, device and backend, before it joins a process group (on CUDA
    the device is made current); a :class:`ConfigError` for a device that cannot work."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = ParallelDims.from_env(1).local_world  # under torchrun: LOCAL_WORLD_SIZE
    device, backend = rank_device(device_pref, backend, local_rank, local_world)
    # fullshard's own bounded waits (engine and control) get the same bound as the process
    # group, unless the user set one (fullshard.comm.mesh.default_timeout reads it)
    os.environ.setdefault("FULLSHARD_TIMEOUT_S", str(timeout_s))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return local_rank, device, backend


def init_distributed(device_pref: str, timeout_s: float, backend: str = "auto") -> DistInfo:
    """Join the process group torchrun describes: NCCL (one GPU per rank), gloo on CPU, or
    gloo with ranks sharing GPUs (``backend="gloo"`` on CUDA).

    Device problems (no CUDA, fewer GPUs than NCCL ranks, a busy GPU) raise
    :class:`ConfigError` *before* the process group is joined, so no rank waits for a peer
    that will never come. ``timeout_s`` bounds every collective wait (on NCCL: the process
    group's watchdog), so a dead or stuck peer fails the run instead of hanging it.
    """
    rank = int(os.environ["RANK"])
    world_size = ParallelDims.from_env(1).world  # under torchrun: its WORLD_SIZE
    local_rank, device, backend = prepare_rank(device_pref, backend, timeout_s)
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
    # imported here, on the ranks: comm.control pulls in DTensor (through comm.mesh), which the
    # launcher process, importing this module for launch_local, never needs
    from fullshard.comm import control

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
