"""``fullshard train --elastic`` on a rank: the trainer's side of ``fullshard.elastic``.

A rank joins its generation's process group through :class:`fullshard.elastic.Manager` (the
store is hosted by fullshard's launcher, or by the first node's torchrun agent under
``--rdzv-backend fullshard``: ``app/launch/elastic.py``); at every ``--elastic-every``-th
step boundary :class:`ElasticTrainer` hands the manager its train state (model, optimizer and
loop state); when a step fails (or rank 0 admits new ranks), it settles the next membership,
rebuilds its train state for it and loads the newest boundary the participants hold, in
memory. A process that joins a running job starts the same way and receives the state from its
peers (``Manager.stateless``).

The world sizes a membership may take are the ones validation accepts for this command
(:func:`world_rules`: with ``--deterministic``, powers of two the global batch divides into);
the copies live on the ring neighbour a node away, or, under HSDP, on the other replicas.

Recovery covers what lies outside a step too (issue 43): a loss in a checkpoint's save, in the
final save (``save_or_recover``) or while the others restore (a process that joined and holds
nothing yet builds and restores again with them). A job that trained to the end exits 0, a
survivor left out of a smaller world included. The store's loss (its host, the launcher)
stops the ranks as a stop signal does, with a checkpoint and one message (NOTE [Losing the
store]); a full disk ends the run with one message (``RunStopped``), as without ``--elastic``.

Losses that cannot be recovered (ring neighbours lost together, no world the job accepts) end
the job: the rank that finds out tells everyone through the store, naming the newest complete
checkpoint on disk and the command that resumes from it, and every rank exits with status 1
without a traceback.
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
from typing import TYPE_CHECKING, Any, NoReturn

from fullshard.app.config import TrainConfig
from fullshard.app.dims import ParallelDims
from fullshard.app.errors import ConfigError, RunStopped, resume_hint, say_once
from fullshard.app.launch.elastic import LAUNCHER_ENV
from fullshard.app.launch.local import DistInfo, leave_together, prepare_rank
from fullshard.app.train.build import RankData, rank_data
from fullshard.app.train.monitor import MetricsLog
from fullshard.app.train.state import LoopState
from fullshard.app.train.trainer import Trainer, device_checks, read_text
from fullshard.app.train.verdict import NonFiniteError
from fullshard.app.train.world import check_world
from fullshard.checkpoint import latest_checkpoint
from fullshard.comm import control
from fullshard.elastic import Aborted, Layout, Lost, Manager, Membership, abort_groups
from fullshard.elastic.membership import JobFinished

if TYPE_CHECKING:
    import torch

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
    launch = cfg.launch
    slot, device, backend = prepare_rank(launch.device, launch.backend, launch.timeout)
    accepts, layout = world_rules(cfg, dims)
    mgr = Manager.from_env(
        backend=backend,
        timeout_s=launch.timeout,
        every=launch.elastic_every,
        accepts=accepts,
        layout=layout,
        device=device,
    )
    try:
        m = mgr.join()
    except JobFinished as exc:  # a replacement that came after the end: not an error
        print(f"fullshard: {exc}: nothing to do", flush=True)
        raise SystemExit(0) from None
    except Lost as exc:
        _give_up(mgr, exc, functools.partial(_newest_noted, mgr, cfg))
    try:
        yield DistInfo(m.rank, m.world, slot, device, backend), mgr
        leave_together()
    finally:
        mgr.close()
        abort_groups() if sys.exc_info()[0] is not None else _destroy()


def _newest_noted(mgr: Manager, cfg: TrainConfig) -> str | None:
    """The newest complete checkpoint of the run whose folder rank 0 noted in the store."""
    with contextlib.suppress(Exception):  # (the store may be what was lost)
        noted = mgr.jobs.note(RUN_DIR)
        if noted is not None:
            return latest_checkpoint(cfg.checkpoint.dir or str(Path(noted) / "checkpoints"))
    return None


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

    def __init__(
        self, cfg: TrainConfig, dims: ParallelDims, info: DistInfo, data: RankData, mgr: Manager
    ) -> None:
        self.mgr = mgr
        self.joiner = mgr.stateless
        self.failed_step: int | None = None  # the step a recovery in progress recovers from
        mgr.hook = self._at_membership
        super().__init__(cfg, dims_at(dims, info.world_size), info, data)

    def _at_membership(self, point: str, generation: int) -> None:
        """The manager's moments, for a drill's ``at=generation`` faults."""
        if self.fault is not None and self.failed_step is not None and point == "settled":
            self.fault.at_recovery(self.failed_step, self.rank, "generation")

    def build(self, rank: int, world: int) -> None:
        self.dims = dims_at(self.dims, world)
        super().build(rank, world)

    def run_folder(self) -> tuple[Path | None, str]:
        """The run folder rank 0 of generation 0 named (in the job's store), for every
        generation's rank 0."""
        if self.joiner:
            run_dir = self._noted_run_dir()
            return run_dir, self.cfg.checkpoint.dir or str(run_dir / "checkpoints")
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
        try:
            done = self.restore(lambda: latest_checkpoint(self.folder))
        except Exception as exc:  # a peer lost while this process restored: recover with them
            _drop_frames(exc)
            return self.recover(exc, 0)
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
        self.mgr.snapshot(
            step, s.model, s.optimizer, s.loop_state(gather=False).to_dict(), restored=True
        )
        return step

    def before_step(self, step: int) -> None:
        """The step boundary: the ring copies of the state after ``step - 1`` steps."""
        self.mgr.snapshot(
            step - 1,
            self.state.model,
            self.state.optimizer,
            self.state.loop_state(gather=False).to_dict(),
        )
        super().before_step(step)

    def joining(self) -> Any:
        return self.mgr.join_waiting_or_whole

    def step_or_recover(self, step: int) -> int:
        try:
            return super().step_or_recover(step)
        except Exception as exc:
            return self._recover_from(exc, step)

    def save_or_recover(self, step: int) -> int:
        """The final checkpoint, recovered as a step is: a rank lost in it (or in a save of the
        replayed steps) takes the job back to the boundary the survivors restore."""
        try:
            return super().save_or_recover(step)
        except Exception as exc:
            return self._recover_from(exc, step)

    def _recover_from(self, exc: Exception, step: int) -> int:
        """After ``exc`` in step ``step`` (or its save): the next step to take, once recovered;
        errors that are not a lost rank go on up."""
        if isinstance(exc, (ConfigError, NonFiniteError, RunStopped)):
            raise exc  # not a lost rank: bad input, --on-nonfinite stop, a full disk
        if device_failed(exc):  # sticky: every later CUDA call of this process fails
            print(
                f"fullshard: rank {self.rank}'s device failed ({_first_line(exc)}); this "
                "process ends, and is replaced",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(1) from None
        _drop_frames(exc)  # the failed step's frames hold its activations
        return self.recover(exc, step) + 1

    def stop_flag(self) -> torch.Tensor:
        """NOTE [Losing the store]: once the store is lost, this rank votes to stop, as for a
        stop signal, with a vote above any signal's number."""
        if self.mgr.store_lost is None:
            return super().stop_flag()
        import torch

        return torch.full((1,), STORE_LOST_VOTE, dtype=torch.float64, device=self.device)

    def stop(self, step: int) -> None:
        """A stop on the store's loss: checkpoint, and rank 0 says what happened and how to
        resume (the launcher, which would have, is gone); a stop signal's, as without
        --elastic."""
        if self.book.stop < STORE_LOST_VOTE:
            return super().stop(step)
        if self.ckpt.last_saved != step:
            self.save(step)
        self.ckpt.wait()
        if self.rank == 0:
            host, port = self.mgr.address or ("?", 0)
            why = self.mgr.store_lost or "it stopped answering"
            say_once(
                f"fullshard: the job's store at {host}:{port} was lost ({why}): its host, "
                "fullshard's launcher, ended. Without it no rank could be replaced, so the "
                f"ranks stopped after step {step} and saved checkpoint "
                f"{self.ckpt.resolve('latest')} (complete); exiting with status 75. "
                f"Resume: {resume_hint()}",
                "store-lost",
            )

    def recover(self, error: Exception, step: int) -> int:
        """After ``error`` in step ``step``: the new membership, this trainer rebuilt for it and
        the newest boundary restored; that boundary's step. A loss during recovery starts it again
        with the next generation (at most RECOVERY_ATTEMPTS in a row); a loss that cannot be
        recovered ends the job. The old generation's model, optimizer and steps are let go
        before the new ones are built, which on a GPU would otherwise sit beside them."""
        newest = functools.partial(latest_checkpoint, self.folder)
        self.failed_step = step
        for attempt in range(1, RECOVERY_ATTEMPTS + 1):
            try:
                m = _next_membership(self.mgr, error, newest)
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
        self.failed_step = None
        self.ckpt = self.checkpoints()
        if self.rank == 0 and self.log is None:  # rank 0 was lost: the log moves here
            self.run_dir = self._noted_run_dir()
            self.log = MetricsLog(self.run_dir / "metrics.jsonl", append=True)
        elif self.rank != 0 and self.log is not None:  # no longer rank 0 (left out, back later)
            self.log.close()
            self.log = None
        self.losses.clear()  # the steps since the boundary are taken (and logged) again
        self.book = self.step_book()
        self.last_step, self.last_t = done, time.perf_counter()
        if self.rank == 0:
            print(f"elastic: {self.mgr.changes[-1]}", flush=True)
        return done

    def _release(self) -> None:
        """Let the old generation's train state and step go (recovery builds new ones)."""
        for name in ("state", "batches", "decider", "ckpt", "plan"):
            self.__dict__.pop(name, None)
        gc.collect()

    def train(self) -> dict[str, Any]:
        """The run; at its end rank 0 notes in the job's store that it ended (processes waiting
        to join leave) and whether it trained to the end (its launcher's success)."""
        summary = super().train()
        if self.rank == 0 and self.mgr.store_lost is None:
            with contextlib.suppress(Exception):  # (the store may be lost meanwhile)
                self.mgr.finish(complete=not self.stopped)
        return summary

    def summary(self, wall: float) -> dict[str, Any]:
        """Besides the run's: one entry per membership change, and who is in the last one."""
        summary = super().summary(wall)
        if self.joiner:
            summary["resumed_from"] = None  # from its peers, not a checkpoint on disk
        summary["membership"] = self.mgr.changes
        noted = None
        with contextlib.suppress(Exception):  # (NOTE [Losing the store])
            noted = self.mgr.jobs.note("pids_at_start")
        summary["pids_at_start"] = json.loads(noted or "[]")
        summary["pids"] = control.all_gather_objects(os.getpid())
        summary["elastic_copy_s"] = round(self.mgr.snapshot_s, 3)
        summary["elastic_copy_bytes"] = self.mgr.copy_bytes  # own + neighbour's, one boundary
        return summary


def train_elastic(cfg: TrainConfig, dims: ParallelDims) -> dict[str, Any]:
    """``fullshard train --elastic`` on this rank: join the current generation (the launcher's
    store), train, leave together."""
    tokenizer, tokens = read_text(cfg)
    with elastic_session(cfg, dims) as (info, mgr), device_checks():
        for attempt in range(1, RECOVERY_ATTEMPTS + 1):
            data = rank_data(cfg, dims_at(dims, info.world_size), tokenizer, tokens, info.rank)
            try:
                trainer = ElasticTrainer(cfg, dims, info, data, mgr)
                break
            except (ConfigError, RunStopped):
                raise
            except Exception as exc:
                # a process that joined holds nothing yet: a peer lost while it builds its
                # model (whose first collectives are the model check's) sends it to the next
                # generation with the others, where it builds again
                if not mgr.stateless or attempt == RECOVERY_ATTEMPTS:
                    raise
                _drop_frames(exc)
                m = _next_membership(mgr, exc, functools.partial(_newest_noted, mgr, cfg))
                info = DistInfo(m.rank, m.world, info.local_rank, info.device, info.backend)
        return trainer.train()


def _next_membership(
    mgr: Manager, error: BaseException, newest_checkpoint: Callable[[], str | None]
) -> Membership:
    """The membership after ``error``; a process left out of a world that finished leaves
    quietly, and a loss that cannot be recovered ends the job."""
    try:
        return mgr.recover(error)
    except JobFinished:  # left out of a smaller world, and it finished: not a failure
        print(
            f"fullshard: member {mgr.member} was left out of the smaller world, and the job "
            "finished without it",
            flush=True,
        )
        raise SystemExit(0) from None
    except Lost as exc:
        _give_up(mgr, exc, newest_checkpoint)


RECOVERY_ATTEMPTS = 4  # recoveries in a row (each a new generation) before the job gives up
STORE_LOST_VOTE = 1000.0  # the stop vote for a lost store: above any signal's number


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
    """End the job with one message (naming the newest disk checkpoint and the command that
    resumes from it), said by fullshard's launcher, or, when it cannot hear it (under torchrun,
    or the store that carries it was lost), by the first process to get here."""
    abort_groups()
    if isinstance(lost, Aborted):  # another rank said why: the launcher prints it, torchrun not
        if not os.environ.get(LAUNCHER_ENV):
            say_once(f"fullshard: {lost}", "gave-up")
        raise SystemExit(1)
    ckpt = newest_checkpoint()
    where = (
        f"the newest complete checkpoint is {ckpt}; resume with: {resume_hint()}"
        if ckpt
        else "no checkpoint was written yet (--save-every); start the run again"
    )
    message = f"--elastic cannot recover in memory: {lost}; {where}"
    told = False
    with contextlib.suppress(Exception):  # the store itself may be what was lost
        mgr.abort(message)
        told = bool(os.environ.get(LAUNCHER_ENV))  # the launcher prints it
    if not told:
        say_once(f"fullshard: {message}", "gave-up")
    raise SystemExit(1)
