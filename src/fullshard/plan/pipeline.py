"""Pipeline-parallel stages as the planner sees them (layer 10).

NOTE [Pipeline stages]
Blocks are split into ``pp * v`` stages as torchtitan splits them (``v`` = 2 stages per rank
under interleaved 1F1B, else 1): ``layers // stages`` each, one more on the first
``layers % stages``. Rank ``r`` runs stages ``r, r + pp, ...``. The embedding lives on the first
stage, the final norm, the head and the loss on the last. Each stage keeps its parameters
gathered for the whole step and accumulates unsharded gradients across microbatches
(FSDP2 under a pipeline schedule). A rank holds the activations of the microbatches it has run
forward but not yet backward: under 1F1B ``min(m, pp - r)``; under interleaved 1F1B its warm-up
runs ``(v - 1) * pp + 2 * (pp - 1 - r)`` stage-forwards first (torch's
``ScheduleInterleaved1F1B``), at most all ``m * v``. Its memory is the worst rank's: the first
(the most microbatches in flight) or the last (the loss).
"""

from __future__ import annotations

from dataclasses import replace

from fullshard.plan.config import PlanConfig, UnitCost
from fullshard.plan.transformer import TransformerShape

__all__ = ["inflight", "split_layers", "stage_units"]


def split_layers(layers: int, stages: int) -> list[int]:
    """Blocks per stage (NOTE [Pipeline stages])."""
    if stages > layers:
        raise ValueError(f"{stages} pipeline stages for {layers} layers: at most one per layer")
    base, extra = divmod(layers, stages)
    return [base + (s < extra) for s in range(stages)]


def inflight(config: PlanConfig, rank: int) -> float:
    """Microbatches whose activations ``rank`` holds at its peak, averaged over its stages."""
    pp, v = config.pp, config.stages_per_rank
    m = config.microbatches or pp
    if v == 1:
        return float(min(m, pp - rank))
    warmup = (v - 1) * pp + 2 * (pp - 1 - rank) + 1
    return min(m * v, warmup) / v


def stage_units(
    units: list[UnitCost], config: PlanConfig, rank: int, shape: TransformerShape | None
) -> list[UnitCost]:
    """The units rank ``rank`` of the pipeline runs: its stages' blocks, and the part of the
    root its stages hold (the embedding on the first, the norm, head and loss on the last)."""
    pp, v = config.pp, config.stages_per_rank
    root = [u for u in units if u.is_root]
    blocks = [u for u in units if not u.is_root]
    sizes = split_layers(len(blocks), pp * v)
    starts = [sum(sizes[:s]) for s in range(pp * v)]
    mine: list[UnitCost] = []
    for s in range(rank, pp * v, pp):
        mine += blocks[starts[s] : starts[s] + sizes[s]]
    if not root:
        return mine
    r = root[0]
    embed = 0.5 if shape is None else (shape.vocab + shape.positions) / shape.root_params()

    def part(frac: float, keep_loss: bool) -> UnitCost:
        scaled = replace(
            r,
            numel=r.numel * frac,
            trainable_numel=r.trainable_numel * frac,
            shard_numel=r.shard_numel * frac,
            grad_shard_numel=r.grad_shard_numel * frac,
            fp8_numel=0.0,
        )
        if keep_loss:
            return scaled
        return replace(
            scaled,
            act_bytes=r.act_bytes - r.tail_bytes,
            tail_bytes=0.0,
            loss_bytes=0.0,
            loss_forward_extra=0.0,
            loss_backward_extra=0.0,
        )

    first, last = rank == 0, rank == pp - 1  # the first stage is rank 0's, the last rank pp-1's
    if first and last:  # one stage only (pp == 1 is not planned here)
        return [r, *mine]
    if first:
        return [part(embed, keep_loss=False), *mine]
    if last:
        return [replace(part(1 - embed, keep_loss=True), act_bytes=r.tail_bytes), *mine]
    return mine
