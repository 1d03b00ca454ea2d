"""``fullshard plan``: its options, their validation, its run, and the report it prints.

The planner itself is a library (``fullshard.plan``); this module turns command-line options into
a :class:`~fullshard.plan.PlanConfig`, plans the model (``fullshard.app.models.planning`` builds
the application's models on the meta device for it) and formats the result. Its two other modes
run ranks: ``--check`` (``plan_check.py``: the plan against a measured run) and ``--calibrate``
(``plan_calibrate.py``: this machine's rates, for ``--gpu``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable

from fullshard.app.commands.checks import at_least, model_and_length
from fullshard.app.config import add_config_options
from fullshard.app.errors import ConfigError
from fullshard.app.launch.local import (
    check_devices,
    forward_flags,
    launch_local,
    under_torchrun,
    validated_by_launcher,
)
from fullshard.app.models.planning import plan_builtin
from fullshard.plan import GB, Plan, PlanConfig, fmt_bytes, plan_analytic, recommend
from fullshard.plan.accounting import Recommendation
from fullshard.plan.config import COMPILE_SCOPES, DTYPE_BYTES, OPTIMIZERS, PP_SCHEDULES
from fullshard.plan.hardware import hardware_names, load_hardware
from fullshard.plan.recommendation import describe
from fullshard.plan.transformer import POLICIES
from fullshard.policies import MEMORY_CATEGORIES, STEP_PHASES

__all__ = [
    "DESCRIPTION",
    "EPILOG",
    "HELP",
    "add_arguments",
    "format_plan",
    "make_plan",
    "plan_config",
    "plan_json",
    "report",
    "run",
    "validate",
    "validate_check",
]

HELP = "per-device memory and communication of a sharded run, before you buy hardware"
DESCRIPTION = (
    "Predict per-device memory (the ZeRO ladder, gathered window, activations, peak per phase) "
    "and communication per step, from a parameter count (analytic mode) or a model definition "
    "built on the meta device (model mode), and recommend a strategy."
)
EPILOG = """\
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


# ----------------------------------------------------------------------------------------------
# options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``fullshard plan``, by group: the model, the hardware, the training run,
    ``--check`` and ``--calibrate``."""
    _model_options(parser.add_argument_group("model (one of)"))
    _hardware_options(parser.add_argument_group("hardware"))
    _training_options(parser.add_argument_group("training"))
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    _check_options(parser.add_argument_group("check mode"))
    _calibration_options(parser.add_argument_group("calibration"))


def _model_options(what: argparse._ArgumentGroup) -> None:
    src = what.add_mutually_exclusive_group()
    src.add_argument("--params", type=float, help="parameter count, e.g. 7.5e9 (analytic mode)")
    src.add_argument(
        "--model",
        help="a fullshard.app.models.gpt name: tiny, demo, small, gpt2-124m, 1b, 7b, hf:NAME, or "
        "hf:DIR for a local Hugging Face config directory (model mode)",
    )
    what.add_argument(
        "--layers", type=int, default=32, help="analytic: transformer layers = units (default 32)"
    )
    what.add_argument(
        "--hidden", type=int, help="analytic: hidden size (default sqrt(params / (12 * layers)))"
    )
    what.add_argument("--heads", type=int, help="analytic: attention heads (default hidden/128)")
    what.add_argument(
        "--fused-attention",
        action="store_true",
        help="analytic: flash/fused attention (no s*s scores saved)",
    )
    what.add_argument(
        "--vocab",
        type=int,
        help="model: vocabulary size (default: a Hugging Face directory's own, from its "
        "config.json; 256 byte tokens for the built-in names)",
    )


def _hardware_options(hw: argparse._ArgumentGroup) -> None:
    hw.add_argument("--devices", type=int, required=True, help="number of devices (world size)")
    hw.add_argument(
        "--gpu",
        default="h100-80gb",
        help=f"the device: a preset ({', '.join(hardware_names())}) or a JSON file (what "
        "--calibrate writes; docs/plan.md shows its keys) (default h100-80gb)",
    )
    hw.add_argument(
        "--device-memory", type=float, help="memory per device in GB (default: the --gpu's)"
    )
    hw.add_argument(
        "--reserve",
        type=float,
        help="with --device-memory: the fraction kept back for context and fragmentation "
        "(default 0.1); else the --gpu's allocator factor and overhead decide",
    )
    hw.add_argument(
        "--devices-per-node",
        type=int,
        default=8,
        help="devices per node: the default hybrid group (default 8)",
    )


def _training_options(run_: argparse._ArgumentGroup) -> None:
    # fullshard train's own definitions: the plan reads them as a run would
    add_config_options(run_, "strategy", "tp")
    run_.add_argument("--pp", type=int, default=1, help="pipeline-parallel stages (default 1)")
    run_.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context-parallel degree: each sequence split over this many devices (default 1)",
    )
    run_.add_argument(
        "--pp-schedule",
        default="1f1b",
        choices=PP_SCHEDULES,
        help="pipeline schedule: 1f1b, or interleaved (2 stages per rank)",
    )
    run_.add_argument(
        "--microbatches", type=int, help="pipeline microbatches per step (default: --pp)"
    )
    run_.add_argument(
        "--hybrid-group",
        type=int,
        help="hybrid strategies: devices per shard group (default: per node)",
    )
    run_.add_argument(
        "--precision",
        choices=tuple(DTYPE_BYTES),
        help="fp32, or bf16/fp16 mixed precision with fp32 master weights (default: bf16 "
        "analytic, fp32 model mode as fullshard train)",
    )
    run_.add_argument(
        "--reduce-dtype", choices=tuple(DTYPE_BYTES), help="gradient reduction dtype (default fp32)"
    )
    run_.add_argument(
        "--optimizer",
        default="adam",
        choices=tuple(OPTIMIZERS),
        help="adam/adamw: 2 fp32 states (K = 12 B/param with the master copy in mixed "
        "precision); sgd-momentum: 1; sgd: 0 (default adam)",
    )
    run_.add_argument("--batch", type=int, default=1, help="sequences per device (default 1)")
    run_.add_argument(
        "--seq", type=int, help="tokens per sequence (default: 2048 analytic, 128 model mode)"
    )
    _compute_options(run_)


def _compute_options(run_: argparse._ArgumentGroup) -> None:
    """What the step computes and where: checkpointing, compilation, float8, async TP, offload,
    the collective backend."""
    run_.add_argument(
        "--activation-checkpointing",
        nargs="?",
        const="full",
        default="none",
        choices=POLICIES,
        help="none, selective (torchtitan's per-op policy: every other matmul's and attention's "
        "outputs kept) or full (each block's input kept); the flag alone is full (default none)",
    )
    run_.add_argument(
        "--compile",
        nargs="?",
        const="all",
        default="none",
        choices=COMPILE_SCOPES,
        help="torch.compile: the flag alone compiles the blocks and the loss (torchtitan's "
        "--training.compile since 2025); 'blocks' the blocks only (torchtitan in 2024)",
    )
    run_.add_argument(
        "--float8",
        action="store_true",
        help="float8 linears in the blocks, their weights all-gathered as float8",
    )
    run_.add_argument(
        "--async-tp",
        action="store_true",
        help="tensor parallel's collectives split under its matmuls",
    )
    run_.add_argument(
        "--offload",
        action="store_true",
        help="keep shards, gradients and the optimizer step on the CPU",
    )
    run_.add_argument(
        "--backend",
        default="nccl",
        choices=("nccl", "gloo"),
        help="collective backend: gloo's reduce-scatter needs one more buffer (default nccl)",
    )


def _check_options(check: argparse._ArgumentGroup) -> None:
    check.add_argument(
        "--check",
        action="store_true",
        help="model mode: also run the model on --devices local ranks and print predicted vs "
        "measured peak memory per phase and category",
    )
    check.add_argument(
        "--check-steps", type=int, default=2, help="measured training steps (default: 2)"
    )
    check.add_argument(
        "--check-device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="where the check runs: auto (CUDA if visible), cpu (gloo) or cuda (with the "
        "planned --backend: nccl, one GPU per rank, or gloo, the ranks sharing the GPUs)",
    )


def _calibration_options(cal: argparse._ArgumentGroup) -> None:
    cal.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine on --devices local ranks (matmul rate, memory bandwidth, the "
        "backend's collective bandwidth) and write --calibration",
    )
    cal.add_argument(
        "--calibration",
        default="fullshard-calibration.json",
        help="where --calibrate writes this machine's description (for --gpu)",
    )


# ----------------------------------------------------------------------------------------------
# validation


def validate(args: argparse.Namespace) -> None:
    """The numbers of ``fullshard plan`` (every mode): counts at least 1, a finite positive
    ``--params``, a finite positive ``--device-memory`` and a ``--reserve`` fraction in [0, 1).
    argparse's ``float`` takes ``inf``, ``nan`` and negative numbers; the planner would turn
    them into a traceback or a report of negative gigabytes."""
    if args.params is not None and not (math.isfinite(args.params) and args.params >= 1):
        raise ConfigError(
            f"--params {args.params} is not a parameter count: give a finite number of at "
            "least 1, e.g. --params 7e9"
        )
    memory, reserve = args.device_memory, args.reserve
    if memory is not None and not (math.isfinite(memory) and memory > 0):
        raise ConfigError(
            f"--device-memory {memory} is not a memory size: give the GB of one "
            "device, a finite positive number, e.g. --device-memory 80"
        )
    if reserve is not None and not (math.isfinite(reserve) and 0.0 <= reserve < 1.0):
        raise ConfigError(
            f"--reserve {reserve} is not a fraction of device memory: give a number in "
            "[0, 1), e.g. --reserve 0.1 (10% kept back)"
        )
    if not args.calibrate and args.params is None and args.model is None:
        raise ConfigError("give a parameter count (--params) or a model (--model), or --calibrate")
    at_least(args, 1, "devices", "layers", "batch", "devices_per_node", "tp", "pp", "cp")
    for dest in ("hidden", "heads", "seq", "hybrid_group", "vocab", "microbatches"):
        if getattr(args, dest, None) is not None:
            at_least(args, 1, dest)


def validate_check(args: argparse.Namespace) -> None:
    """Every check of ``fullshard plan --check``: the plan it compares with, and the run."""
    from fullshard.app.commands.plan_check import check_config, check_target

    if args.model is None:
        raise ConfigError("--check runs a model: give --model (model mode)")
    if getattr(args, "tp", 1) > 1:
        raise ConfigError("--check does not run tensor parallel yet: drop --tp (or --check)")
    unrun = [f"--{name.replace('_', '-')}" for name in ("pp", "cp") if getattr(args, name) > 1]
    unrun += [
        f"--{name.replace('_', '-')}" for name in ("float8", "async_tp") if getattr(args, name)
    ]
    unrun += ["--compile"] if args.compile != "none" else []
    unrun += ["--activation-checkpointing selective"] * (
        args.activation_checkpointing == "selective"
    )
    if unrun:
        raise ConfigError(
            f"--check runs the model with fullshard's trainer, which does not run {', '.join(unrun)}"
            " here: drop them (or --check)"
        )
    validate(args)
    at_least(args, 1, "check_steps")
    model_and_length(args.model, args.seq or 128, "--seq")
    try:
        check_config(args).shard_group(args.devices)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    check_devices(*check_target(args), args.devices, flag="--check-device")


# ----------------------------------------------------------------------------------------------
# the run


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """The report (one process); ``--check`` and ``--calibrate`` launch ``--devices`` local
    ranks (or, under torchrun, run as one of them)."""
    if args.calibrate:
        return _ranks(args, _calibrate)
    if args.check:
        if not validated_by_launcher():
            validate_check(args)
        return _ranks(args, _check)
    validate(args)
    try:
        print(report(args))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return 0


def _ranks(args: argparse.Namespace, rank_work: Callable[[argparse.Namespace], int]) -> int:
    """Outside torchrun: launch ``--devices`` local ranks with these options (full-name flags);
    under torchrun: this rank's part of the mode (``rank_work``)."""
    if not under_torchrun():
        parser = argparse.ArgumentParser(allow_abbrev=False)
        add_arguments(parser)
        return launch_local(args.devices, ["plan", *forward_flags(parser, args)])
    return rank_work(args)


def _check(args: argparse.Namespace) -> int:
    """One rank of ``--check``; rank 0 prints predicted against measured."""
    from fullshard.app.commands.plan_check import check_json, check_rank, format_check

    res = check_rank(args)
    if os.environ["RANK"] == "0":
        print(check_json(res) if args.json else format_check(res), flush=True)
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    """One rank of ``--calibrate``; rank 0 says what it wrote."""
    from fullshard.app.commands.plan_calibrate import calibrate_rank

    data = calibrate_rank(args)
    if data is not None:
        rate, bw = data["matmul_flops"]["fp32"], data["memory_bandwidth"]
        link = data["intra_node_bandwidth"]
        print(
            f"wrote {args.calibration}: matmul {rate / 1e9:.1f} GFLOP/s, memory "
            f"{bw / 1e9:.1f} GB/s, collectives {link / 1e9:.2f} GB/s per rank "
            f"({data['name']}); plan with --gpu {args.calibration}",
            flush=True,
        )
    return 0


def report(args: argparse.Namespace) -> str:
    """``fullshard plan``'s report (or JSON) for parsed ``args``."""
    analytic = args.params is not None
    if args.params is None and args.model is None:
        raise ValueError("give a parameter count (--params) or a model (--model)")
    config = plan_config(args, analytic)
    model_parallel = args.tp * args.pp * args.cp
    if args.devices % model_parallel:
        raise ValueError(
            f"--tp {args.tp} x --pp {args.pp} x --cp {args.cp} must divide --devices {args.devices}"
        )
    if analytic and model_parallel > 1:
        raise ValueError(
            "--tp/--pp/--cp need a model to split (--model); analytic mode has no matrices"
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
            model,
            world_size,
            config,
            vocab_size=vocab_size,
            with_recommendation=with_recommendation,
        )
    assert params is not None

    def evaluate(cfg: PlanConfig) -> Plan:
        return plan_analytic(
            params,
            world_size,
            cfg,
            layers=layers,
            hidden=hidden,
            heads=heads,
            fused_attention=fused_attention,
        )

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
    parts = [
        f"tp {cfg.tp}" if cfg.tp > 1 else "",
        f"pp {cfg.pp} ({cfg.pp_schedule})" if cfg.pp > 1 else "",
        f"cp {cfg.cp}" if cfg.cp > 1 else "",
        f"torch.compile ({cfg.compile})" if cfg.compile_blocks else "",
        "float8" if cfg.float8 else "",
        "async TP" if cfg.async_tp else "",
    ]
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
