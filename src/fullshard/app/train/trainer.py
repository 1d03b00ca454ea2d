"""The training job of ``fullshard train`` on one rank: :class:`Trainer`, whose ``train()`` loop
runs ``train_step()`` until the last step, a stop signal or ``--stop-after``.

Order matters for "errors on every rank, never a hang": everything that can fail on bad input
(config, data, model) happens before the first collective, computed identically on every rank.

A step's two choices (which micro-batches, who decides the optimizer step) are objects built
once (``steps.py``, ``build.py``); the loop never asks which. On a GPU the host must run ahead
of the device: the step's figures (loss, gradient norm, votes) stay there until its decider
reads them, on CPU at once, on the CUDA path a step late (NOTE [The step's verdict on the
device]). ``--elastic`` wraps this trainer (``elastic.py``: :class:`ElasticTrainer`).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from fullshard.app.config import TrainConfig, to_toml
from fullshard.app.data.corpus import build_tokenizer, load_tokens
from fullshard.app.dims import ParallelDims
from fullshard.app.errors import RunStopped, resume_hint
from fullshard.app.faults import fault_from_env
from fullshard.app.launch.local import DistInfo, rank_session
from fullshard.app.launch.preempt import (
    PREEMPTED_EXIT,
    StopSignals,
    clear_marker,
    signal_name,
    write_marker,
)
from fullshard.app.models.gpt import generate
from fullshard.app.models.wrap import gradient_norm
from fullshard.app.train.build import Built, RankData, build_rank, rank_data
from fullshard.app.train.monitor import (
    MetricsLog,
    format_mem,
    gather_memory,
    log_line,
    make_run_dir,
    plot_losses,
    progress_bar,
    record,
)
from fullshard.app.train.state import TrainCheckpoints
from fullshard.app.train.verdict import StepBook, agree_step
from fullshard.comm import control
from fullshard.comm.runtime import runtime, runtime_from_env

__all__ = ["Trainer", "device_checks", "read_text", "train"]


def train(cfg: TrainConfig, dims: ParallelDims) -> dict[str, Any]:
    """Run one training job on this rank; returns the run summary (on every rank).

    ``cfg`` was validated (``fullshard.app.commands.train.validate``, before launch);
    ``dims``: the run's parallel dimensions. (``--elastic``: ``elastic.train_elastic``.)
    """
    tokenizer, tokens = read_text(cfg)
    with (
        rank_session(cfg.launch.device, cfg.launch.timeout, cfg.launch.backend) as info,
        device_checks(),
    ):
        trainer = Trainer(cfg, dims, info, rank_data(cfg, dims, tokenizer, tokens, info.rank))
        return trainer.train()


def read_text(cfg: TrainConfig) -> tuple[Any, Any]:
    """The tokenizer and the corpus' tokens (a prepared folder is memory-mapped, not read),
    before the process group is joined."""
    if cfg.training.deterministic:  # read when cuBLAS starts: before any CUDA work of this rank
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    tokenizer = build_tokenizer(cfg.model.tokenizer)
    return tokenizer, load_tokens(cfg.data.path, tokenizer)


def device_checks() -> contextlib.AbstractContextManager[Any]:
    """The device runtime the run is checked under, chosen once (``fullshard.comm.runtime``):
    with ``FULLSHARD_CUDA_EMULATION=1`` the whole run takes its CUDA path on CPU, checked, and
    summary.json counts host syncs per step."""
    return runtime_from_env()


class Trainer:
    """One rank's training job: what it trains with (:meth:`build`), where it starts from (a
    checkpoint, or the beginning), and the loop (:meth:`train`) over :meth:`train_step`."""

    def __init__(self, cfg: TrainConfig, dims: ParallelDims, info: DistInfo, data: RankData):
        self.cfg, self.dims, self.data = cfg, dims, data
        self.device, self.backend = info.device, info.backend
        if self.device.type == "cpu":
            torch.set_num_threads(cfg.launch.threads)
        self.fault = fault_from_env()
        self.losses: list[float] = []
        self.host_syncs: dict[str, int] = {}  # under the CUDA emulation: step -> host syncs
        self.log: MetricsLog | None = None
        self.bar: Any = None
        self.stopped = False
        self.val_loss: float | None = None
        self.first_loss = self.last_loss = float("nan")
        self.build(info.rank, info.world_size)
        self.run_dir, self.folder = self.run_folder()
        self.ckpt = self.checkpoints()
        self.done = self.start()  # the step this run starts after
        self.book = self.step_book()

    # -- what a rank trains with, and where it starts -----------------------------------------
    def build(self, rank: int, world: int) -> None:
        """The model, optimizer and schedule (the train state) and the step's choices, for
        ``rank`` among ``world`` ranks."""
        self.rank, self.world = rank, world
        built: Built = build_rank(self.cfg, self.dims, self.data, rank, world, self.device)
        self.state, self.batches, self.decider = built.state, built.batches, built.decider
        self.scaler, self.plan, self.n_params = built.scaler, built.plan, built.n_params

    def step_book(self) -> StepBook:
        """What the host does with each step's verdict (``verdict.py``), for this train state."""
        skips_itself = self.scaler is None
        log, losses, skipped = self.log, self.losses, self.state.skipped
        return StepBook(self.cfg.training, self.rank, skips_itself, log, losses, skipped)

    def checkpoints(self) -> TrainCheckpoints:
        """Saving and resuming this train state (a drill's faults hooked to the saves)."""
        fault = self.fault
        hook = None if fault is None else lambda point, step: fault.at_save(point, step, self.rank)
        return TrainCheckpoints(self.folder, self.state, self.cfg.checkpoint, hook=hook)

    def run_folder(self) -> tuple[Path | None, str]:
        """Rank 0's run folder (named by rank 0) and the checkpoint folder every rank uses."""
        out = self.cfg.output
        run_dir = make_run_dir(out.runs_dir, out.name) if self.rank == 0 else None
        folder = self.cfg.checkpoint.dir or str((run_dir or Path()) / "checkpoints")
        return run_dir, control.broadcast_object(folder)

    def start(self) -> int:
        """Resume (``--resume``, or torchrun's restart from the latest checkpoint) and open
        the run's log on rank 0; the step to go on after."""
        cfg = self.cfg
        resume = cfg.checkpoint.resume
        if resume is None and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
            # restarted by torchrun after a failure: continue from the last complete checkpoint
            resume = "latest" if self.ckpt.resolve("latest") is not None else None
        done = self.ckpt.resume(resume) if resume is not None else 0
        if self.run_dir is not None:  # after a resume that worked: a failed one leaves config
            (self.run_dir / "config.toml").write_text(to_toml(cfg), encoding="utf-8")
            self.log = MetricsLog(self.run_dir / "metrics.jsonl", append=done > 0)
            if done:
                print(f"resumed from step {done} ({self.ckpt.resolve(resume or '')})", flush=True)
            self.announce()
            self.bar = progress_bar(cfg.training.max_steps, done, cfg.output.progress)
        return done

    def announce(self) -> None:
        """Rank 0's run line: model, ranks, sharding, data, batches, run folder."""
        print(
            f"fullshard train: {self.cfg.model.name} ({self.n_params / 1e6:.2f}M params), {self.world} "
            f"ranks ({self.backend}), {self.plan.summary()}{self.cfg.parallelism.describe()}, "
            f"{self.data.tokens:,} tokens ({self.data.words}), {self.batches.describe()} -> run "
            f"folder {self.run_dir}",
            flush=True,
        )

    @property
    def tokens_per_step(self) -> int:
        """Tokens one optimizer step trains on, over every rank."""
        return self.cfg.training.batch_size * self.cfg.data.seq_len

    # -- the loop ----------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        """Step until the last step, a stop signal or ``--stop-after``; then the final
        checkpoint, the sample and the summary (returned on every rank)."""
        cfg = self.cfg
        if self.rank == 0:
            clear_marker()  # this attempt trains on: an earlier attempt's preemption is over
        self.start_t = self.last_t = time.perf_counter()
        self.last_step = self.done
        # NOTE [Preemption]: from here on a stop signal only sets a flag, which the step votes on
        with StopSignals() as self.signals:
            step = self.done + 1
            while True:
                while step <= cfg.training.max_steps and not self.stopped:
                    step = self.step_or_recover(step)
                wall = time.perf_counter() - self.start_t
                if self.stopped or self.ckpt.last_saved == cfg.training.max_steps:
                    break
                # the finished run's weights (resume, export); --elastic goes back to the
                # boundary it restored when a rank is lost in this save
                step = self.save_or_recover(cfg.training.max_steps)
                if step > cfg.training.max_steps:
                    break
            if self.bar is not None:
                self.bar.close()
            self.ckpt.wait()
        sample = self.sample() if cfg.output.sample_tokens > 0 and not self.stopped else ""
        summary = self.summary(wall)
        self.write_outputs(summary, sample, wall)
        return summary

    def step_or_recover(self, step: int) -> int:
        """Take step ``step``; the next step to take (:class:`ElasticTrainer` recovers a lost
        rank here and goes on from the boundary it restored)."""
        self.take_step(step)
        return step + 1

    def save_or_recover(self, step: int) -> int:
        """The final checkpoint, after step ``step``; the next step to take (past the last one;
        :class:`ElasticTrainer`: the step after the boundary a recovery restored)."""
        self.save(step)
        return step + 1

    def save(self, step: int) -> None:
        """Checkpoint after ``step`` steps. A save that fails (a full disk, an error on any
        rank) ends the run with one message: nothing of it was left on disk, and the newest
        complete checkpoint resumes it."""
        from fullshard.checkpoint.store import CheckpointDiskFull, CheckpointSaveFailed

        try:
            self.ckpt.save(step)
        except CheckpointSaveFailed as exc:
            todo = (
                "free space there (or lower --keep, or --checkpoint-dir elsewhere)"
                if isinstance(exc, CheckpointDiskFull)
                else "fix the cause"
            )
            resume = f"then resume: {resume_hint()}" if exc.newest else "then run it again"
            raise RunStopped(f"{exc}. To go on, {todo}; {resume}") from None

    def stop_flag(self) -> torch.Tensor:
        """This rank's stop vote for the step (NOTE [Preemption]): a stop signal's number."""
        return self.signals.flag(self.device)

    def take_step(self, step: int) -> None:
        """One step and what follows it: a checkpoint, a logged line, a stop."""
        out, ck, last = self.cfg.output, self.cfg.checkpoint, self.cfg.training.max_steps
        self.before_step(step)
        poison = self.fault is not None and self.fault.at_step(step, self.rank, self.joining())
        is_eval = step == last or (out.eval_every > 0 and step % out.eval_every == 0)
        logged = step == 1 or step % out.log_every == 0 or is_eval
        save = ck.save_every > 0 and step % ck.save_every == 0
        stop_after = ck.stop_after > 0 and step - self.done >= ck.stop_after
        # NOTE [The step's verdict on the device]: which steps read their own verdict at once
        urgent = logged or save or stop_after or self.cfg.training.on_nonfinite == "stop"
        lr = self.decider.lr()
        bad = self.train_step(step, poison, urgent)
        self.state.step = step
        if save:
            self.save(step)
        self.stopped = self.book.preempted or (stop_after and step < last)
        if not bad and (logged or self.stopped):
            self.log_step(step, lr, is_eval)
        elif self.bar is not None:
            self.bar.update(1)
        if self.stopped:
            self.stop(step)

    def train_step(self, step: int, poison: bool, urgent: bool) -> bool:
        """Forward and backward of the step's micro-batches, the gradient norm, the ranks'
        votes, and the optimizer step as the decider decides it; whether the step is known now
        to have been skipped. ``poison``: the loss becomes NaN (a fault drill)."""
        model, device = self.state.model, self.device
        loss = self.batches.run(model, step, poison)  # on the device, read by the decider
        if self.scaler is not None:
            self.scaler.unscale_(self.state.optimizer)
        norm = gradient_norm(model.parameters(), fixed_order=self.batches.fixed_order)
        # Every precision votes: with fp16 the scaler's own vote decides skipping (it skips and
        # rescales), but the ranks must still agree on when to stop.
        votes = agree_step(loss, norm, self.stop_flag()).to(device)
        figures = torch.stack([loss, norm.detach().to(device, torch.float64).reshape(())])
        return self.decider.step(torch.cat([figures, votes]), norm, votes, step, urgent, self.book)

    # -- hooks of the loop (ElasticTrainer adds the step boundary's copies) -------------------
    def before_step(self, step: int) -> None:
        """The step boundary: where the runtime counts them (the CUDA emulation), the previous
        step's host syncs."""
        rt = runtime()
        syncs = rt.host_syncs()
        if syncs is not None:
            if step > self.done + 1:
                self.host_syncs[str(step - 1)] = syncs
            rt.reset_host_syncs()

    def joining(self) -> Any:
        """For the ``hold`` fault: whether a process waits to join (none without --elastic)."""
        return None

    # -- what a step leaves behind -----------------------------------------------------------
    def log_step(self, step: int, lr: Any, is_eval: bool) -> None:
        """A logged step: a few tiny collectives, on every rank."""
        cfg, book = self.cfg, self.book
        book.act(self.decider.verdicts.flush())  # a stop found a step late: this step's too
        mean_loss = self.batches.mean_loss(self.losses)
        self.losses.clear()
        mem = gather_memory(self.device)
        self.val_loss = self.batches.evaluate(self.state.model) if is_eval else None
        now = time.perf_counter()
        tok_s = self.tokens_per_step * (step - self.last_step) / (now - self.last_t)
        self.last_step, self.last_t = step, now
        self.first_loss = mean_loss if math.isnan(self.first_loss) else self.first_loss
        self.last_loss = mean_loss
        val = "" if self.val_loss is None else f" | val_loss {self.val_loss:.4f}"
        if self.log is not None:
            line = record(
                step,
                mean_loss,
                float(lr),
                book.grad_norm,
                tok_s,
                now - self.start_t,
                mem,
                self.val_loss,
            )
            self.log.write(line)
        if self.bar is not None and not self.bar.disable:
            self.bar.set_postfix_str(
                f"loss {mean_loss:.3f} | {tok_s:,.0f} tok/s | mem {format_mem(mem)}"
            )
            self.bar.update(1)
            if val:
                self.bar.write(f"step {step}: {val[3:]}")
        elif self.rank == 0:  # no bar on screen: a plain line per logged step
            line_text = log_line(step, cfg.training.max_steps, mean_loss, tok_s, format_mem(mem))
            print(line_text + val, flush=True)

    def stop(self, step: int) -> None:
        """``--stop-after``, or a stop signal: checkpoint (committed on every rank), then leave."""
        book = self.book
        if book.preempted and self.fault is not None:
            self.fault.at_preemption_save(self.rank)
        if self.ckpt.last_saved != step:
            self.save(step)
        self.ckpt.wait()  # committed (an async save too) before any rank leaves
        if self.rank == 0 and book.preempted:
            latest, name = self.ckpt.resolve("latest"), signal_name(book.stop)
            print(
                f"preempted after step {step} ({name}): checkpoint {latest} is complete; "
                f"exiting with status {PREEMPTED_EXIT}. Resume: the same command with "
                "--resume latest",
                flush=True,
            )
            write_marker(step, latest, name)
        elif self.rank == 0:
            print(f"stopped after step {step} (--stop-after); resume with --resume latest")

    def sample(self) -> str:
        """A sample of the trained model, the same on every rank (the same seeded generator
        and shapes: every forward gathers). Its context stays inside the positions trained
        (``--seq-len``): the model was never trained to read further back."""
        out = self.cfg.output
        gen = torch.Generator().manual_seed(self.cfg.training.seed)
        ids = self.data.tokenizer.encode(out.prompt) or [0]
        prompt = torch.tensor(ids, dtype=torch.long, device=self.device)
        top_k, context = out.top_k or None, self.cfg.data.seq_len
        model = self.state.model
        sampled = generate(
            model, prompt, out.sample_tokens, out.temperature, top_k, generator=gen, context=context
        )
        return str(self.data.tokenizer.decode(sampled.tolist()))

    def summary(self, wall: float) -> dict[str, Any]:
        cfg, step = self.cfg, self.state.step
        preempted = self.book.preempted
        summary = {
            "model": cfg.model.name,
            "params": self.n_params,
            "world_size": self.world,
            "strategy": cfg.parallelism.strategy,
            "deterministic": cfg.training.deterministic,
            "steps": cfg.training.max_steps,
            "stopped_after": step if self.stopped and not preempted else None,
            "preempted_after": step if preempted else None,
            "resumed_from": self.done or None,  # a checkpoint read from disk
            "skipped_nonfinite": self.state.skipped,
            "start_loss": self.first_loss,
            "end_loss": self.last_loss,
            "final_val_loss": self.val_loss,
            "train_wall_s": round(wall, 2),
            "tokens_per_s": round(self.tokens_per_step * (step - self.done) / wall, 1),
            "data_state": self.state.sampler.state_dict(),
            # torchrun's restarts of every rank (--max-restarts); --elastic's survivors go on
            "process_restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        }
        rt = runtime()
        syncs = rt.host_syncs()
        if syncs is not None:
            self.host_syncs[str(step)] = syncs  # with the final save
            summary["host_syncs_per_step"] = self.host_syncs
            # bytes torch filled in new tensors (deterministic mode; NOTE [Kernel contracts])
            summary["filled_bytes"] = rt.filled_bytes()
        return summary

    def write_outputs(self, summary: dict[str, Any], sample: str, wall: float) -> None:
        """Rank 0: summary.json, and for a finished run the loss plot, the sample and the
        closing lines."""
        import json

        if self.rank != 0 or self.run_dir is None or self.log is None:
            return
        self.log.close()
        text = json.dumps(summary, indent=2) + "\n"
        (self.run_dir / "summary.json").write_text(text, encoding="utf-8")
        if summary["preempted_after"] is not None:  # the one line is out: the run goes on later
            return
        cfg = self.cfg
        title = f"{cfg.model.name} on {self.world} ranks ({cfg.parallelism.strategy})"
        plot_losses(self.log.records, self.run_dir / "loss.png", title)
        (self.run_dir / "sample.txt").write_text(sample, encoding="utf-8")
        val = self.val_loss if self.val_loss is None else round(self.val_loss, 4)
        print(
            f"done: steps {self.done + 1}-{self.state.step} in {wall:.1f}s, loss "
            f"{self.first_loss:.3f} -> {self.last_loss:.3f}, val {val}, "
            f"{summary['tokens_per_s']:,.0f} tokens/s",
            flush=True,
        )
        if sample:
            print(f"--- sample ---\n{sample}\n--------------", flush=True)
        print(f"run folder: {self.run_dir}", flush=True)
