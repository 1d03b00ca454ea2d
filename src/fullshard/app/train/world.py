"""The world sizes a run can take: its global batch split into whole micro-batches over the
data-parallel ranks, the hybrid strategies' shard group, and ``--reshard-after-forward``'s
smaller group inside it (:func:`check_world`).

``fullshard train``'s validation asks them once before launch (``fullshard.app.commands.train``);
``--elastic`` asks them of every world a membership could move to (``elastic.world_rules``), so
that a job never re-forms at a world its batch or its sharding cannot take.
"""

from __future__ import annotations

from fullshard.app.config import ParallelismConfig, TrainConfig, reshard_after_forward_arg
from fullshard.app.dims import ParallelDims
from fullshard.app.errors import ConfigError

__all__ = ["check_world", "micro_batches"]


def check_world(cfg: TrainConfig, dims: ParallelDims) -> None:
    """The checks that depend on the world size: the batch splits over it, the hybrid shard
    group and ``--reshard-after-forward`` fit it."""
    _check_batch(cfg, dims)
    if dims.hybrid:
        dims.checked_shard_group()
    _check_reshard_after_forward(cfg.parallelism, dims)


def _check_batch(cfg: TrainConfig, dims: ParallelDims) -> None:
    """``--tp`` divides the world, and the global batch divides into whole micro-batches."""
    world, tp, t = dims.world, cfg.parallelism.tp, cfg.training
    if world % tp:
        raise ConfigError(
            f"--tp {tp} does not divide the {world} ranks: each data-parallel rank needs {tp} "
            f"ranks for tensor parallel; use --nproc {tp * max(1, dims.dp)}"
        )
    if t.deterministic:
        _check_deterministic(cfg, dims)
        return
    if cfg.launch.elastic:
        _check_global_batch(cfg, dims)
        return
    per_step = dims.dp * t.grad_accum
    if t.batch_size % per_step != 0:
        lower = max(per_step, t.batch_size - t.batch_size % per_step)
        raise ConfigError(
            f"--batch-size {t.batch_size} (global) is not divisible by world size {world} "
            + (f"/ --tp {tp} " if tp > 1 else "")
            + f"x --grad-accum {t.grad_accum} = {per_step}: every rank needs the same whole "
            f"number of sequences per micro-batch. Use e.g. --batch-size {lower} or "
            f"{lower + per_step}."
        )


def micro_batches(cfg: TrainConfig, dims: ParallelDims, flag: str) -> int:
    """The global sampler's micro-batch (``--deterministic``, ``--elastic``): set by
    ``--micro-batch-size``, not ``--grad-accum``, and dividing the global batch."""
    t = cfg.training
    if t.grad_accum != 1:
        raise ConfigError(
            f"{flag} sets the micro-batches with --micro-batch-size, not --grad-accum "
            f"{t.grad_accum}: each rank runs --batch-size / (--micro-batch-size x ranks) of "
            "them; drop --grad-accum"
        )
    micro = cfg.micro_batch(dims.dp)
    if micro < 1 or t.batch_size % micro:
        raise ConfigError(
            f"--micro-batch-size {t.micro_batch_size} does not divide --batch-size "
            f"{t.batch_size}: the global batch is cut into micro-batches of one size"
        )
    return micro


def _check_global_batch(cfg: TrainConfig, dims: ParallelDims) -> None:
    """``--elastic`` without ``--deterministic``: the global batch is cut into micro-batches of
    ``--micro-batch-size``, the same number on every rank."""
    micro = micro_batches(cfg, dims, "--elastic")
    batch = cfg.training.batch_size
    count = batch // micro
    if count % dims.world:
        worlds = ", ".join(str(w) for w in range(1, count + 1) if count % w == 0)
        raise ConfigError(
            f"--elastic on {dims.world} ranks: --batch-size {batch} in micro-batches of "
            f"{micro} is {count}, which split evenly over {worlds} ranks: run on one of those"
        )


def _check_deterministic(cfg: TrainConfig, dims: ParallelDims) -> None:
    """``--deterministic``: what fixed-order mode supports, and a world size whose micro-steps
    are subtrees of the fixed tree (``fullshard.deterministic.MicroBatches``), else the world
    sizes that are."""
    p = cfg.parallelism
    for flag, on in (("--tp", p.tp > 1), ("--float8", p.float8)):
        if on:
            raise ConfigError(f"--deterministic with {flag} is not supported: drop one of them")
    if p.mixed_precision == "fp16":
        raise ConfigError(
            "--deterministic with --mixed-precision fp16 is not supported (its loss scale is a "
            "per-run state the fixed order does not cover): use bf16 or none"
        )
    micro = micro_batches(cfg, dims, "--deterministic")
    from fullshard.deterministic import MicroBatches

    batch = cfg.training.batch_size
    plan = MicroBatches(batch, micro)
    if dims.world not in plan.world_sizes():
        sizes = ", ".join(map(str, plan.world_sizes()))
        world = dims.world
        more = (
            f", or a --batch-size / --micro-batch-size that is a multiple of {world}"
            if world & (world - 1) == 0
            else " (a power of two)"
        )
        raise ConfigError(
            f"--deterministic on {world} ranks: --batch-size {batch} in "
            f"micro-batches of {micro} is {plan.count}, which give the same bits on {sizes} "
            f"ranks (powers of two dividing {plan.chunk}): run on one of those{more}"
        )


def _check_reshard_after_forward(p: ParallelismConfig, dims: ParallelDims) -> None:
    """``--reshard-after-forward`` is true, false or a number of ranks the blocks' shard group
    can be split into, and (a number other than 1 or the group size: resharding to a smaller
    group) not combined with what cannot reshard that way. The ranks' ``fully_shard`` applies
    the same rules (``fullshard.engine.api``); here they come before launch, in flag words."""
    value = reshard_after_forward_arg(p.reshard_after_forward)
    if value is None or isinstance(value, bool):
        return
    # the ranks one parameter is split over (``ShardingPlan.shard_size``)
    group = dims.checked_shard_group()
    if group % value:
        sizes = ", ".join(str(d) for d in range(1, group + 1) if group % d == 0)
        what = f"{dims.world} ranks" + (f" / --tp {p.tp}" if p.tp > 1 else "")
        ends = f" (1 is false, {group} is true)" if group > 1 else " (1 is false)"
        raise ConfigError(
            f"--reshard-after-forward {value} does not divide the shard group of {group} "
            f"rank{'s' if group > 1 else ''} ({p.strategy} on {what}): N must divide it; "
            f"use one of {sizes}{ends}, or true / false"
        )
    if value in (1, group):
        return
    cannot = {
        "--tp": (p.tp > 1, "tensor-parallel parameters cannot"),
        "--float8": (p.float8, "float8 weights (gathered through all-gather hooks) cannot"),
    }
    for flag, (on, why) in cannot.items():
        if on:
            raise ConfigError(
                f"--reshard-after-forward {value} with {flag}: {why} reshard to a smaller group "
                f"(nor in torch FSDP2): use --reshard-after-forward true or false, or drop {flag}"
            )
