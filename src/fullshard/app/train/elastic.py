"""``fullshard train --elastic`` on a rank: the trainer's side of ``fullshard.elastic``.

A rank joins its generation's process group through :class:`fullshard.elastic.Manager` (the
store is hosted by fullshard's launcher, or by the first node's torchrun agent under
``--rdzv-backend fullshard``: ``app/launch/elastic.py``); at every ``--elastic-every``-th
step boundary :class:`ElasticTrainer` hands the manager its train state (model, optimizer and
loop state); when a step fails (or rank 0 admits new ranks), it settles the next membership,
rebuilds its train state for it and loads the newest boundary the participants hold, in
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
import functools
import gc
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

from fullshard.app.config import TrainConfig
from fullshard.app.dims import ParallelDims
from fullshard.app.errors import ConfigError
from fullshard.app.launch.elastic import LAUNCHER_ENV
from fullshard.app.launch.local import DistInfo, leave_together, prepare_rank
from fullshard.app.train.build import RankData, rank_data
from fullshard.app.train.faults import NonFiniteError
from fullshard.app.train.monitor import MetricsLog
from fullshard.app.train.state import LoopState, TrainCheckpoints
from fullshard.app.train.trainer import Trainer, device_checks, read_text
from fullshard.app.train.verdict import StepBook
from fullshard.checkpoint import latest_checkpoint
from fullshard.comm import control
from fullshard.elastic import Aborted, Layout, Lost, Manager, abort_groups
from fullshard.elastic.membership import JobFinished

__all__ = [
    "RUN_DIR",
    "ElasticTrainer",
    "dims_at",
    "elastic_session",
    "train_elastic",
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


class ElasticTrainer(Trainer):
    """The trainer under live recovery: at every step boundary its train state's copies go to
    the manager; a step that fails on a lost rank (or rank 0's regroup to admit new ranks)
    settles the next membership, rebuilds the train state for it, restores the newest boundary
    the participants hold, and goes on from there. A process that joins a running job starts
    from its peers' state instead of the disk."""

    def __init__(self, cfg: TrainConfig, dims: ParallelDims, info: DistInfo, data: RankData,
                 mgr: Manager) -> None:  # fmt: skip
        self.mgr = mgr
        self.joiner = mgr.membership is not None and mgr.membership.joined_now
        super().__init__(cfg, dims_at(dims, info.world_size), info, data)

    def build(self, rank: int, world: int) -> None:
        self.dims = dims_at(self.dims, world)
        super().build(rank, world)

    def run_folder(self) -> tuple[Path | None, str]:
        """The run folder rank 0 of generation 0 named (in the job's store), for every
        generation's rank 0."""
        if self.joiner:
            run_dir = self._noted_run_dir()
            return run_dir, self.cfg.checkpoint_dir or str(run_dir / "checkpoints")
        pids = control.all_gather_objects(os.getpid())  # generation 0's, for summary.json
        mine, folder = super().run_folder()
        if mine is not None:
            self.mgr.jobs.set_note(RUN_DIR, str(mine))
            self.mgr.jobs.set_note("pids_at_start", json.dumps(pids))
        return mine, folder

    def _noted_run_dir(self) -> Path:
        noted = self.mgr.jobs.note(RUN_DIR)
        assert noted is not None, "generation 0's rank 0 notes the run folder before any step"
        return Path(noted)

    def start(self) -> int:
        """A new process takes its state from its peers (in memory); the others start as
        without --elastic."""
        if not self.joiner:
            return super().start()
        done = self.restore(lambda: latest_checkpoint(self.folder))
        if self.rank == 0:
            assert self.run_dir is not None
            self.log = MetricsLog(self.run_dir / "metrics.jsonl", append=True)
        return done

    def restore(self, newest_checkpoint: Callable[[], str | None]) -> int:
        """Load the newest boundary the participants hold into the train state; its step."""
        loop: dict[str, Any] = {}
        s = self.state
        try:
            step = self.mgr.restore(s.model, s.optimizer, loop)
        except Lost as exc:
            _give_up(self.mgr, exc, newest_checkpoint)
        s.apply(LoopState(**loop))
        # its copy goes to the ring neighbour at once: another loss before the next boundary
        # would otherwise find the restored state nowhere
        self.mgr.snapshot(step, s.model, s.optimizer, s.loop_state(gather=False).to_dict(),
                          restored=True)  # fmt: skip
        return step

    def before_step(self, step: int) -> None:
        """The step boundary: the ring copies of the state after ``step - 1`` steps."""
        self.mgr.snapshot(
            step - 1, self.state.model, self.state.optimizer,
            self.state.loop_state(gather=False).to_dict(),
        )  # fmt: skip
        super().before_step(step)

    def joining(self) -> Any:
        return self.mgr.join_waiting_or_whole

    def step_or_recover(self, step: int) -> int:
        try:
            return super().step_or_recover(step)
        except (ConfigError, NonFiniteError):
            raise  # not a lost rank: bad input, or --on-nonfinite stop
        except Exception as exc:
            if device_failed(exc):  # sticky: every later CUDA call of this process fails
                print(f"fullshard: rank {self.rank}'s device failed ({_first_line(exc)}); this "
                      "process ends, and is replaced", file=sys.stderr, flush=True)  # fmt: skip
                raise SystemExit(1) from None
            _drop_frames(exc)  # the failed step's frames hold its activations
            return self.recover(exc, step) + 1

    def recover(self, error: Exception, step: int) -> int:
        """After ``error`` in step ``step``: the new membership, this trainer rebuilt for it and
        the newest boundary restored; that boundary's step. A loss during recovery starts it again
        with the next generation (at most RECOVERY_ATTEMPTS in a row); a loss that cannot be
        recovered ends the job. The old generation's model, optimizer and steps are let go
        before the new ones are built, which on a GPU would otherwise sit beside them."""
        newest = functools.partial(latest_checkpoint, self.folder)
        for attempt in range(1, RECOVERY_ATTEMPTS + 1):
            try:
                m = self.mgr.recover(error)
                if self.fault is not None:  # a drill: a loss during this recovery
                    self.fault.at_recovery(step, self.rank)
                self._release()
                self.build(m.rank, m.world)
                done = self.restore(newest)
                break
            except Lost as exc:
                _give_up(self.mgr, exc, newest)
            except Exception as again:  # another loss while recovering: the next generation
                if device_failed(again) or attempt == RECOVERY_ATTEMPTS:
                    why = (
                        f"{attempt} recoveries in a row failed, the last with {_first_line(again)}"
                    )
                    _give_up(self.mgr, Lost(why), newest)
                _drop_frames(again)
                error = again
        self.ckpt = TrainCheckpoints(
            self.folder, self.state, keep=self.cfg.keep, async_save=self.cfg.async_save
        )
        if self.rank == 0 and self.log is None:  # rank 0 was lost: the log moves here
            self.run_dir = self._noted_run_dir()
            self.log = MetricsLog(self.run_dir / "metrics.jsonl", append=True)
        elif self.rank != 0 and self.log is not None:  # no longer rank 0 (left out, back later)
            self.log.close()
            self.log = None
        self.losses.clear()  # the steps since the boundary are taken (and logged) again
        self.book = StepBook(self.cfg, self.rank, self.scaler is None, self.log, self.losses,
                             self.state.skipped)  # fmt: skip
        self.last_step, self.last_t = done, time.perf_counter()
        if self.rank == 0:
            print(f"elastic: {self.mgr.changes[-1]}", flush=True)
        return done

    def _release(self) -> None:
        """Let the old generation's train state and step go (recovery builds new ones)."""
        for name in ("state", "batches", "decider", "ckpt", "plan"):
            self.__dict__.pop(name, None)
        gc.collect()

    def summary(self, wall: float) -> dict[str, Any]:
        """Besides the run's: one entry per membership change, and who is in the last one."""
        summary = super().summary(wall)
        if self.joiner:
            summary["resumed_from"] = None  # from its peers, not a checkpoint on disk
        summary["membership"] = self.mgr.changes
        summary["pids_at_start"] = json.loads(self.mgr.jobs.note("pids_at_start") or "[]")
        summary["pids"] = control.all_gather_objects(os.getpid())
        summary["elastic_copy_s"] = round(self.mgr.snapshot_s, 3)
        summary["elastic_copy_bytes"] = self.mgr.copy_bytes  # own + neighbour's, one boundary
        return summary


def train_elastic(cfg: TrainConfig, dims: ParallelDims) -> dict[str, Any]:
    """``fullshard train --elastic`` on this rank: join the current generation (the launcher's
    store), train, leave together."""
    tokenizer, tokens = read_text(cfg)
    with elastic_session(cfg, dims) as (info, mgr), device_checks():
        data = rank_data(cfg, dims_at(dims, info.world_size), tokenizer, tokens, info.rank)
        return ElasticTrainer(cfg, dims, info, data, mgr).train()


RECOVERY_ATTEMPTS = 4  # recoveries in a row (each a new generation) before the job gives up


def device_failed(error: BaseException) -> bool:
    """Whether ``error`` is a CUDA error that stays (an illegal access, a device-side assert,
    ECC): every later CUDA call of the process fails, so it cannot recover in place; a new
    process (its replacement) can."""
    text = str(error)
    return type(error).__name__ == "AcceleratorError" or "CUDA error" in text


def _first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"


def _drop_frames(error: BaseException | None) -> None:
    """Forget ``error``'s traceback frames (and its causes'), which hold a failed step's
    locals (activations, gathered parameters) alive."""
    seen = 0
    while error is not None and seen < 8:
        error.__traceback__ = None
        error = error.__cause__ or error.__context__
        seen += 1


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
