"""``fullshard plan``: its options, the report it prints, and the plan of a built-in model.

The planner itself is a library (``fullshard.plan``); this module turns command-line options into
a :class:`~fullshard.plan.PlanConfig`, builds ``fullshard.app.models.gpt`` models on the meta device
for it, and formats the result.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn

from fullshard.app.config import add_config_options
from fullshard.app.models.gpt import (
    build_model,
    lm_loss,
    output_vocab_size,
    resolve_model_spec,
    unit_types_of,
)
from fullshard.plan import GB, Plan, PlanConfig, fmt_bytes, plan_analytic, plan_model, recommend
from fullshard.plan.accounting import (
    COMPILE_SCOPES,
    DTYPE_BYTES,
    OPTIMIZERS,
    PP_SCHEDULES,
    Recommendation,
)
from fullshard.plan.hardware import hardware_names, load_hardware
from fullshard.plan.recommendation import describe
from fullshard.plan.transformer import POLICIES
from fullshard.policies import MEMORY_CATEGORIES, STEP_PHASES

BYTE_VOCAB = 256  # the built-in models' vocabulary: UTF-8 bytes, as fullshard train reads text

__all__ = [
    "PLAN_EPILOG",
    "add_plan_arguments",
    "format_plan",
    "make_plan",
    "model_vocab",
    "plan_builtin",
    "plan_config",
    "plan_json",
    "run",
]


def model_vocab(name: str, vocab_size: int | None = None) -> int:
    """The vocabulary a plan of ``name`` uses: ``vocab_size`` when given (``--vocab``), else the
    model's own: a Hugging Face directory's (its ``config.json``), and for the built-in names the
    256 byte tokens ``fullshard train`` gives them."""
    if vocab_size is not None:
        return vocab_size
    kind, spec = resolve_model_spec(name)
    if kind == "hf":
        from fullshard.app.models.hf import config_vocab_size

        return config_vocab_size(spec) or BYTE_VOCAB
    return BYTE_VOCAB


def plan_builtin(
    name: str,
    world_size: int,
    config: PlanConfig | None = None,
    *,
    vocab_size: int | None = None,
    with_recommendation: bool = True,
) -> Plan:
    """:func:`fullshard.plan.plan_model` for a ``fullshard.app.models.gpt`` name (``small``,
    ``gpt2-124m``, ``hf:NAME``, ``hf:DIR`` ...), built on the meta device, with the trainer's
    loss; with ``config.tp`` > 1, split as ``fullshard train --tp`` splits it. ``vocab_size``:
    see :func:`model_vocab` (``None``: the model's own)."""
    model = build_model(name, model_vocab(name, vocab_size), device="meta")
    config = config or PlanConfig(precision="fp32", seq=128)
    local = tp_local_shapes(model, config.tp) if config.tp > 1 else None
    return plan_model(
        model,
        unit_types_of(model),
        world_size,
        config,
        loss_step=lm_loss,
        name=name,
        # the logits the model makes (a checkpoint's vocabulary wins over --vocab)
        shape={"batch": config.batch, "seq": config.seq, "vocab": output_vocab_size(model)},
        with_recommendation=with_recommendation,
        local_shapes=local,
        vocab=output_vocab_size(model),
    )


def tp_local_shapes(model: nn.Module, tp: int) -> dict[str, torch.Size]:
    """Parameter name -> the shape one rank holds under tensor parallel: the blocks as
    ``fullshard train --tp`` splits them (column-wise: rows split; row-wise: columns split, bias
    whole), and the input embedding and output head split by vocabulary as torchtitan's plan
    splits them (row-wise embedding, column-wise head with loss parallel), when ``tp`` divides
    the vocabulary."""
    from fullshard.app.models.tensor_parallel import block_plan, check_divisible

    out: dict[str, torch.Size] = {}
    types = unit_types_of(model)
    for bname, block in model.named_modules():
        if not isinstance(block, types):
            continue
        check_divisible(block, tp)
        for sub, kind in block_plan(block).items():
            linear = block.get_submodule(sub)
            assert isinstance(linear, nn.Linear)
            out_f, in_f = linear.out_features, linear.in_features
            w = (out_f // tp, in_f) if kind == "col" else (out_f, in_f // tp)
            out[f"{bname}.{sub}.weight"] = torch.Size(w)
            if linear.bias is not None and kind == "col":
                out[f"{bname}.{sub}.bias"] = torch.Size([out_f // tp])
    by_id = {id(p): n for n, p in model.named_parameters()}
    for get in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, get, lambda: None)()
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and id(weight) in by_id and weight.shape[0] % tp == 0:
            out[by_id[id(weight)]] = torch.Size([weight.shape[0] // tp, *weight.shape[1:]])
    return out


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
    vocab_size: int | None = None,
    with_recommendation: bool = True,
) -> Plan:
    """What ``fullshard plan`` prints: an analytic (``params``) or model (``model``) plan with its
    recommendation attached."""
    if (params is None) == (model is None):
        raise ValueError("give either a parameter count (--params) or a model (--model)")
    if model is not None:
        return plan_builtin(
            model, world_size, config, vocab_size=vocab_size,
            with_recommendation=with_recommendation,
        )  # fmt: skip
    assert params is not None

    def evaluate(cfg: PlanConfig) -> Plan:
        return plan_analytic(
            params, world_size, cfg, layers=layers, hidden=hidden, heads=heads,
            fused_attention=fused_attention,
        )  # fmt: skip

    plan = evaluate(config)
    if with_recommendation:
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
    tp = f" (per device of a tensor-parallel group of {cfg.tp})" if cfg.tp > 1 else ""
    lines = [
        f"fullshard plan ({plan.mode} mode): {name}{plan.params:,.0f} parameters{tp} in "
        f"{plan.layers} units{root}, {plan.world_size} devices",
        f"  {cfg.strategy} (shard group {plan.shard_group}), {precision}, {cfg.optimizer}, "
        f"activation checkpointing {cfg.checkpointing}, "
        f"offload {'on' if cfg.offload else 'off'}{_extras(cfg)}; per device: {shape}",
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
        "Peak memory per device by phase (see NOTE [Step model] in fullshard.plan.accounting)",
        f"  {'category':<18}" + "".join(f"{p:>14}" for p in STEP_PHASES),
    ]
    for c in (*MEMORY_CATEGORIES, "other", "total"):
        cells = "".join(f"{fmt_bytes(getattr(plan.phases[p], c)):>14}" for p in STEP_PHASES)
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
    lines += _step_lines(plan)
    if plan.usable_bytes is not None:
        verdict = "fits" if plan.fits else "does NOT fit"
        lines.append(
            f"Device memory: {fmt_bytes(plan.usable_bytes)} usable; peak live "
            f"{fmt_bytes(plan.peak_bytes)}, reserved by the allocator "
            f"{fmt_bytes(plan.peak_reserved_bytes)} ({plan.peak_reserved_bytes / 2**30:.1f} GiB) "
            f"-> {verdict}"
        )
    if plan.host_bytes:
        lines.append(f"Host memory per device (offloaded state): {fmt_bytes(plan.host_bytes)}")
    rec = plan.recommendation
    if rec is not None:
        lines.append(f"Recommendation: {_describe_rec(rec)}")
        lines.append(f"  why: {rec.reason}")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def _extras(cfg: PlanConfig) -> str:
    parts = [f"tp {cfg.tp}" if cfg.tp > 1 else "", f"pp {cfg.pp} ({cfg.pp_schedule})"
             if cfg.pp > 1 else "", f"cp {cfg.cp}" if cfg.cp > 1 else "",
             f"torch.compile ({cfg.compile})" if cfg.compile_blocks else "",
             "float8" if cfg.float8 else "",
             "async TP" if cfg.async_tp else ""]  # fmt: skip
    return "".join(f", {p}" for p in parts if p)


def _step_lines(plan: Plan) -> list[str]:
    """The step-time model's prediction (NOTE [Step-time model] in fullshard.plan.steptime)."""
    step, hw = plan.step, plan.config.hardware
    if step is None or hw is None:
        return []
    shares = ", ".join(f"{k.replace('_', ' ')} {v:.0%}" for k, v in step.shares().items() if v)
    return [
        f"Step time on {hw.name}: {step.step_s:.3g} s; {step.tokens_per_s_per_device:,.0f} tokens/s "
        f"per device, MFU {step.mfu:.1%} (see NOTE [Step-time model] in fullshard.plan.steptime)",
        f"  of the step: {shares}",
        "",
    ]


def _describe_rec(rec: Recommendation) -> str:
    return describe(
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


PLAN_EPILOG = """\
examples:
  fullshard plan --params 7.5e9 --devices 64                 # the ZeRO paper's ladder
  fullshard plan --params 70e9 --layers 80 --devices 8 --device-memory 80
  fullshard plan --model small --devices 4 --batch 8 --seq 128
  fullshard plan --model hf:DIR --devices 8 --batch 2 --seq 8192 --precision bf16 \\
      --activation-checkpointing selective --gpu h100-80gb --json
  fullshard plan --calibrate --devices 2 --calibration here.json   # measure this machine

GB = 1e9 bytes. Analytic mode splits --params into --layers equal units; model mode builds
the model on the meta device (no memory) and shards each unit as the engine would.
"""


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``fullshard plan``."""
    what = parser.add_argument_group("model (one of)")
    src = what.add_mutually_exclusive_group()
    src.add_argument("--params", type=float, help="parameter count, e.g. 7.5e9 (analytic mode)")
    src.add_argument("--model", help="a fullshard.app.models.gpt name: tiny, demo, small, gpt2-124m, "
                     "1b, 7b, hf:NAME, or hf:DIR for a local Hugging Face config directory "
                     "(model mode)")  # fmt: skip
    what.add_argument("--layers", type=int, default=32,
                      help="analytic: transformer layers = units (default 32)")  # fmt: skip
    what.add_argument("--hidden", type=int, help="analytic: hidden size (default "
                      "sqrt(params / (12 * layers)))")  # fmt: skip
    what.add_argument("--heads", type=int, help="analytic: attention heads (default hidden/128)")
    what.add_argument("--fused-attention", action="store_true",
                      help="analytic: flash/fused attention (no s*s scores saved)")  # fmt: skip
    what.add_argument("--vocab", type=int,
                      help="model: vocabulary size (default: a Hugging Face directory's own, "
                      "from its config.json; 256 byte tokens for the built-in names)")  # fmt: skip
    hw = parser.add_argument_group("hardware")
    hw.add_argument("--devices", type=int, required=True, help="number of devices (world size)")
    hw.add_argument("--gpu", default="h100-80gb",
                    help=f"the device: a preset ({', '.join(hardware_names())}) or a JSON file "
                    "(what --calibrate writes; docs/plan.md shows its keys) (default h100-80gb)")  # fmt: skip
    hw.add_argument("--device-memory", type=float,
                    help="memory per device in GB (default: the --gpu's)")  # fmt: skip
    hw.add_argument("--reserve", type=float,
                    help="with --device-memory: the fraction kept back for context and "
                    "fragmentation (default 0.1); else the --gpu's allocator factor and "
                    "overhead decide")  # fmt: skip
    hw.add_argument("--devices-per-node", type=int, default=8,
                    help="devices per node: the default hybrid group (default 8)")  # fmt: skip
    run_ = parser.add_argument_group("training")
    # fullshard train's own definitions: the plan reads them as a run would
    add_config_options(run_, "strategy", "tp")
    run_.add_argument("--pp", type=int, default=1, help="pipeline-parallel stages (default 1)")
    run_.add_argument("--cp", type=int, default=1,
                      help="context-parallel degree: each sequence split over this many "
                      "devices (default 1)")  # fmt: skip
    run_.add_argument("--pp-schedule", default="1f1b", choices=PP_SCHEDULES,
                      help="pipeline schedule: 1f1b, or interleaved (2 stages per rank)")  # fmt: skip
    run_.add_argument("--microbatches", type=int,
                      help="pipeline microbatches per step (default: --pp)")  # fmt: skip
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
    run_.add_argument("--activation-checkpointing", nargs="?", const="full", default="none",
                      choices=POLICIES,
                      help="none, selective (torchtitan's per-op policy: every other matmul's "
                      "and attention's outputs kept) or full (each block's input kept); the "
                      "flag alone is full (default none)")  # fmt: skip
    run_.add_argument("--compile", nargs="?", const="all", default="none",
                      choices=COMPILE_SCOPES,
                      help="torch.compile: the flag alone compiles the blocks and the loss "
                      "(torchtitan's --training.compile since 2025); 'blocks' the blocks only "
                      "(torchtitan in 2024)")  # fmt: skip
    run_.add_argument("--float8", action="store_true",
                      help="float8 linears in the blocks, their weights all-gathered as float8")  # fmt: skip
    run_.add_argument("--async-tp", action="store_true",
                      help="tensor parallel's collectives split under its matmuls")  # fmt: skip
    run_.add_argument("--offload", action="store_true",
                      help="keep shards, gradients and the optimizer step on the CPU")  # fmt: skip
    run_.add_argument(
        "--backend",
        default="nccl",
        choices=("nccl", "gloo"),
        help="collective backend: gloo's reduce-scatter needs one more buffer (default nccl)",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    cal = parser.add_argument_group("calibration")
    cal.add_argument("--calibrate", action="store_true",
                     help="measure this machine on --devices local ranks (matmul rate, memory "
                     "bandwidth, the backend's collective bandwidth) and write --calibration")  # fmt: skip
    cal.add_argument("--calibration", default="fullshard-calibration.json",
                     help="where --calibrate writes this machine's description (for --gpu)")  # fmt: skip


def plan_config(args: argparse.Namespace, analytic: bool) -> PlanConfig:
    """The :class:`PlanConfig` that parsed ``fullshard plan`` options describe."""
    hardware = load_hardware(args.gpu, devices_per_node=args.devices_per_node)
    memory = args.device_memory * GB if args.device_memory is not None else None
    return PlanConfig(
        strategy=args.strategy,
        hybrid_group=args.hybrid_group,
        precision=args.precision or ("bf16" if analytic else "fp32"),
        reduce_dtype=args.reduce_dtype,
        optimizer=args.optimizer,
        batch=args.batch,
        seq=args.seq or (2048 if analytic else 128),
        activation_checkpointing=args.activation_checkpointing,
        offload=args.offload,
        device_memory=memory,
        reserve=0.1 if args.reserve is None else args.reserve,
        devices_per_node=args.devices_per_node,
        backend=args.backend,
        tp=args.tp,
        pp=args.pp,
        cp=args.cp,
        pp_schedule=args.pp_schedule,
        microbatches=args.microbatches,
        compile=args.compile,
        float8=args.float8,
        async_tp=args.async_tp,
        hardware=hardware,
    )


def run(args: argparse.Namespace) -> str:
    """``fullshard plan``: the report (or JSON) for parsed ``args``."""
    analytic = args.params is not None
    if args.params is None and args.model is None:
        raise ValueError("give a parameter count (--params) or a model (--model)")
    for name in ("devices", "layers", "batch", "devices_per_node", "pp", "cp"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    config = plan_config(args, analytic)
    model_parallel = args.tp * args.pp * args.cp
    if args.tp < 1 or args.devices % model_parallel:
        raise ValueError(
            f"--tp {args.tp} x --pp {args.pp} x --cp {args.cp} must divide --devices {args.devices}"
        )
    if analytic and model_parallel > 1:
        raise ValueError("--tp/--pp/--cp need a model to split (--model); analytic mode has no "
                         "matrices")  # fmt: skip
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
