"""Model mode of ``fullshard plan``, the recommendation, and the printed report.

Model mode reads unit sizes and activations from a real model definition.

The model is built on the meta device (any size, no memory). Its parameters are split into units
exactly as :func:`fullshard.parallelize` would: one unit per module of the model's ``unit_types``
(the innermost one owning a parameter), the rest in the root unit, in the engine's parameter
order, and each unit laid out by :class:`fullshard.shard.layout.FlatLayout` so the per-rank
shard includes its padding.

Activations are measured, not guessed: one forward and loss run under ``FakeTensorMode`` (tensors
with shapes and a CPU device but no storage, so the same kernels as a real CPU run are chosen)
and a ``saved_tensors_hooks`` pack hook records every distinct storage autograd saves, attributed
to the unit whose forward is running. Parameters are excluded (they are the gathered window).
When that fails (a model whose forward cannot run on fake tensors), the Korthikanti estimate from
the model's shape is used instead and the plan says so in ``notes``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from fullshard.dist.desync import TAG_LEN
from fullshard.observe.plan import (
    CATEGORIES,
    DTYPE_BYTES,
    GB,
    OPTIMIZERS,
    PHASES,
    STRATEGIES,
    Plan,
    PlanConfig,
    Recommendation,
    UnitCost,
    build_plan,
    fmt_bytes,
    korthikanti_activation_bytes,
    plan_analytic,
)
from fullshard.shard.layout import FlatLayout

__all__ = [
    "add_plan_arguments",
    "build_meta_model",
    "format_plan",
    "make_plan",
    "measure_activations",
    "model_units",
    "plan_json",
    "plan_model",
    "recommend",
    "run",
]

_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_meta_model(name: str, vocab_size: int = 256) -> nn.Module:
    """A built-in or Hugging Face model (see ``fullshard.app.models``) on the meta device."""
    from fullshard.app.models import build_model

    return build_model(name, vocab_size, device="meta")


def _unit_params(model: nn.Module) -> list[tuple[str, list[nn.Parameter], bool]]:
    """``(name, parameters, is_root)`` per unit, root first, in the engine's parameter order.

    A parameter belongs to the innermost unit module that holds it (``parallelize`` wraps the
    innermost first, and ``fully_shard`` skips parameters of already wrapped children); tied
    parameters are counted once, in the first unit that reaches them.
    """
    from fullshard.app.models import unit_types_of

    types = unit_types_of(model)
    units: list[tuple[str, list[nn.Parameter], bool]] = [("root", [], True)]
    index: dict[int, int] = {}
    seen: set[int] = set()

    def visit(mod: nn.Module, prefix: str, owner: int) -> None:
        for p in mod._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                units[owner][1].append(p)
        for cname, child in mod._modules.items():
            if child is None:
                continue
            own = owner
            if isinstance(child, types):
                if id(child) not in index:
                    index[id(child)] = len(units)
                    units.append((f"{prefix}{cname}", [], False))
                own = index[id(child)]
            visit(child, f"{prefix}{cname}.", own)

    visit(model, "", 0)
    return units


def model_units(
    model: nn.Module, shard_group: int, activations: dict[int, tuple[float, float]] | None = None
) -> list[UnitCost]:
    """The model's units with per-rank shard sizes (padding included) for ``shard_group`` ranks.

    ``activations`` maps a unit index (0 = root) to ``(saved bytes, input bytes)``.
    """
    out = []
    for i, (name, params, is_root) in enumerate(_unit_params(model)):
        shapes = [p.shape if p.dim() else torch.Size([1]) for p in params]
        trainable = [s for s, p in zip(shapes, params, strict=True) if p.requires_grad]
        # the engine's layout: each rank's shard ends in the all-gather's position tags
        layout = FlatLayout(shapes, shard_group, tail=TAG_LEN if shard_group > 1 else 0)
        grad_layout = FlatLayout(trainable, shard_group)
        act, inp = (activations or {}).get(i, (0.0, 0.0))
        out.append(
            UnitCost(
                name=name,
                numel=float(sum(p.numel() for p in params)),
                trainable_numel=float(sum(p.numel() for p in params if p.requires_grad)),
                shard_numel=float(layout.shard_numel),
                # + one presence column per trainable parameter (NOTE [Which gradients exist])
                grad_shard_numel=float(grad_layout.shard_numel + len(trainable)),
                act_bytes=act,
                input_bytes=inp,
                is_root=is_root,
            )
        )
    # (a root without parameters of its own stays as an empty unit: its activations count)
    return out


@contextlib.contextmanager
def _fake_mode() -> Iterator[None]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        yield


def measure_activations(
    model: nn.Module, batch: int, seq: int, dtype: torch.dtype
) -> dict[int, tuple[float, float]]:
    """Bytes autograd saves per unit for one forward + cross-entropy loss, on fake tensors.

    Returns ``{unit index: (saved bytes, input bytes)}``; index 0 is the root. The model's own
    parameters are not touched: ``torch.func.functional_call`` swaps in fake ones of ``dtype``.
    """
    from torch.func import functional_call

    from fullshard.app.models import logits_of

    units = _unit_params(model)
    owner_of = _unit_modules(model)
    saved: dict[int, tuple[object, float, int]] = {}
    inputs = dict.fromkeys(range(len(units)), 0.0)
    stack = [0]

    def pre(mod: nn.Module, args: tuple[object, ...]) -> None:
        stack.append(owner_of[id(mod)])
        inputs[stack[-1]] += sum(
            a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor)
        )

    def post(mod: nn.Module, args: object, out: object) -> None:
        stack.pop()

    handles = [m.register_forward_pre_hook(pre) for m in model.modules() if id(m) in owner_of]
    handles += [m.register_forward_hook(post) for m in model.modules() if id(m) in owner_of]
    try:
        with _fake_mode():
            fakes = {
                n: torch.empty(
                    p.shape,
                    dtype=dtype if p.is_floating_point() else p.dtype,
                    device="cpu",
                    requires_grad=p.requires_grad,
                )
                for n, p in model.named_parameters(remove_duplicate=False)
            }
            fakes.update(
                (n, torch.empty(b.shape, dtype=b.dtype, device="cpu"))
                for n, b in model.named_buffers()
            )
            skip = {t.untyped_storage()._cdata for t in fakes.values()}

            def pack(t: torch.Tensor) -> torch.Tensor:
                storage = t.untyped_storage()
                if storage._cdata not in skip and storage._cdata not in saved:
                    # keep the storage object alive so its id is not reused while we count
                    saved[storage._cdata] = (storage, float(storage.nbytes()), stack[-1])
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                idx = torch.zeros(batch, seq, dtype=torch.long, device="cpu")
                logits = logits_of(functional_call(model, fakes, (idx,)))
                # the trainer's loss: cross entropy in fp32 over the flattened logits
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), idx.view(-1))
                del loss, logits
    finally:
        for h in handles:
            h.remove()
    acts = dict.fromkeys(range(len(units)), 0.0)
    for _, nbytes, unit in saved.values():
        acts[unit] += nbytes
    return {i: (acts[i], inputs[i]) for i in range(len(units))}


def _unit_modules(model: nn.Module) -> dict[int, int]:
    """``id(module) -> unit index`` for the unit modules (the numbering of ``_unit_params``)."""
    from fullshard.app.models import unit_types_of

    types = unit_types_of(model)
    out: dict[int, int] = {}
    for m in model.modules():
        if m is not model and isinstance(m, types) and id(m) not in out:
            out[id(m)] = len(out) + 1
    return out


def _shape_estimate(model: nn.Module, batch: int, seq: int, cb: int) -> tuple[float, int]:
    """Fallback: Korthikanti per layer from the model's hidden size and heads (0 if unknown)."""
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    hidden = getattr(cfg, "d_model", None) or getattr(cfg, "hidden_size", None)
    heads = getattr(cfg, "n_head", None) or getattr(cfg, "num_attention_heads", None)
    if not hidden or not heads:
        return 0.0, 0
    return korthikanti_activation_bytes(batch, seq, hidden, heads, act_bytes=cb), int(hidden)


def plan_model(
    model_or_name: nn.Module | str,
    world_size: int,
    config: PlanConfig | None = None,
    *,
    vocab_size: int = 256,
    with_recommendation: bool = True,
) -> Plan:
    """Predict per-device memory (by category and phase) and communication for a real model.

    ``model_or_name``: a module with ``unit_types`` (any device; a real one is not modified) or
    a ``fullshard.app.models`` name, built on the meta device with ``vocab_size``. ``config``
    gives strategy, precision, optimizer, per-device ``batch`` and ``seq``, checkpointing and
    offload (:class:`PlanConfig`; precision defaults to ``fp32`` here, as ``fullshard train``).
    The result's ``phases[phase].categories()`` are named like the memory tracker's categories.
    """
    config = config or PlanConfig(precision="fp32", seq=128)
    if world_size < 1:
        raise ValueError(f"world size must be at least 1, got {world_size}")
    name = model_or_name if isinstance(model_or_name, str) else type(model_or_name).__name__
    model = (
        build_meta_model(model_or_name, vocab_size)
        if isinstance(model_or_name, str)
        else model_or_name
    )
    notes: list[str] = []
    dtype = _TORCH_DTYPES[config.precision]
    try:
        acts = measure_activations(model, config.batch, config.seq, dtype)
        notes.append("activations: saved tensors of one forward + loss, measured on fake tensors")
    except Exception as exc:  # any model whose forward fake tensors cannot run
        cb = DTYPE_BYTES[config.precision]
        per_layer, hidden = _shape_estimate(model, config.batch, config.seq, cb)
        # checkpointing keeps each block's input: batch * seq * hidden in the compute dtype
        inp = float(config.batch * config.seq * hidden * cb)
        acts = {i: (per_layer, inp) for i in range(1, len(_unit_params(model)))}
        notes.append(f"activations: Korthikanti estimate (fake-tensor forward failed: {exc})")
    shape = {"batch": config.batch, "seq": config.seq, "vocab": vocab_size}

    def evaluate(cfg: PlanConfig) -> Plan:
        units = model_units(model, cfg.shard_group(world_size), acts)
        return build_plan(
            units, world_size, cfg, mode="model", model=name, shape=shape, notes=notes
        )

    plan = evaluate(config)
    if with_recommendation:
        plan.recommendation = recommend(evaluate, config, world_size)
    return plan


# -- recommendation ------------------------------------------------------------------------
# Why each strategy is preferred when it fits (the candidates' order is the reasoning).
_WHY = {
    "no_shard": "replicated state fits, and plain data parallelism moves the least (one "
    "all-reduce, 2 model units per step)",
    "hybrid_shard_zero2": "gathers and reduce-scatters stay inside groups of {g} (one node); "
    "across groups only each shard is all-reduced (2/{g} units), and parameters stay gathered "
    "from forward to backward (no second all-gather)",
    "shard_grad_op": "2 model units per step (no backward all-gather): parameters stay gathered "
    "from forward to backward",
    "hybrid_shard": "gathers and reduce-scatters stay inside groups of {g}; across groups only "
    "2/{g} units; parameters are freed after forward",
    "full_shard": "the least memory: everything sharded over all devices and parameters freed "
    "after forward, for 3 model units per step (1.5x plain data parallelism)",
}


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


def _describe(cfg: PlanConfig) -> str:
    text = cfg.strategy + (f" (groups of {cfg.hybrid_group})" if cfg.hybrid_group else "")
    extras = [x for x, on in (("activation checkpointing", cfg.activation_checkpointing),
                              ("CPU offload", cfg.offload)) if on]  # fmt: skip
    return text + "".join(f" + {x}" for x in extras)


def recommend(
    evaluate: Callable[[PlanConfig], Plan], config: PlanConfig, world: int
) -> Recommendation:
    """Pick the cheapest configuration that fits ``config.device_memory``, and say why.

    Preference: no activation checkpointing before checkpointing (recomputation costs about
    one extra forward), then the strategy with the least communication (:func:`_candidates`),
    CPU offload last (host-device copies every step). ``evaluate`` plans one configuration.
    """
    usable = (config.device_memory or float("inf")) * (1.0 - config.reserve)
    # (strategy, checkpointing) -> why it was rejected; hybrid keeps its largest group tried
    rejected: dict[tuple[str, bool], str] = {}
    for ckpt, offload in ((False, False), (True, False), (True, True)):
        for strategy, group in _candidates(world, config.devices_per_node):
            if offload and strategy != "full_shard":
                continue
            cfg = replace(
                config,
                strategy=strategy,
                hybrid_group=group,
                activation_checkpointing=ckpt,
                offload=offload,
            )
            plan = evaluate(cfg)
            if plan.peak_bytes <= usable:
                why = f"{_describe(cfg)} fits: peak {fmt_bytes(plan.peak_bytes)} per device of "
                why += f"{fmt_bytes(usable)} usable; {_WHY[strategy].format(g=group)}."
                if rejected:
                    why += " Cheaper options do not fit: " + "; ".join(rejected.values()) + "."
                if offload:
                    why += f" Host memory per device: {fmt_bytes(plan.host_bytes)}."
                return Recommendation(strategy, group, ckpt, offload, True, plan.peak_bytes, why)
            rejected[(strategy, ckpt)] = f"{_describe(cfg)} needs {fmt_bytes(plan.peak_bytes)}"
    last = replace(config, strategy="full_shard", hybrid_group=None,
                   activation_checkpointing=True, offload=True)  # fmt: skip
    plan = evaluate(last)
    why = (
        f"nothing fits {fmt_bytes(usable)} usable per device; the smallest is "
        f"{_describe(last)} at {fmt_bytes(plan.peak_bytes)} (gathered window "
        f"{fmt_bytes(plan.window_backward)} + activations). Reduce --batch / --seq or use "
        "tensor parallelism."
    )
    return Recommendation("full_shard", None, True, True, False, plan.peak_bytes, why)


# -- front end ---------------------------------------------------------------------------------
def make_plan(
    world_size: int,
    config: PlanConfig,
    *,
    params: float | None = None,
    model: str | None = None,
    layers: int = 32,
    hidden: int | None = None,
    heads: int | None = None,
    fused_attention: bool = False,
    vocab_size: int = 256,
) -> Plan:
    """What ``fullshard plan`` prints: an analytic (``params``) or model (``model``) plan with its
    recommendation attached."""
    if (params is None) == (model is None):
        raise ValueError("give either a parameter count (--params) or a model (--model)")
    if model is not None:
        return plan_model(model, world_size, config, vocab_size=vocab_size)
    assert params is not None

    def evaluate(cfg: PlanConfig) -> Plan:
        return plan_analytic(
            params, world_size, cfg, layers=layers, hidden=hidden, heads=heads,
            fused_attention=fused_attention,
        )  # fmt: skip

    plan = evaluate(config)
    plan.recommendation = recommend(evaluate, config, world_size)
    return plan


def format_plan(plan: Plan) -> str:
    """The readable report: ladder, shard, window, memory by phase, communication, verdict."""
    cfg = plan.config
    cb = DTYPE_BYTES[cfg.precision]
    lad = plan.ladder
    precision = "fp32" if cb == 4 else f"{cfg.precision} mixed precision (fp32 master weights)"
    shape = ", ".join(f"{k} {v}" for k, v in plan.shape.items())
    name = f"{plan.model}, " if plan.mode == "model" else ""
    root = " + root" if plan.mode == "model" else " (equal layers)"
    lines = [
        f"fullshard plan ({plan.mode} mode): {name}{plan.params:,.0f} parameters in "
        f"{plan.layers} units{root}, {plan.world_size} devices",
        f"  {cfg.strategy} (shard group {plan.shard_group}), {precision}, {cfg.optimizer}, "
        f"activation checkpointing {'on' if cfg.activation_checkpointing else 'off'}, "
        f"offload {'on' if cfg.offload else 'off'}; per device: {shape}",
        "",
        f"ZeRO ladder: model state per device at {lad.bytes_per_param:g} B/param "
        f"({cb} params + {cb} grads + {lad.bytes_per_param - 2 * cb:g} optimizer), no activations",
    ]
    rungs = [
        ("replicated (DDP)", lad.replicated),
        ("P_os     (+ optimizer sharded)", lad.os),
        ("P_os+g   (+ gradients)", lad.os_g),
        ("P_os+g+p (+ parameters)", lad.os_g_p),
    ]
    lines += [f"  {name:<34}{fmt_bytes(v):>12}" for name, v in rungs]
    per = plan.shard_bytes / max(plan.params, 1) * plan.shard_group
    lines += [
        "",
        f"  {'shard per device (' + f'{per:.3g} B/param / {plan.shard_group})':<34}"
        f"{fmt_bytes(plan.shard_bytes):>12}",
        f"  {'gathered window, forward':<34}{fmt_bytes(plan.window_forward):>12}"
        f"  2 units of parameters ({cfg.precision})",
        f"  {'gathered window, backward':<34}{fmt_bytes(plan.window_backward):>12}"
        "  2 units of parameters + 1 unit of gradients",
        "",
        "Peak memory per device by phase (see NOTE [Step model] in fullshard.observe.plan)",
        f"  {'category':<18}" + "".join(f"{p:>14}" for p in PHASES),
    ]
    for c in (*CATEGORIES, "other", "total"):
        cells = "".join(f"{fmt_bytes(getattr(plan.phases[p], c)):>14}" for p in PHASES)
        lines.append(f"  {c:<18}{cells}")
    lines += ["", f"Communication per step: {plan.comm_units:.3g} model units"]
    for col in plan.comm:
        lines.append(
            f"  {col.kind:<24}{col.group + ' group of ' + str(col.group_size):<24}"
            f"{col.units:>6.3g} units {fmt_bytes(col.tensor_bytes):>10} "
            f"({fmt_bytes(col.sent_bytes)} sent per device)"
        )
    if not plan.comm:
        lines.append("  none (one device)")
    lines.append("")
    if plan.usable_bytes is not None:
        verdict = "fits" if plan.fits else "does NOT fit"
        lines.append(
            f"Device memory {fmt_bytes(cfg.device_memory or 0)} ({fmt_bytes(plan.usable_bytes)} "
            f"usable, {cfg.reserve:.0%} reserve): peak {fmt_bytes(plan.peak_bytes)} -> {verdict}"
        )
    if plan.host_bytes:
        lines.append(f"Host memory per device (offloaded state): {fmt_bytes(plan.host_bytes)}")
    rec = plan.recommendation
    if rec is not None:
        lines.append(f"Recommendation: {_describe_rec(rec)}")
        lines.append(f"  why: {rec.reason}")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def _describe_rec(rec: Recommendation) -> str:
    return _describe(
        PlanConfig(
            strategy=rec.strategy,
            hybrid_group=rec.hybrid_group,
            activation_checkpointing=rec.activation_checkpointing,
            offload=rec.offload,
        )
    )


def plan_json(plan: Plan) -> str:
    """The plan as indented JSON (bytes as numbers)."""
    return json.dumps(plan.to_dict(), indent=2, default=str)


# -- command line (``fullshard plan``: the CLI parses with these and calls :func:`run`) ---------
PLAN_EPILOG = """\
examples:
  fullshard plan --params 7.5e9 --devices 64                 # the ZeRO paper's ladder
  fullshard plan --params 70e9 --layers 80 --devices 8 --device-memory 80
  fullshard plan --model small --devices 4 --batch 8 --seq 128
  fullshard plan --model 7b --devices 1024 --precision bf16 --json

GB = 1e9 bytes. Analytic mode splits --params into --layers equal units; model mode builds
the model on the meta device (no memory) and shards each unit as the engine would.
"""


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``fullshard plan``."""
    what = parser.add_argument_group("model (one of)")
    src = what.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", type=float, help="parameter count, e.g. 7.5e9 (analytic mode)")
    src.add_argument("--model", help="a fullshard.app.models name: tiny, demo, small, gpt2-124m, "
                     "1b, 7b, or hf:NAME (model mode)")  # fmt: skip
    what.add_argument("--layers", type=int, default=32,
                      help="analytic: transformer layers = units (default 32)")  # fmt: skip
    what.add_argument("--hidden", type=int, help="analytic: hidden size (default "
                      "sqrt(params / (12 * layers)))")  # fmt: skip
    what.add_argument("--heads", type=int, help="analytic: attention heads (default hidden/128)")
    what.add_argument("--fused-attention", action="store_true",
                      help="analytic: flash/fused attention (no s*s scores saved)")  # fmt: skip
    what.add_argument("--vocab", type=int, default=256,
                      help="model: vocabulary size (default 256, byte-level)")  # fmt: skip
    hw = parser.add_argument_group("hardware")
    hw.add_argument("--devices", type=int, required=True, help="number of devices (world size)")
    hw.add_argument("--device-memory", type=float, default=80.0,
                    help="memory per device in GB (default 80)")  # fmt: skip
    hw.add_argument("--reserve", type=float, default=0.1,
                    help="fraction of device memory kept back for context and fragmentation "
                    "(default 0.1)")  # fmt: skip
    hw.add_argument("--devices-per-node", type=int, default=8,
                    help="devices per node: the default hybrid group (default 8)")  # fmt: skip
    run_ = parser.add_argument_group("training")
    run_.add_argument("--strategy", default="full_shard", choices=STRATEGIES,
                      help="sharding strategy to plan (default full_shard)")  # fmt: skip
    run_.add_argument("--hybrid-group", type=int,
                      help="hybrid strategies: devices per shard group (default: per node)")  # fmt: skip
    run_.add_argument("--precision", choices=tuple(DTYPE_BYTES),
                      help="fp32, or bf16/fp16 mixed precision with fp32 master weights "
                      "(default: bf16 analytic, fp32 model mode as fullshard train)")  # fmt: skip
    run_.add_argument("--reduce-dtype", choices=tuple(DTYPE_BYTES),
                      help="gradient reduction dtype (default fp32)")  # fmt: skip
    run_.add_argument("--optimizer", default="adam", choices=tuple(OPTIMIZERS),
                      help="adam/adamw: 2 fp32 states (K = 12 B/param with the master copy "
                      "in mixed precision); sgd-momentum: 1; sgd: 0 (default adam)")  # fmt: skip
    run_.add_argument("--batch", type=int, default=1, help="sequences per device (default 1)")
    run_.add_argument("--seq", type=int,
                      help="tokens per sequence (default: 2048 analytic, 128 model mode)")  # fmt: skip
    run_.add_argument("--activation-checkpointing", action="store_true",
                      help="recompute each unit's activations in backward")  # fmt: skip
    run_.add_argument("--offload", action="store_true",
                      help="keep shards, gradients and the optimizer step on the CPU")  # fmt: skip
    run_.add_argument(
        "--backend",
        default="nccl",
        choices=("nccl", "gloo"),
        help="collective backend: gloo's reduce-scatter needs one more buffer (default nccl)",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args: argparse.Namespace) -> str:
    """``fullshard plan``: the report (or JSON) for parsed ``args``."""
    analytic = args.params is not None
    for name in ("devices", "layers", "batch", "devices_per_node"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    config = PlanConfig(
        strategy=args.strategy,
        hybrid_group=args.hybrid_group,
        precision=args.precision or ("bf16" if analytic else "fp32"),
        reduce_dtype=args.reduce_dtype,
        optimizer=args.optimizer,
        batch=args.batch,
        seq=args.seq or (2048 if analytic else 128),
        activation_checkpointing=args.activation_checkpointing,
        offload=args.offload,
        device_memory=args.device_memory * GB,
        reserve=args.reserve,
        devices_per_node=args.devices_per_node,
        backend=args.backend,
    )
    plan = make_plan(
        args.devices,
        config,
        params=args.params,
        model=args.model,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        fused_attention=args.fused_attention,
        vocab_size=args.vocab,
    )
    return plan_json(plan) if args.json else format_plan(plan)
