"""The training loop of ``fullshard train``: one process per rank, started by torchrun.

Order matters for "errors on every rank, never a hang": everything that can fail on bad input
(config, data, model) happens before the first collective, computed identically on every rank.

On a GPU the host must run ahead of the device: a training step reads device values on the host
once (loss, gradient norm and the non-finite vote, in one ``.tolist()`` before the optimizer
step, which needs the verdict). Logged steps read a little more (metrics, memory).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import time
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn

from fullshard import ShardedGradScaler
from fullshard.app.config import TrainConfig, to_toml
from fullshard.app.data.corpus import (
    RankBatches,
    build_tokenizer,
    eval_batches,
    load_tokens,
    split_for_rank,
)
from fullshard.app.dims import ParallelDims
from fullshard.app.errors import ConfigError
from fullshard.app.launch.local import DistInfo, rank_session
from fullshard.app.launch.preempt import (
    PREEMPTED_EXIT,
    StopSignals,
    clear_marker,
    signal_name,
    write_marker,
)
from fullshard.app.models.gpt import (
    generate,
    lm_loss,
)
from fullshard.app.train import elastic as elastic_run
from fullshard.app.train.build import RankBuild, build_rank, lr_lambda, param_groups, to_device
from fullshard.app.train.faults import NonFiniteError, agree_step, fault_from_env
from fullshard.app.train.monitor import (
    MetricsLog,
    format_mem,
    gather_memory,
    make_run_dir,
    plot_losses,
)
from fullshard.app.train.state import TrainCheckpoints
from fullshard.app.train.verdict import (
    DeviceSchedule,
    StepBook,
)
from fullshard.comm import control
from fullshard.testing import emulation

__all__ = ["log_line", "lr_lambda", "param_groups", "progress_bar", "to_device", "train"]


def _save(ckpt: TrainCheckpoints, step: int, dsched: DeviceSchedule | None) -> None:
    """Checkpoint after ``step``; a device schedule's state is read first (one host read)."""
    if dsched is None:
        ckpt.save(step)
        return
    with dsched.as_floats():
        ckpt.save(step)


def _accumulate(
    model: nn.Module,
    sampler: RankBatches,
    grad_accum: int,
    device: torch.device,
    scaler: ShardedGradScaler | None,
    poison: bool,
) -> torch.Tensor:
    """The default step's forward and backward: ``grad_accum`` micro-batches of this rank's
    sampler, the gradients reduce-scattered only on the last (earlier ones accumulate into the
    unsharded gradients locally). Returns the rank's mean loss, on the device: no
    per-micro-batch ``float(loss)`` stalls the host."""
    from fullshard.app.models.wrap import set_gradient_sync

    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for k in range(grad_accum):
        set_gradient_sync(model, k == grad_accum - 1)
        x, y = sampler.next_batch()
        loss = lm_loss(model, to_device(x, device), to_device(y, device)) / grad_accum
        if poison:
            loss = loss * float("nan")
        (scaler.scale(loss) if scaler is not None else loss).backward()
        loss_sum += loss.detach().double()
    return loss_sum


@torch.no_grad()
def evaluate(model: nn.Module, batches: list, device: torch.device) -> float | None:
    """Mean validation loss over every rank's batches (an all_reduce: call on all ranks)."""
    if not batches:
        return None
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in batches:
        total[0] += lm_loss(model, to_device(x, device), to_device(y, device)).double()
        total[1] += 1
    model.train()
    loss_sum, count = control.all_reduce_values(total, what="validation loss all-reduce").tolist()
    return loss_sum / count


def _global_mean(values: list[float]) -> float:
    total = control.all_reduce_values([sum(values), len(values)], what="loss all-reduce")
    loss_sum, count = total.tolist()
    return float(loss_sum / count)


def progress_bar(total: int, initial: int, enabled: bool, file: TextIO | None = None) -> Any:
    """The rank-0 progress bar, or ``None`` when ``enabled`` is false.

    ``disable=None`` is tqdm's "only on a terminal": redirected to a log file (or under a
    launcher that pipes it), a bar would write one line per update; the plain log lines of
    :func:`log_line` say the same on each logged step instead.
    """
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(
        total=total, initial=initial, unit="step", dynamic_ncols=True, disable=None, file=file
    )


def log_line(step: int, total: int, loss: float, tok_s: float, mem: str) -> str:
    """One logged step as plain text (what the progress bar shows, for logs and pipes)."""
    return f"step {step}/{total}: loss {loss:.4f} | {tok_s:,.0f} tok/s | mem {mem}"


def _sharding_options(cfg: TrainConfig) -> str:
    """The run line's words for --reshard-after-forward and --cpu-offload ('' when unset)."""
    words = ""
    if cfg.reshard_after_forward is not None:
        words += f", --reshard-after-forward {cfg.reshard_after_forward} for the blocks"
    return words + (", CPU offload" if cfg.cpu_offload else "")


def train(cfg: TrainConfig, dims: ParallelDims | None = None) -> dict[str, Any]:
    """Run one training job on this rank; returns the run summary (on every rank).

    ``cfg`` was validated (``fullshard.app.commands.validate.validate_train``, before launch); ``dims``:
    the run's parallel dimensions (default: from torchrun's environment and ``cfg``).
    """
    if dims is None:
        dims = ParallelDims.from_env(
            cfg.nproc, tp=cfg.tp, strategy=cfg.strategy, shard_size=cfg.shard_size
        )
    if cfg.deterministic:  # read when cuBLAS starts: before any CUDA work of this rank
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    tokenizer = build_tokenizer(cfg.tokenizer)
    tokens = load_tokens(cfg.data, tokenizer)  # a prepared folder is memory-mapped, not read
    session: Any
    if cfg.elastic:  # its launcher's store and generations (fullshard.app.train.elastic)
        session = elastic_run.elastic_session(cfg, dims)
    else:
        session = rank_session(cfg.device, cfg.timeout, cfg.backend)
    with session as joined:
        info, mgr = joined if cfg.elastic else (joined, None)
        # FULLSHARD_CUDA_EMULATION=1: the whole run takes its CUDA path on CPU, checked
        # (fullshard.testing.cuda_emulation), and summary.json counts host syncs per step
        checked = emulation.enabled_from_env()
        with emulation.cuda_emulation(all_device=True) if checked else contextlib.nullcontext():
            return _train(cfg, dims, info, tokenizer, tokens, mgr)


def _train(
    cfg: TrainConfig,
    dims: ParallelDims,
    info: DistInfo,
    tokenizer: Any,
    tokens: Any,
    mgr: Any = None,  # fullshard.elastic.Manager under --elastic
) -> dict[str, Any]:
    rank, world, device = info.rank, info.world_size, info.device
    if mgr is not None:  # the membership this process joined sets the world
        dims = elastic_run.dims_at(dims, world)
    if device.type == "cpu":
        torch.set_num_threads(cfg.threads)
    micro = cfg.micro_batch(dims.dp)
    # data parallel rank: the --tp consecutive ranks of one TP group read the same batches
    dp_rank, dp = dims.dp_rank(rank), dims.dp
    if cfg.global_sampler:  # (fullshard.app.train.fixed_order)
        train_tokens, val_tokens = split_for_rank(tokens, 0, 1, cfg.val_fraction)
        sampler = RankBatches(
            train_tokens, cfg.seq_len, cfg.batch_size, seed=cfg.seed, rank=0,
            world_independent=True,
        )  # fmt: skip
    else:
        train_tokens, val_tokens = split_for_rank(tokens, dp_rank, dp, cfg.val_fraction)
        sampler = RankBatches(train_tokens, cfg.seq_len, micro, seed=cfg.seed, rank=dp_rank)
        val = eval_batches(val_tokens, cfg.seq_len, micro, cfg.eval_batches)

    from fullshard.app.models.wrap import clip_gradients, gradient_norm

    b = build_rank(cfg, dims, tokenizer, rank, world, device, val_tokens)
    model, plan, fixed, opt, sched = b.model, b.plan, b.fixed, b.opt, b.sched
    dsched, verdicts, scaler, n_params = b.dsched, b.verdicts, b.scaler, b.n_params
    if fixed is not None:
        val, val_count = b.val, b.val_count

    run_dir: Path | None = None
    log: MetricsLog | None = None
    bar = None
    skipped: list[int] = []
    joiner = mgr is not None and mgr.membership.joined_now
    if joiner:  # a replacement: the run's folder, and its state from its peers (in memory)
        run_dir = Path(mgr.jobs.note(elastic_run.RUN_DIR))
        folder = cfg.checkpoint_dir or str(run_dir / "checkpoints")
        state, done = elastic_run.join_restore(mgr, model, opt, folder)
        elastic_run.apply_loop_state(state, sched, sampler, skipped, dsched)
        resume = None
    else:
        if mgr is not None:  # generation 0's processes, for summary.json
            pids = control.all_gather_objects(os.getpid())
        if rank == 0:
            run_dir = make_run_dir(cfg.runs_dir, cfg.name)
            if mgr is not None:
                mgr.jobs.set_note(elastic_run.RUN_DIR, str(run_dir))
                mgr.jobs.set_note("pids_at_start", json.dumps(pids))
        # every rank needs the same checkpoint folder: rank 0 named the run folder
        folder = control.broadcast_object(
            cfg.checkpoint_dir or str((run_dir or Path()) / "checkpoints")
        )
    ckpt = TrainCheckpoints(
        folder, model, opt, sched, sampler, keep=cfg.keep, async_save=cfg.async_save
    )
    if not joiner:
        resume = cfg.resume
        if resume is None and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
            # restarted by torchrun after a failure: continue from the last complete checkpoint
            resume = "latest" if ckpt.resolve("latest") is not None else None
        done = ckpt.resume(resume) if resume is not None else 0
    if rank == 0 and not joiner:  # after a resume that worked: a failed one leaves the config
        assert run_dir is not None
        (run_dir / "config.toml").write_text(to_toml(cfg), encoding="utf-8")
    if dsched is not None:
        dsched.reload()  # the loaded optimizer holds float learning rates again
    fault = fault_from_env()
    if rank == 0 and joiner:
        assert run_dir is not None
        log = MetricsLog(run_dir / "metrics.jsonl", append=True)
    elif rank == 0:
        assert run_dir is not None
        log = MetricsLog(run_dir / "metrics.jsonl", append=done > 0)
        if done:
            print(f"resumed from step {done} ({ckpt.resolve(resume or '')})", flush=True)
        print(
            f"fullshard train: {cfg.model} ({n_params / 1e6:.2f}M params), {world} ranks "
            f"({info.backend}), {plan.summary()}"
            + (f", tensor parallel over {cfg.tp} ranks" if cfg.tp > 1 else "")
            + _sharding_options(cfg)
            + f", {len(tokens):,} tokens "
            + (
                f"({len(train_tokens):,} train per rank), micro-batch {micro} x {cfg.seq_len}, "
                f"grad-accum {cfg.grad_accum}"
                if fixed is None
                else f"({len(train_tokens):,} train, one global sampler), "
                + fixed.describe(cfg.seq_len)
            )
            + f" -> run folder {run_dir}",
            flush=True,
        )
        bar = progress_bar(cfg.max_steps, done, cfg.progress)

    tokens_per_step = cfg.batch_size * cfg.seq_len
    losses: list[float] = []
    start = last_t = time.perf_counter()
    last_step, first_loss, last_loss, val_loss = done, float("nan"), float("nan"), None
    stopped = preempted = False
    book = StepBook(cfg, rank, scaler is None, log, losses, skipped)
    if rank == 0:
        clear_marker()  # this attempt trains on: an earlier attempt's preemption is over
    # NOTE [Preemption]: from here on a stop signal only sets a flag, which the step votes on
    host_syncs: dict[str, int] = {}  # under the CUDA emulation: step -> host syncs counted
    step = done + 1
    with StopSignals() as signals:
        while step <= cfg.max_steps:
            try:
                if mgr is not None:  # the step boundary: ring copies (fullshard.elastic)
                    state = elastic_run.loop_state(sched, sampler, skipped, dsched)
                    mgr.snapshot(step - 1, model, opt, state)
                if emulation.is_active():
                    if step > done + 1:
                        host_syncs[str(step - 1)] = sum(emulation.sync_counts().values())
                    emulation.reset_sync_counts()
                joining = None if mgr is None else mgr.join_waiting_or_whole
                poison = fault.at_step(step, rank, joining) if fault is not None else False
                # The step's figures (loss, gradient norm, votes) stay on the device until the
                # step's one read below: no per-micro-batch float(loss) stalls the host.
                if fixed is not None:  # every micro-batch reduces, in the fixed tree
                    loss_sum = fixed.step(model, step, sampler.next_batch(), poison)
                else:
                    loss_sum = _accumulate(model, sampler, cfg.grad_accum, device, scaler, poison)
                if scaler is not None:
                    scaler.unscale_(opt)
                norm = gradient_norm(model.parameters(), fixed_order=fixed is not None)
                figures = torch.stack(
                    [loss_sum, norm.detach().to(device, torch.float64).reshape(())]
                )
                # Every precision votes: with fp16 the scaler's own vote decides skipping (it skips
                # and rescales), but the ranks must still agree on when to stop.
                votes = agree_step(loss_sum, norm, signals.flag(device)).to(device)
                row = torch.cat([figures, votes])
                is_eval = step == cfg.max_steps or (
                    cfg.eval_every > 0 and step % cfg.eval_every == 0
                )
                # NOTE [The step's verdict on the device]: which steps read their own row at once
                urgent = (
                    step == 1
                    or step % cfg.log_every == 0
                    or is_eval
                    or (cfg.save_every > 0 and step % cfg.save_every == 0)
                    or (cfg.stop_after > 0 and step - done >= cfg.stop_after)
                    or cfg.on_nonfinite == "stop"
                )
                lr = sched.get_last_lr()[0] if dsched is None else dsched.lrs[0].clone()
                if dsched is not None:  # the device decides: skipped there, schedule included
                    clip_gradients(model.parameters(), cfg.clip, norm)
                    if scaler is not None:
                        scaler.step(opt)
                        scaler.update()
                    else:
                        opt.found_inf = votes[0].float()  # type: ignore[attr-defined]
                        opt.step()
                    opt.zero_grad(set_to_none=True)
                    dsched.step(1.0 - votes[0] if scaler is None else torch.ones_like(votes[0]))
                bad = book.act(verdicts.push(step, row, now=urgent))
                # this step's own verdict is known now on CPU, and on urgent steps on the device
                bad = bad and (urgent or verdicts.lag == 0)
                preempted = book.preempted
                if dsched is None:  # the host decides, with the norm it has read
                    if scaler is not None or not bad:
                        clip_gradients(model.parameters(), cfg.clip, book.grad_norm)
                    if scaler is not None:
                        scaler.step(opt)
                        scaler.update()
                    elif not bad:
                        opt.step()
                    opt.zero_grad(set_to_none=True)
                    if not bad:  # a skipped step leaves the schedule where it was, too
                        sched.step()

                if cfg.save_every > 0 and step % cfg.save_every == 0:
                    _save(ckpt, step, dsched)
                stopped = preempted or (
                    cfg.stop_after > 0 and step - done >= cfg.stop_after and step < cfg.max_steps
                )
                if bad or not (step == 1 or step % cfg.log_every == 0 or is_eval or stopped):
                    if bar is not None:
                        bar.update(1)
                else:
                    # Logged step: a few tiny collectives, on every rank.
                    book.act(verdicts.flush())  # a stop found a step late: this step's row too
                    lr, grad_norm = float(lr), book.grad_norm
                    # fixed order: each step's loss is the same global figure on every rank already
                    mean_loss = (
                        _global_mean(losses)
                        if fixed is None
                        else sum(losses) / len(losses)
                        if losses
                        else float("nan")
                    )
                    losses.clear()
                    mem = gather_memory(device)
                    val_loss = None
                    if is_eval:
                        val_loss = (
                            evaluate(model, val, device)
                            if fixed is None
                            else fixed.evaluate(model, val, val_count)
                        )
                    now = time.perf_counter()
                    tok_s = tokens_per_step * (step - last_step) / (now - last_t)
                    last_step, last_t = step, now
                    first_loss = mean_loss if math.isnan(first_loss) else first_loss
                    last_loss = mean_loss
                    if log is not None:
                        log.write(
                            _record(
                                step, mean_loss, lr, grad_norm, tok_s, now - start, mem, val_loss
                            )
                        )
                    if bar is not None and not bar.disable:
                        bar.set_postfix_str(
                            f"loss {mean_loss:.3f} | {tok_s:,.0f} tok/s | mem {format_mem(mem)}"
                        )
                        bar.update(1)
                        if val_loss is not None:
                            bar.write(f"step {step}: val_loss {val_loss:.4f}")
                    elif rank == 0:  # no bar on screen: a plain line per logged step
                        line = log_line(step, cfg.max_steps, mean_loss, tok_s, format_mem(mem))
                        print(
                            line + ("" if val_loss is None else f" | val_loss {val_loss:.4f}"),
                            flush=True,
                        )
                if stopped:  # --stop-after, or a stop signal: checkpoint, then leave
                    if preempted and fault is not None:
                        fault.at_preemption_save(rank)
                    if ckpt.last_saved != step:
                        _save(ckpt, step, dsched)
                    ckpt.wait()  # committed (an async save too) before any rank leaves
                    if rank == 0 and preempted:
                        _report_preemption(step, ckpt.resolve("latest"), signal_name(book.stop))
                    elif rank == 0:
                        print(
                            f"stopped after step {step} (--stop-after); resume with --resume latest"
                        )
                    break
            except Exception as exc:
                if mgr is None or isinstance(exc, (ConfigError, NonFiniteError)):
                    raise  # not a lost rank: bad input, or --on-nonfinite stop

                def rebuild(m: Any) -> tuple[nn.Module, torch.optim.Optimizer, RankBuild]:
                    new_dims = elastic_run.dims_at(dims, m.world)
                    built = build_rank(
                        cfg, new_dims, tokenizer, m.rank, m.world, device, val_tokens
                    )
                    return built.model, built.opt, built

                newest = functools.partial(ckpt.resolve, "latest")
                m, b, state, done_b = elastic_run.recover(mgr, exc, rebuild, newest)
                rank, world = m.rank, m.world
                model, plan, fixed, opt, sched = b.model, b.plan, b.fixed, b.opt, b.sched
                dsched, verdicts, scaler = b.dsched, b.verdicts, b.scaler
                val, val_count = b.val, b.val_count
                elastic_run.apply_loop_state(state, sched, sampler, skipped, dsched)
                ckpt = TrainCheckpoints(
                    folder, model, opt, sched, sampler, keep=cfg.keep, async_save=cfg.async_save
                )
                if rank == 0 and log is None:  # rank 0 was lost: the log moves here
                    run_dir = Path(mgr.jobs.note(elastic_run.RUN_DIR))
                    log = MetricsLog(run_dir / "metrics.jsonl", append=True)
                elif rank != 0 and log is not None:  # no longer rank 0 (left out, back later)
                    log.close()
                    log = None
                losses.clear()  # the steps since the boundary are redone (and logged again)
                book = StepBook(cfg, rank, scaler is None, log, losses, skipped)
                step = done_b + 1
                last_step, last_t = done_b, time.perf_counter()
                if rank == 0:
                    print(f"elastic: {mgr.changes[-1]}", flush=True)
                continue
            step += 1
        step = min(step, cfg.max_steps)
        wall = time.perf_counter() - start
        if bar is not None:
            bar.close()
        if not stopped and ckpt.last_saved != cfg.max_steps:
            # the finished run's weights: resume, convert or export them
            _save(ckpt, cfg.max_steps, dsched)
        ckpt.wait()

    sample = ""
    if cfg.sample_tokens > 0 and not stopped:
        # Same generator seed on every rank: identical samples, identical forward shapes.
        gen = torch.Generator().manual_seed(cfg.seed)
        prompt = torch.tensor(tokenizer.encode(cfg.prompt) or [0], dtype=torch.long, device=device)
        out = generate(
            model, prompt, cfg.sample_tokens, cfg.temperature, cfg.top_k or None, generator=gen
        )
        sample = tokenizer.decode(out.tolist())

    summary = {
        "model": cfg.model,
        "params": n_params,
        "world_size": world,
        "strategy": cfg.strategy,
        "deterministic": cfg.deterministic,
        "steps": cfg.max_steps,
        "stopped_after": step if stopped and not preempted else None,
        "preempted_after": step if preempted else None,
        "resumed_from": None if joiner else done or None,  # a checkpoint read from disk
        "skipped_nonfinite": skipped,
        "start_loss": first_loss,
        "end_loss": last_loss,
        "final_val_loss": val_loss,
        "train_wall_s": round(wall, 2),
        "tokens_per_s": round(tokens_per_step * (step - done) / wall, 1),
        "data_state": sampler.state_dict(),
        # torchrun's restarts of every rank (--max-restarts); --elastic's survivors keep running
        "process_restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
    }
    if mgr is not None:  # one entry per membership change, and who is in the last one
        summary["membership"] = mgr.changes
        summary["pids_at_start"] = json.loads(mgr.jobs.note("pids_at_start") or "[]")
        summary["pids"] = control.all_gather_objects(os.getpid())
        summary["elastic_copy_s"] = round(mgr.snapshot_s, 3)
        summary["elastic_copy_bytes"] = mgr.copy_bytes  # own + neighbour's, one boundary
    if emulation.is_active():
        host_syncs[str(step)] = sum(emulation.sync_counts().values())  # with the final save
        summary["host_syncs_per_step"] = host_syncs
        # bytes torch filled in new tensors (deterministic mode's fill; NOTE [Kernel contracts])
        summary["filled_bytes"] = sum(emulation.fill_counts().values())
    if rank == 0 and run_dir is not None and log is not None:
        log.close()
        (run_dir / "summary.json").write_text(
            json.dumps(summary, indent=2) + "\n", encoding="utf-8"
        )
        if preempted:  # the one line is out; no plot, no sample: the run is not finished
            return summary
        plot_losses(
            log.records, run_dir / "loss.png", f"{cfg.model} on {world} ranks ({cfg.strategy})"
        )
        (run_dir / "sample.txt").write_text(sample, encoding="utf-8")
        print(
            f"done: steps {done + 1}-{step} in {wall:.1f}s, loss {first_loss:.3f} -> {last_loss:.3f}, "
            f"val {val_loss if val_loss is None else round(val_loss, 4)}, "
            f"{summary['tokens_per_s']:,.0f} tokens/s",
            flush=True,
        )
        if sample:
            print(f"--- sample ---\n{sample}\n--------------", flush=True)
        print(f"run folder: {run_dir}", flush=True)
    return summary


def _record(
    step: int,
    loss: float,
    lr: Any,  # what the scheduler holds: a float (a tensor for capturable optimizers)
    grad_norm: float,
    tok_s: float,
    elapsed: float,
    mem: dict[str, Any],
    val_loss: float | None,
) -> dict[str, Any]:
    """One logged step's line of metrics.jsonl."""
    record: dict[str, Any] = {
        "step": step,
        "loss": round(loss, 5),
        "lr": lr,
        "grad_norm": round(grad_norm, 5),
        "tokens_per_s": round(tok_s, 1),
        "elapsed_s": round(elapsed, 2),
        "mem_mib": mem["rss_mib"],
    }
    if "cuda_peak_mib" in mem:
        record["cuda_peak_mib"] = mem["cuda_peak_mib"]
    if val_loss is not None:
        record["val_loss"] = round(val_loss, 5)
    return record


def _report_preemption(step: int, checkpoint: str | None, signal: str) -> None:
    """Rank 0's one line about a preemption, and the marker its launcher reads."""
    print(
        f"preempted after step {step} ({signal}): checkpoint {checkpoint} is complete; exiting with "
        f"status {PREEMPTED_EXIT}. Resume: the same command with --resume latest",
        flush=True,
    )
    write_marker(step, checkpoint, signal)
