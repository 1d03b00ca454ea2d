"""The planner's recommendation (layer 10): the configuration to run, and why.

Candidates are every strategy (and hybrid group), each with no, selective and full activation
checkpointing; CPU offload only when nothing else fits. Among those that fit, the fastest by
predicted tokens per second per device wins (``Plan.step``); without a step time (no hardware
or no transformer shape) the first that fits in the order of :func:`_candidates` (the least
communication first, no checkpointing before checkpointing) does, as before step times existed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from fullshard.plan.accounting import Plan, Recommendation, fmt_bytes
from fullshard.plan.config import PlanConfig

__all__ = ["describe", "recommend"]

# Why each strategy is preferred when it fits (the candidates' order is the reasoning).
_WHY = {
    "no_shard": "replicated state fits, and plain data parallelism moves the least (one "
    "all-reduce, 2 model units per step)",
    "hybrid_shard_zero2": "gathers and reduce-scatters stay inside groups of {g}; "
    "across groups only each shard is all-reduced (2/{g} units), and parameters stay gathered "
    "from forward to backward (no second all-gather)",
    "shard_grad_op": "2 model units per step (no backward all-gather): parameters stay gathered "
    "from forward to backward",
    "hybrid_shard": "gathers and reduce-scatters stay inside groups of {g}; across groups only "
    "2/{g} units; parameters are freed after forward",
    "full_shard": "the least memory: everything sharded over all devices and parameters freed "
    "after forward, for 3 model units per step (1.5x plain data parallelism)",
}
POLICY_ORDER = ("none", "selective", "full")


def _candidates(world: int, per_node: int) -> list[tuple[str, int | None]]:
    """Strategies from the least communication to the least memory."""
    out: list[tuple[str, int | None]] = [("no_shard", None)]
    groups = []
    g = per_node
    while 1 < g < world:
        if world % g == 0:
            groups.append(g)
        g *= 2
    # Hybrid keeps the gathers inside a node: across nodes only 2/G units (the shard all-reduce).
    out += [("hybrid_shard_zero2", g) for g in groups]
    out.append(("shard_grad_op", None))
    out += [("hybrid_shard", g) for g in groups]
    out.append(("full_shard", None))
    return out


def describe(cfg: PlanConfig) -> str:
    """A configuration in words, e.g. ``hybrid_shard (groups of 8) + full checkpointing``."""
    text = cfg.strategy + (f" (groups of {cfg.hybrid_group})" if cfg.hybrid_group else "")
    policy = cfg.checkpointing
    extras = [
        x
        for x, on in (
            (f"{policy} activation checkpointing", policy != "none"),
            ("CPU offload", cfg.offload),
        )
        if on
    ]
    return text + "".join(f" + {x}" for x in extras)


def _tps(plan: Plan) -> float:
    return plan.step.tokens_per_s_per_device if plan.step else 0.0


def _speed(plan: Plan) -> str:
    step = plan.step
    return "" if step is None else f", {step.tokens_per_s_per_device:,.0f} tokens/s per device"


def recommend(
    evaluate: Callable[[PlanConfig], Plan], config: PlanConfig, world: int
) -> Recommendation:
    """Pick the fastest configuration that fits, and say why (see the module docstring).
    ``evaluate`` plans one configuration."""
    dp_world = config.dp_world(world)
    dp_per_node = max(config.devices_per_node // config.tp, 1)
    tried: list[tuple[PlanConfig, Plan]] = []
    for policy in POLICY_ORDER:
        for strategy, group in _candidates(dp_world, dp_per_node):
            cfg = replace(
                config,
                strategy=strategy,
                hybrid_group=group,
                activation_checkpointing=policy,
                offload=False,
            )
            tried.append((cfg, evaluate(cfg)))
    fitting = [(c, p) for c, p in tried if p.fits is not False]
    if not fitting:  # offload last: host-device copies every step
        cfg = replace(
            config,
            strategy="full_shard",
            hybrid_group=None,
            activation_checkpointing="full",
            offload=True,
        )
        plan = evaluate(cfg)
        tried.append((cfg, plan))
        fitting = [(cfg, plan)] if plan.fits is not False else []
    if not fitting:
        cfg, plan = min(tried, key=lambda cp: cp[1].peak_reserved_bytes)
        why = (
            f"nothing fits {fmt_bytes(plan.usable_bytes or 0)} usable per device; the smallest "
            f"is {describe(cfg)} at {fmt_bytes(plan.peak_reserved_bytes)} (gathered window "
            f"{fmt_bytes(plan.window_backward)} + activations). Reduce --batch / --seq or use "
            "tensor parallelism."
        )
        return Recommendation(
            cfg.strategy,
            cfg.hybrid_group,
            cfg.checkpointing,
            cfg.offload,
            False,
            plan.peak_bytes,
            why,
        )
    timed = all(p.step is not None for _, p in fitting)
    # the fastest; among equals, the earlier (less communication, less recompute)
    best = max(fitting, key=lambda cp: _tps(cp[1])) if timed else fitting[0]
    cfg, plan = best
    usable = plan.usable_bytes
    why = f"{describe(cfg)} fits: peak {fmt_bytes(plan.peak_reserved_bytes)} reserved per device"
    why += f" of {fmt_bytes(usable)} usable" if usable is not None else ""
    why += _speed(plan) + "; "
    why += _WHY[cfg.strategy].format(g=cfg.hybrid_group) + "."
    if timed and len(fitting) > 1:
        others = sorted((cp for cp in fitting if cp is not best), key=lambda cp: -_tps(cp[1]))[:2]
        why += (
            " Next fastest that fit: "
            + "; ".join(f"{describe(c)}{_speed(p)}" for c, p in others)
            + "."
        )
    rejected = [
        f"{describe(c)} needs {fmt_bytes(p.peak_reserved_bytes)}"
        for c, p in tried
        if p.fits is False
    ][:3]
    if rejected:
        why += " Do not fit: " + "; ".join(rejected) + "."
    if cfg.offload:
        why += f" Host memory per device: {fmt_bytes(plan.host_bytes)}."
    return Recommendation(
        cfg.strategy,
        cfg.hybrid_group,
        cfg.checkpointing,
        cfg.offload,
        True,
        plan.peak_bytes,
        why,
        plan.step.tokens_per_s_per_device if plan.step else None,
    )
