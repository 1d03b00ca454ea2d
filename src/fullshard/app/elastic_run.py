"""``fullshard train --elastic`` on a rank: the trainer's side of ``fullshard.elastic``.

A rank joins its generation's process group through :class:`fullshard.elastic.Manager` (the
launcher, ``app/supervisor.py``, hosts the store); at every ``--elastic-every``-th step boundary
the trainer hands the manager its model, optimizer and :func:`loop_state`; when a step fails,
:func:`recover` waits for the next membership, has the trainer rebuild its model for it and
loads the newest boundary the survivors hold, in memory. A replacement starts in the same way
and receives the state from its peers (``joined_now``).

Losses that cannot be recovered (ring neighbours lost together, replacements used up) end the
job: the rank that finds out tells the launcher through the store, naming the newest complete
checkpoint on disk, and every rank exits with status 1 without a traceback.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch
from torch import nn

from fullshard.app.launch import DistInfo, leave_together, prepare_rank
from fullshard.elastic import Aborted, Lost, Manager, Membership, abort_groups

__all__ = [
    "RUN_DIR_KEY",
    "apply_loop_state",
    "elastic_session",
    "join_restore",
    "loop_state",
    "recover",
]

RUN_DIR_KEY = "fullshard/elastic/run_dir"


@contextlib.contextmanager
def elastic_session(
    device_pref: str, timeout_s: float, backend_pref: str, every: int
) -> Iterator[tuple[DistInfo, Manager]]:
    """Join the current generation's process group (a replacement: the one it was started for),
    and leave it together with the others."""
    slot, device, backend = prepare_rank(device_pref, backend_pref, timeout_s)
    mgr = Manager.from_env(backend=backend, timeout_s=timeout_s, every=every)
    m = mgr.join()
    try:
        yield DistInfo(m.rank, m.world, slot, device, backend), mgr
        leave_together()
    finally:
        abort_groups() if sys.exc_info()[0] is not None else _destroy()


def _destroy() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def loop_state(sched: Any, sampler: Any, skipped: list[int]) -> dict[str, Any]:
    """What a boundary holds besides model and optimizer (the same on every rank)."""
    return {"scheduler": sched.state_dict(), "sampler": sampler.state_dict(), "skipped": skipped}


def apply_loop_state(state: dict[str, Any], sched: Any, sampler: Any, skipped: list[int]) -> None:
    sched.load_state_dict(state["scheduler"])
    sampler.load_state_dict(state["sampler"])
    skipped[:] = state["skipped"]


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
    """A replacement's state from its peers (the loop state, and the boundary's step)."""
    from fullshard.checkpoint import latest_checkpoint

    state: dict[str, Any] = {}
    try:
        return state, mgr.restore(model, opt, state)
    except Lost as exc:
        _give_up(mgr, exc, lambda: latest_checkpoint(folder))


def _give_up(mgr: Manager, lost: Lost, newest_checkpoint: Callable[[], str | None]) -> NoReturn:
    """End the job: one message (with the newest disk checkpoint) from the launcher."""
    abort_groups()
    if isinstance(lost, Aborted):  # another rank, or the launcher, said why already
        raise SystemExit(1)
    why = str(lost)
    ckpt = newest_checkpoint()
    where = (
        f"resume from the newest complete checkpoint with --resume {ckpt}"
        if ckpt
        else "no checkpoint was written yet (--save-every)"
    )
    message = f"--elastic cannot recover in memory: {why}; {where}"
    mgr.abort(message)  # the launcher prints it, once
    raise SystemExit(1)
