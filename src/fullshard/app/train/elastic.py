"""``fullshard train --elastic`` on a rank: the trainer's side of ``fullshard.elastic``.

A rank joins its generation's process group through :class:`fullshard.elastic.Manager` (the
store is hosted by fullshard's launcher, or by the first node's torchrun agent under
``--rdzv-backend fullshard``: ``app/launch/elastic.py``); at every ``--elastic-every``-th
step boundary the trainer hands the manager its model, optimizer and :func:`loop_state`; when a
step fails (or rank 0 admits new ranks), :func:`recover` settles the next membership, has the
trainer rebuild its model for it and loads the newest boundary the participants hold, in
memory. A process that joins a running job starts the same way and receives the state from its
peers (``joined_now``).

The world sizes a membership may take are the ones validation accepts for this command
(:func:`world_rules`: with ``--deterministic``, powers of two the global batch divides into);
the copies live on the ring neighbour a node away, or, under HSDP, on the other replicas.

Losses that cannot be recovered (ring neighbours lost together, replacements used up, no world
the job accepts) end the job: the rank that finds out tells everyone through the store, naming
the newest complete checkpoint on disk, and every rank exits with status 1 without a traceback.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any, NoReturn

import torch
from torch import nn

from fullshard.app.config import TrainConfig
from fullshard.app.dims import ParallelDims
from fullshard.app.errors import ConfigError
from fullshard.app.launch.elastic import LAUNCHER_ENV
from fullshard.app.launch.local import DistInfo, leave_together, prepare_rank
from fullshard.elastic import Aborted, Layout, Lost, Manager, Membership, abort_groups
from fullshard.elastic.membership import JobFinished

__all__ = [
    "RUN_DIR",
    "apply_loop_state",
    "dims_at",
    "elastic_session",
    "join_restore",
    "loop_state",
    "recover",
    "world_rules",
]

RUN_DIR = "run_dir"  # the job store's note of the run folder (rank 0's, for a new rank 0)


def dims_at(dims: ParallelDims, world: int) -> ParallelDims:
    """The run's parallel dimensions at another world size (a node's ranks stay a node's)."""
    return replace(dims, world=world, local_world=min(dims.local_world, world))


def world_rules(
    cfg: TrainConfig, dims: ParallelDims
) -> tuple[Callable[[int], bool], Callable[[int], Layout]]:
    """Which world sizes the job can run at (validation's own world checks), and where each
    world's copies live: a shard group's replicas hold each other's shards; otherwise the copy
    goes to the rank a node away (a lost node's shards are then held on another)."""
    from fullshard.app.commands.validate import check_world

    def accepts(world: int) -> bool:
        try:
            check_world(cfg, dims_at(dims, world))
        except ConfigError:
            return False
        return True

    def layout(world: int) -> Layout:
        d = dims_at(dims, world)
        keys = d.shard_group()  # (no --tp with --elastic)
        node = d.local_world
        return Layout(keys, node if world > node and world % node == 0 else 1)

    return accepts, layout


@contextlib.contextmanager
def elastic_session(cfg: TrainConfig, dims: ParallelDims) -> Iterator[tuple[DistInfo, Manager]]:
    """Join the current generation's process group (a new process: the one that admits it),
    and leave it together with the others."""
    slot, device, backend = prepare_rank(cfg.device, cfg.backend, cfg.timeout)
    accepts, layout = world_rules(cfg, dims)
    mgr = Manager.from_env(
        backend=backend, timeout_s=cfg.timeout, every=cfg.elastic_every, accepts=accepts,
        layout=layout, device=device,
    )  # fmt: skip
    try:
        m = mgr.join()
    except JobFinished as exc:
        print(f"fullshard: {exc}: nothing to do", file=sys.stderr, flush=True)
        raise SystemExit(0) from None
    except Lost as exc:
        _give_up(mgr, exc, lambda: None)
    try:
        yield DistInfo(m.rank, m.world, slot, device, backend), mgr
        if mgr.membership is not None and mgr.membership.rank == 0:
            mgr.finish()
        leave_together()
    finally:
        mgr.close()
        abort_groups() if sys.exc_info()[0] is not None else _destroy()


def _destroy() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def loop_state(sched: Any, sampler: Any, skipped: list[int], dsched: Any) -> dict[str, Any]:
    """What a boundary holds besides model and optimizer (the same on every rank). On the CUDA
    path the schedule's count of applied steps lives on the device (``dsched``, NOTE [The
    step's verdict on the device]): it is copied with the shards, never read here."""
    state = {"scheduler": sched.state_dict(), "sampler": sampler.state_dict(), "skipped": skipped}
    if dsched is not None:
        state["applied"] = dsched.applied
    return state


def apply_loop_state(
    state: dict[str, Any], sched: Any, sampler: Any, skipped: list[int], dsched: Any
) -> None:
    sched.load_state_dict(state["scheduler"])
    sampler.load_state_dict(state["sampler"])
    skipped[:] = state["skipped"]
    if dsched is not None:  # the device count (recovery reads it: not a steady-state step)
        if "applied" in state:
            sched.last_epoch = int(state["applied"].item())
        dsched.reload()


def recover(
    mgr: Manager,
    error: Exception,
    rebuild: Callable[[Membership], tuple[nn.Module, torch.optim.Optimizer, Any]],
    newest_checkpoint: Callable[[], str | None],
) -> tuple[Membership, Any, dict[str, Any], int]:
    """After ``error`` in a step: the new membership, what ``rebuild`` built for it (a model and
    optimizer, loaded here, and anything else it returns third), the loop state and the step of
    the boundary they were loaded from. A loss during recovery starts it again with the next
    generation; a loss that cannot be recovered ends the job (:func:`_give_up`)."""
    while True:
        try:
            m = mgr.recover(error)
            model, opt, extra = rebuild(m)
            state: dict[str, Any] = {}
            step = mgr.restore(model, opt, state)
            return m, extra, state, step
        except Lost as exc:
            _give_up(mgr, exc, newest_checkpoint)
        except Exception as again:  # another loss while recovering: the next generation
            error = again


def join_restore(
    mgr: Manager, model: nn.Module, opt: torch.optim.Optimizer, folder: str
) -> tuple[dict[str, Any], int]:
    """A new rank's state from its peers (the loop state, and the boundary's step)."""
    from fullshard.checkpoint import latest_checkpoint

    state: dict[str, Any] = {}
    try:
        return state, mgr.restore(model, opt, state)
    except Lost as exc:
        _give_up(mgr, exc, lambda: latest_checkpoint(folder))


def _give_up(mgr: Manager, lost: Lost, newest_checkpoint: Callable[[], str | None]) -> NoReturn:
    """End the job with one message (naming the newest disk checkpoint), said by fullshard's
    launcher, or, under torchrun, by the first rank of each node."""
    abort_groups()
    if isinstance(lost, Aborted):  # another rank, or the launcher, said why
        message = str(lost)
    else:
        ckpt = newest_checkpoint()
        where = (
            f"resume from the newest complete checkpoint with --resume {ckpt}"
            if ckpt
            else "no checkpoint was written yet (--save-every)"
        )
        message = f"--elastic cannot recover in memory: {lost}; {where}"
        with contextlib.suppress(Exception):  # the store itself may be what was lost
            mgr.abort(message)
    if not os.environ.get(LAUNCHER_ENV) and os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"fullshard: {message}", file=sys.stderr, flush=True)
    raise SystemExit(1)
