"""Multi-process test harness: N gloo ranks on loopback, one thread each, with a deadline.

``run_ranks(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` in ``world_size``
fresh processes that share a process group, and returns every rank's return value (rank order).
A rank that raises makes the whole call fail with *every* rank's traceback; ranks that are still
running at the deadline are named in the failure and killed, so a hang becomes a failure that
says which ranks never finished.

Processes come from a ``forkserver`` that has imported torch once, so each rank starts in a
fraction of a second instead of re-importing torch.

``run_command(cmd, deadline_s=..., what=...)`` is the same deadline for a command line (the CLI,
torchrun): past it the command and everything it launched are killed, and the test fails
saying what hung and the last lines it printed. Tests bound time this way, never by asserting
on a measured duration.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import os
import queue
import signal
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

DEFAULT_TIMEOUT_S = 120.0

_ctx: Any = None

# What the forkserver imports once, so that no rank re-imports it. ``fullshard`` loads its public
# names lazily (its ``__init__`` imports nothing heavy), so the modules the ranks use are named
# here: the ones the eager ``__init__`` used to load (engine, all of ``fullshard.checkpoint``),
# DTensor and torch.distributed.checkpoint (seconds of import a rank otherwise), and torch._dynamo,
# which DTensor imports on first use (0.8 s of CPU per rank, measured: 61 ranks of four engine
# files went from 142 to 91 s). The forkserver skips a name that fails to import, so a rank would
# then import it itself: slower, not wrong.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "torch._dynamo",
    "safetensors",
    "fullshard",
    "fullshard.policies",
    "fullshard.engine.api",
    "fullshard.engine.gradients",
    "fullshard.engine.parallelize",
    "fullshard.engine.schedule",
    "fullshard.engine.sharding",
    "fullshard.checkpoint.export",
    "fullshard.checkpoint.safetensors_load",
    "fullshard.checkpoint.state_dict",
    "fullshard.checkpoint.store",
]


def _context() -> Any:
    global _ctx
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload(_PRELOAD)
    return _ctx


def run_cases(rank: int, world: int, cases: dict[Any, tuple[Callable[..., Any], tuple]]) -> dict:
    """Several checks in one launch (a launch costs seconds): each case ``fn(rank, world,
    *args)`` of ``cases`` in turn, its result or the traceback it raised, so one failing case
    names itself and the others still run. The default dtype is reset to float32 before each,
    as a fresh rank starts. Pass it to :func:`run_ranks`; read a case with :func:`case_results`."""
    import torch

    out: dict[Any, dict[str, Any]] = {}
    for key, (fn, args) in cases.items():
        torch.set_default_dtype(torch.float32)
        try:
            out[key] = {"result": fn(rank, world, *args)}
        except Exception:
            out[key] = {"raised": traceback.format_exc()}
    return out


def case_results(results: list[dict], key: Any) -> list[Any]:
    """One case of :func:`run_cases` on every rank; fails with its traceback if it raised."""
    for r in results:
        assert "raised" not in r[key], r[key]["raised"]
    return [r[key]["result"] for r in results]


class RanksFailed(AssertionError):
    """Some rank raised, or did not finish in time."""


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    store_path: str,
    results: Any,
    pg_timeout_s: float,
    args: tuple[Any, ...],
) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        # Every rank has finished gloo's connection handshake before any runs fn: a rank that
        # raised at once and closed its sockets broke a peer still in init_process_group
        # ("Connection closed by peer" in connectFullMesh, seen once in a CI run).
        dist.barrier()
        out = fn(rank, world_size, *args)
        # Tensors go through the queue as bytes: shared-memory handles would die with the rank.
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, "ok", buf.getvalue()))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    pg_timeout_s: float = 60.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return their results.

    ``fn`` must be a module-level function (it is pickled to the ranks) and its return value
    must be picklable.
    """
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_worker,
                args=(fn, r, world_size, store_path, results, pg_timeout_s, args),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        outcome: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while len(outcome) < world_size and time.monotonic() < deadline:
            try:
                rank, status, value = results.get(timeout=0.2)
                outcome[rank] = (status, value)
            except queue.Empty:
                # A rank that died without reporting (killed, segfault) will never report.
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if r not in outcome and p.exitcode is not None and p.exitcode != 0
                ]
                if dead and results.empty():
                    for r in dead:
                        outcome[r] = ("error", f"process exited with code {procs[r].exitcode}")
        for p in procs:
            p.join(timeout=2)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=2)
    missing = [r for r in range(world_size) if r not in outcome]
    errors = {r: v for r, (s, v) in outcome.items() if s == "error"}
    if missing or errors:
        parts = []
        if missing:
            parts.append(f"ranks {missing} did not finish within {timeout_s:.0f}s (hang?)")
        for r in sorted(errors):
            parts.append(f"--- rank {r} raised ---\n{errors[r]}")
        raise RanksFailed("\n".join(parts))
    import torch

    return [torch.load(io.BytesIO(outcome[r][1]), weights_only=False) for r in range(world_size)]


class CommandHung(AssertionError):
    """A command did not finish before its deadline."""


def run_command(
    cmd: list[str],
    *,
    deadline_s: float,
    what: str,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` (output captured) and return its result; past ``deadline_s`` kill its whole
    process group (torchrun's ranks included) and raise ``CommandHung`` naming ``what``."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd,
        start_new_session=True,  # its own process group: one kill reaches every rank
    )
    try:
        out, err = proc.communicate(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):  # the group may be gone already
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        tail = "\n".join((out + err).splitlines()[-20:])
        raise CommandHung(
            f"{what} did not finish within {deadline_s:.0f}s (hung?): {' '.join(cmd)}\n"
            f"--- last lines it printed ---\n{tail}"
        ) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
