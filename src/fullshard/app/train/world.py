"""The world sizes a run can take: its global batch split into whole micro-batches over the
data-parallel ranks, the hybrid strategies' shard group, and ``--reshard-after-forward``'s
smaller group inside it (:func:`check_world`).

``fullshard train``'s validation asks them once before launch (``fullshard.app.commands.train``);
``--elastic`` asks them of every world a membership could move to (``elastic.world_rules``), so
that a job never re-forms at a world its batch or its sharding cannot take.
"""

from __future__ import annotations

from fullshard.app.config import TrainConfig, reshard_after_forward_arg
from fullshard.app.dims import ParallelDims
from fullshard.app.errors import ConfigError

__all__ = ["check_world", "micro_batches"]


def check_world(cfg: TrainConfig, dims: ParallelDims) -> None:
    """The checks that depend on the world size: the batch splits over it, the hybrid shard
    group and ``--reshard-after-forward`` fit it."""
    _check_batch(cfg, dims)
    if dims.hybrid:
        dims.checked_shard_group()
    _check_reshard_after_forward(cfg, dims)


def _check_batch(cfg: TrainConfig, dims: ParallelDims) -> None:
    """``--tp`` divides the world, and the global batch divides into whole micro-batches."""
    world = dims.world
    if world % cfg.tp:
        raise ConfigError(
            f"--tp {cfg.tp} does not divide the {world} ranks: each data-parallel rank needs "
            f"{cfg.tp} ranks for tensor parallel; use --nproc {cfg.tp * max(1, dims.dp)}"
        )
    if cfg.deterministic:
        _check_deterministic(cfg, dims)
        return
    if cfg.elastic:
        _check_global_batch(cfg, dims)
        return
    per_step = dims.dp * cfg.grad_accum
    if cfg.batch_size % per_step != 0:
        lower = max(per_step, cfg.batch_size - cfg.batch_size % per_step)
        raise ConfigError(
            f"--batch-size {cfg.batch_size} (global) is not divisible by world size {world} "
            + (f"/ --tp {cfg.tp} " if cfg.tp > 1 else "")
            + f"x --grad-accum {cfg.grad_accum} = {per_step}: every rank needs the same whole "
            f"number of sequences per micro-batch. Use e.g. --batch-size {lower} or "
            f"{lower + per_step}."
        )


def micro_batches(cfg: TrainConfig, dims: ParallelDims, flag: str) -> int:
    """The global sampler's micro-batch (``--deterministic``, ``--elastic``): set by
    ``--micro-batch-size``, not ``--grad-accum``, and dividing the global batch."""
    if cfg.grad_accum != 1:
        raise ConfigError(
            f"{flag} sets the micro-batches with --micro-batch-size, not --grad-accum "
            f"{cfg.grad_accum}: each rank runs --batch-size / (--micro-batch-size x ranks) of "
            "them; drop --grad-accum"
        )
    micro = cfg.micro_batch(dims.dp)
    if micro < 1 or cfg.batch_size % micro:
        raise ConfigError(
            f"--micro-batch-size {cfg.micro_batch_size} does not divide --batch-size "
            f"{cfg.batch_size}: the global batch is cut into micro-batches of one size"
        )
    return micro


def _check_global_batch(cfg: TrainConfig, dims: ParallelDims) -> None:
    """``--elastic`` without ``--deterministic``: the global batch is cut into micro-batches of
    ``--micro-batch-size``, the same number on every rank."""
    micro = micro_batches(cfg, dims, "--elastic")
    count = cfg.batch_size // micro
    if count % dims.world:
        worlds = ", ".join(str(w) for w in range(1, count + 1) if count % w == 0)
        raise ConfigError(
            f"--elastic on {dims.world} ranks: --batch-size {cfg.batch_size} in micro-batches of "
            f"{micro} is {count}, which split evenly over {worlds} ranks: run on one of those"
        )


def _check_deterministic(cfg: TrainConfig, dims: ParallelDims) -> None:
    """``--deterministic``: what fixed-order mode supports, and a world size whose micro-steps
    are subtrees of the fixed tree (``fullshard.deterministic.MicroBatches``), else the world
    sizes that are."""
    for flag, on in (("--tp", cfg.tp > 1), ("--float8", cfg.float8)):
        if on:
            raise ConfigError(f"--deterministic with {flag} is not supported: drop one of them")
    if cfg.mixed_precision == "fp16":
        raise ConfigError(
            "--deterministic with --mixed-precision fp16 is not supported (its loss scale is a "
            "per-run state the fixed order does not cover): use bf16 or none"
        )
    micro = micro_batches(cfg, dims, "--deterministic")
    from fullshard.deterministic import MicroBatches

    plan = MicroBatches(cfg.batch_size, micro)
    if dims.world not in plan.world_sizes():
        sizes = ", ".join(map(str, plan.world_sizes()))
        world = dims.world
        more = (
            f", or a --batch-size / --micro-batch-size that is a multiple of {world}"
            if world & (world - 1) == 0
            else " (a power of two)"
        )
        raise ConfigError(
            f"--deterministic on {world} ranks: --batch-size {cfg.batch_size} in "
            f"micro-batches of {micro} is {plan.count}, which give the same bits on {sizes} "
            f"ranks (powers of two dividing {plan.chunk}): run on one of those{more}"
        )


def _check_reshard_after_forward(cfg: TrainConfig, dims: ParallelDims) -> None:
    """``--reshard-after-forward`` is true, false or a number of ranks the blocks' shard group
    can be split into, and (a number other than 1 or the group size: resharding to a smaller
    group) not combined with what cannot reshard that way. The ranks' ``fully_shard`` applies
    the same rules (``fullshard.engine.api``); here they come before launch, in flag words."""
    value = reshard_after_forward_arg(cfg.reshard_after_forward)
    if value is None or isinstance(value, bool):
        return
    # the ranks one parameter is split over (``ShardingPlan.shard_size``)
    group = dims.checked_shard_group()
    if group % value:
        sizes = ", ".join(str(d) for d in range(1, group + 1) if group % d == 0)
        what = f"{dims.world} ranks" + (f" / --tp {cfg.tp}" if cfg.tp > 1 else "")
        ends = f" (1 is false, {group} is true)" if group > 1 else " (1 is false)"
        raise ConfigError(
            f"--reshard-after-forward {value} does not divide the shard group of {group} "
            f"rank{'s' if group > 1 else ''} ({cfg.strategy} on {what}): N must divide it; "
            f"use one of {sizes}{ends}, or true / false"
        )
    if value in (1, group):
        return
    for flag, on, why in (
        ("--tp", cfg.tp > 1, "tensor-parallel parameters cannot"),
        ("--float8", cfg.float8, "float8 weights (gathered through all-gather hooks) cannot"),
    ):
        if on:
            raise ConfigError(
                f"--reshard-after-forward {value} with {flag}: {why} reshard to a smaller group "
                f"(nor in torch FSDP2): use --reshard-after-forward true or false, or drop {flag}"
            )
