"""The planner's analytic mode (layer 10): a model described by its parameter count alone."""

from __future__ import annotations

import math
from dataclasses import replace

from fullshard.plan.accounting import Plan, build_plan, korthikanti_activation_bytes
from fullshard.plan.config import DTYPE_BYTES, PlanConfig, UnitCost
from fullshard.plan.steptime import step_time
from fullshard.plan.transformer import TransformerShape

__all__ = ["plan_analytic"]


def plan_analytic(
    params: float,
    world_size: int,
    config: PlanConfig | None = None,
    *,
    layers: int = 32,
    hidden: int | None = None,
    heads: int | None = None,
    fused_attention: bool = False,
) -> Plan:
    """Plan a model of ``params`` parameters in ``layers`` equal units on ``world_size`` devices.

    ``hidden`` defaults to ``sqrt(params / (12 * layers))`` (a transformer block has about
    ``12 h^2`` parameters) and ``heads`` to ``hidden / 128``; they only shape the activation
    estimate (:func:`korthikanti_activation_bytes`, per device batch ``config.batch``) and the
    step time (a GPT block of that width: 4h MLP, as many key/value heads as heads), which
    needs ``config.hardware``.
    """
    config = config or PlanConfig()
    if params <= 0 or layers < 1 or world_size < 1:
        raise ValueError("--params, --layers and --devices must be positive")
    n = config.shard_group(config.dp_world(world_size))
    h = hidden or max(1, round(math.sqrt(params / (12 * layers))))
    a = heads or max(1, round(h / 128))
    cb = DTYPE_BYTES[config.precision]
    act = korthikanti_activation_bytes(
        config.batch, config.seq, h, a, act_bytes=cb, fused=fused_attention
    )
    gpt = TransformerShape(h, layers, a, a, max(1, h // a), 4 * h, 1, family="gpt")
    tokens = config.seq * config.batch
    per_layer = params / layers
    unit = UnitCost(
        name="layer",
        numel=per_layer,
        trainable_numel=per_layer,
        shard_numel=per_layer / n,
        grad_shard_numel=per_layer / n,
        act_bytes=act,
        # Checkpointing keeps each layer's input: s*b*h values in the compute dtype.
        input_bytes=tokens * h * cb,
        selective_bytes=tokens * gpt.saved_bytes("selective", cb),
        fp8_numel=per_layer,
    )
    shape = {"hidden": h, "heads": a, "batch": config.batch, "seq": config.seq}
    notes = ["activations: Korthikanti et al. (2022), no tensor/sequence parallelism"]
    units = [replace(unit, name=f"layer{i}") for i in range(layers)]
    plan = build_plan(
        units,
        world_size,
        config,
        mode="analytic",
        model=f"{params:.3g} parameters",
        shape=shape,
        notes=notes,
    )
    if config.hardware is not None:
        plan.step = step_time(gpt, units, world_size, config, config.hardware)
    return plan
