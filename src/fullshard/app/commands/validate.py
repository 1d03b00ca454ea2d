"""One validation step per command, before any rank starts.

A bad input must give one clear message and exit status 2, not a traceback from every rank behind
torchrun's ``ChildFailedError``. Each command that launches ranks has one function here, which
``fullshard.app.cli`` calls once per process before launching (the ranks it launches do not
validate again; under an external torchrun each rank runs it once): :func:`validate_train`,
:func:`validate_trace`, :func:`validate_bench` and :func:`validate_plan_check`, and
:func:`validate_plan` for the planner. Each raises :class:`ConfigError` saying what is wrong,
where (the flag or the file) and what to do.

Everything here is cheap and touches no device: flag values, file sizes and folder listings, model
configurations on paper. The only text ever read is a corpus already too small to train on by its
file sizes (to count its tokens exactly), or the built-in corpus; nothing is tokenized but bytes.
A prepared folder (``fullshard prepare``) is checked from its index and its files' stats; only a
shard whose stat changed since it was written is read (re-hashed, NOTE [Verifying token shards]).
A checkpoint to resume is checked from its manifest and its files' sizes; the ranks hash the
files (NOTE [Input errors on the ranks] in ``fullshard.app.errors``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

from fullshard.app.config import TrainConfig, reshard_after_forward_arg
from fullshard.app.data.checks import check_data
from fullshard.app.dims import ParallelDims
from fullshard.app.errors import ConfigError
from fullshard.policies import FullshardError

__all__ = [
    "check_model_spec",
    "model_context",
    "validate_bench",
    "validate_plan",
    "validate_plan_check",
    "validate_trace",
    "validate_train",
]


# ----------------------------------------------------------------------------------------------
# shared checks


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _at_least(args: object, minimum: int, *dests: str) -> None:
    for dest in dests:
        value = getattr(args, dest)
        if value < minimum:
            raise ConfigError(f"{_flag(dest)} must be at least {minimum}, got {value}")


def _positive_seconds(value: float, flag: str) -> None:
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{flag} must be a positive number of seconds, got {value}")


def _dims(
    dims: ParallelDims | int, tp: int = 1, strategy: str = "", shard_size: int = 0
) -> ParallelDims:
    """``dims``, or a world size taken as that many ranks on this machine."""
    if isinstance(dims, ParallelDims):
        return dims
    return ParallelDims(dims, dims, tp, strategy or "full_shard", shard_size)


def check_model_spec(spec: str, flag: str = "--model") -> tuple[str, str]:
    """``(kind, name)`` of a ``--model`` value (see ``resolve_model_spec``), or a
    :class:`ConfigError` naming the flag: unknown names, a missing ``transformers``."""
    from fullshard.app.models.gpt import resolve_model_spec

    try:
        kind, name = resolve_model_spec(spec)
    except ValueError as exc:
        raise ConfigError(f"{flag}: {exc}") from None
    if kind == "hf":
        from fullshard.app.models.hf import HF_CONFIGS, require_transformers

        try:
            require_transformers()
        except ImportError as exc:
            raise ConfigError(f"{flag} {spec}: {exc}") from None
        if name not in HF_CONFIGS and not (Path(name) / "config.json").is_file():
            known = ", ".join(f"hf:{n}" for n in HF_CONFIGS)
            raise ConfigError(
                f"{flag}: unknown Hugging Face model {name!r}: use one of {known} or a local "
                "directory with a config.json (nothing is downloaded)"
            )
    return kind, name


def model_context(kind: str, name: str) -> int | None:
    """The longest sequence a ``--model`` accepts, read from its configuration (no model is
    built); ``None`` when the configuration does not say."""
    if kind == "gpt":
        from fullshard.app.models.gpt import MODEL_SIZES

        return MODEL_SIZES[name].max_seq_len
    from fullshard.app.models.hf import HF_CONFIGS

    if name in HF_CONFIGS:
        config = HF_CONFIGS[name][1]
    else:
        path = Path(name) / "config.json"
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--model: cannot read {path} as JSON ({exc})") from None
    for key in ("max_position_embeddings", "n_positions"):
        value = config.get(key) if isinstance(config, dict) else None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _model_and_length(spec: str, seq_len: int, seq_flag: str) -> tuple[str, str]:
    """``--model`` names a model we can build, and ``seq_len`` fits its context (the one place
    this is checked); returns the model's ``(kind, name)``."""
    kind, name = check_model_spec(spec)
    context = model_context(kind, name)
    if context is not None and seq_len > context:
        raise ConfigError(
            f"{seq_flag} {seq_len} exceeds the {context}-token context of model {spec!r}: "
            f"use {seq_flag} {context} or less, or a model with a longer context"
        )
    return kind, name


def _writable_folder(path: str | Path, flag: str) -> None:
    """``path`` is a folder, or can be made one: no file stands in the way, and the nearest
    existing folder is writable."""
    p = Path(path)
    for q in (p, *p.parents):
        if not q.exists():
            continue
        if not q.is_dir():
            where = "is a file" if q == p else f"lies under {q}, which is a file"
            raise ConfigError(f"{flag} {path} {where}: give a folder (it is created if missing)")
        if not os.access(q, os.W_OK | os.X_OK):
            raise ConfigError(f"{flag} {path}: {q} is not writable: give a folder you can write")
        return


def _hybrid_group(dims: ParallelDims) -> int:
    """The shard group, with the engine's refusal in the flag's words."""
    try:
        return dims.shard_group()
    except FullshardError as exc:
        raise ConfigError(f"--strategy {dims.strategy}: {exc}") from None


# ----------------------------------------------------------------------------------------------
# train


def validate_train(cfg: TrainConfig, dims: ParallelDims | int) -> None:
    """Every check of ``fullshard train``. ``dims``: the run's parallel dimensions (a world size
    is taken as that many ranks on this machine)."""
    dims = _dims(dims, cfg.tp, cfg.strategy, cfg.shard_size)
    _check_numbers(cfg)
    if cfg.data is not None and not Path(cfg.data).exists():
        raise ConfigError(
            f"data path {cfg.data!r} does not exist: give a text file or a folder of text files "
            "(or omit --data for the built-in corpus)"
        )
    if cfg.tokenizer != "byte" and not Path(cfg.tokenizer).is_dir():
        raise ConfigError(
            f"tokenizer {cfg.tokenizer!r} is neither 'byte' nor a local tokenizer directory"
        )
    if cfg.elastic:
        _check_elastic(cfg)
    check_world(cfg, dims)
    kind, name = _model_and_length(cfg.model, cfg.seq_len, "--seq-len")
    if cfg.float8:
        if cfg.tp > 1:
            raise ConfigError("--float8 with --tp is not supported yet: drop one of them")
        from fullshard.app.models.wrap import float8_missing

        missing = float8_missing()
        if missing:
            raise ConfigError(missing)
    from fullshard.app.launch.local import check_devices

    device_type, _ = check_devices(cfg.device, cfg.backend, dims.local_world)  # none touched
    if cfg.optimizer_impl == "fused" and cfg.deterministic and device_type == "cpu":
        # measured: 49 of 60 seeded runs of 5 steps differed between a whole tensor and the
        # same tensor split in two or in 142 pieces (CUDA's fused kernel does one float
        # computation for every element)
        raise ConfigError(
            "--deterministic with --optimizer-impl fused on CPU: torch's CPU fused AdamW "
            "computes a shard's elements past its last full vector in double precision and the "
            "rest in float, so the weights' bits depend on how the rows are split over ranks. "
            "Use --optimizer-impl auto (the per-parameter loop on CPU), for-loop or foreach"
        )
    run_dir = Path(cfg.runs_dir) / cfg.name if cfg.name else Path(cfg.runs_dir)
    _writable_folder(run_dir, "--runs-dir/--name" if cfg.name else "--runs-dir")
    if cfg.checkpoint_dir is not None:
        _writable_folder(cfg.checkpoint_dir, "--checkpoint-dir")
    _check_resume(cfg)
    check_data(cfg, dims)
    if kind == "hf":
        _check_hf_weights(cfg.model, name)
    if cfg.tp > 1:
        _check_tensor_parallel(cfg)


def _check_numbers(cfg: TrainConfig) -> None:
    """Counts, fractions and rates in their ranges."""
    positive = (
        "seq_len", "batch_size", "grad_accum", "max_steps", "log_every", "nproc", "threads", "tp"
    )  # fmt: skip
    for key in positive:
        if getattr(cfg, key) < 1:
            raise ConfigError(f"{_flag(key)} must be at least 1, got {getattr(cfg, key)}")
    for key in (
        "eval_every", "eval_batches", "warmup_steps", "sample_tokens", "top_k", "shard_size",
        "max_restarts", "save_every", "keep", "stop_after", "micro_batch_size",
        "max_replacements",
    ):  # fmt: skip
        if getattr(cfg, key) < 0:
            raise ConfigError(f"{_flag(key)} must be >= 0, got {getattr(cfg, key)}")
    if not 0.0 <= cfg.val_fraction < 1.0:
        raise ConfigError(f"--val-fraction must be in [0, 1), got {cfg.val_fraction}")
    for key in ("lr", "timeout", "clip", "weight_decay", "temperature", "beta1", "beta2"):
        if not math.isfinite(getattr(cfg, key)):  # argparse's float() takes "nan" and "inf"
            raise ConfigError(f"{_flag(key)} must be a finite number")
    if cfg.lr <= 0 or cfg.timeout <= 0 or cfg.clip < 0 or cfg.weight_decay < 0:
        raise ConfigError("--lr and --timeout must be positive, --clip and --weight-decay >= 0")
    if not (0.0 <= cfg.beta1 < 1.0 and 0.0 <= cfg.beta2 < 1.0):
        raise ConfigError(
            f"AdamW's --beta1 and --beta2 must be in [0, 1), got {cfg.beta1} and {cfg.beta2}"
        )
    if not 0.0 <= cfg.min_lr_ratio <= 1.0:
        raise ConfigError(f"--min-lr-ratio must be in [0, 1], got {cfg.min_lr_ratio}")


def check_world(cfg: TrainConfig, dims: ParallelDims) -> None:
    """The checks that depend on the world size: the batch splits over it, the hybrid shard
    group and ``--reshard-after-forward`` fit it (``--elastic`` asks them of every world it
    could move to)."""
    _check_batch(cfg, dims)
    if dims.hybrid:
        _hybrid_group(dims)
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


def _check_elastic(cfg: TrainConfig) -> None:
    """``--elastic``: what live recovery supports (``fullshard.elastic``)."""
    from fullshard.app.dims import under_torchrun
    from fullshard.app.launch.elastic import RDZV_ENV

    if under_torchrun() and not os.environ.get(RDZV_ENV):
        raise ConfigError(
            "--elastic under torchrun needs fullshard's rendezvous, --rdzv-backend fullshard "
            "(torchrun's own restarts every worker when a node joins): torchrun --nnodes MIN:MAX "
            "--rdzv-backend fullshard --rdzv-endpoint HOST:PORT ..., or fullshard train --nproc N "
            "--elastic on one machine"
        )
    for flag, on in (
        ("--max-restarts", cfg.max_restarts > 0), ("--cpu-offload", cfg.cpu_offload),
        ("--async-save", cfg.async_save), ("--tp", cfg.tp > 1),
        ("--mixed-precision fp16", cfg.mixed_precision == "fp16"),
    ):  # fmt: skip
        if on:
            raise ConfigError(f"--elastic with {flag} is not supported: drop one of them")
    if cfg.elastic_every < 1:
        raise ConfigError(f"--elastic-every must be at least 1, got {cfg.elastic_every}")


def _micro_batches(cfg: TrainConfig, dims: ParallelDims, flag: str) -> int:
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
    micro = _micro_batches(cfg, dims, "--elastic")
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
    micro = _micro_batches(cfg, dims, "--deterministic")
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
    group = _hybrid_group(dims)
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


def resume_folder(cfg: TrainConfig) -> str | None:
    """The committed checkpoint folder ``--resume`` names now (``None``: none there)."""
    from fullshard.checkpoint.store import MANIFEST, latest_checkpoint

    if cfg.resume is None:
        return None
    if cfg.resume == "latest":
        root = cfg.checkpoint_dir or str(Path(cfg.runs_dir) / str(cfg.name) / "checkpoints")
        return latest_checkpoint(root)
    if os.path.isfile(os.path.join(cfg.resume, MANIFEST)):
        return cfg.resume
    return latest_checkpoint(cfg.resume)


def _check_resume(cfg: TrainConfig) -> None:
    """``--resume`` names a committed checkpoint that exists now, whose manifest parses and
    whose files are all there with their recorded sizes (the ranks hash them).

    ``latest`` is the newest under the run's checkpoint folder. A folder without one is an error
    rather than a fresh start: a typo in ``--name`` would otherwise silently train from scratch.
    (A run that torchrun restarts resumes from its latest checkpoint without ``--resume``, and
    starts fresh when it has none; see the trainer.)
    """
    if cfg.resume is None:
        return
    from fullshard.checkpoint.store import MANIFEST, verify

    fresh = "to start a new run instead, drop --resume"
    if cfg.resume != "latest" and not Path(cfg.resume).exists():
        raise ConfigError(f"--resume {cfg.resume!r}: no such checkpoint (or use 'latest')")
    if cfg.resume == "latest" and cfg.checkpoint_dir is None and cfg.name is None:
        raise ConfigError(
            "--resume latest continues a named run, but no --name was given (a run without one "
            "gets a new, empty folder): give the --name of the run to continue, or its "
            f"--checkpoint-dir; {fresh}"
        )
    folder = resume_folder(cfg)
    if folder is None and cfg.resume != "latest":
        raise ConfigError(
            f"--resume {cfg.resume}: not a committed checkpoint (no {MANIFEST}) nor a folder "
            f"holding one (step_N/): give a checkpoint folder, or 'latest'; {fresh}"
        )
    if folder is None:
        root = cfg.checkpoint_dir or str(Path(cfg.runs_dir) / str(cfg.name) / "checkpoints")
        raise ConfigError(
            f"--resume latest: {root} holds no committed checkpoint (check --name, --runs-dir "
            f"or --checkpoint-dir: they must be those of the run to continue); {fresh}"
        )
    problem = verify(folder, hashes=False)
    if problem:
        raise ConfigError(
            f"--resume {cfg.resume}: checkpoint {folder} is damaged: {problem}. Nothing was "
            "changed: resume from an earlier checkpoint (--resume PATH), or drop --resume"
        )
    from fullshard.checkpoint.store import read_manifest

    saved = read_manifest(folder).get("optimizer", "adamw")  # (older checkpoints: AdamW)
    if saved != cfg.optimizer:
        raise ConfigError(
            f"--resume {cfg.resume}: checkpoint {folder} holds {saved}'s optimizer state, and "
            f"this run asks for --optimizer {cfg.optimizer}: resume with --optimizer {saved}"
        )


# ----------------------------------------------------------------------------------------------
# trace, bench, plan --check


def _check_hf_weights(spec: str, name: str) -> None:
    """A local Hugging Face checkpoint's safetensors fit its model (``spec``, named ``name``):
    every parameter present with its shape, every shard file of the index there (headers only;
    the model on meta)."""
    from fullshard.app.models.hf import safetensors_dir

    folder = safetensors_dir(name)
    if folder is None:
        return
    from fullshard.app.models.gpt import build_model
    from fullshard.checkpoint import check_safetensors

    try:
        check_safetensors(build_model(spec, 256, device="meta"), folder)
    except FullshardError as exc:
        raise ConfigError(f"--model {spec}: {exc}") from None


def _check_tensor_parallel(cfg: TrainConfig) -> None:
    """The model has a TP plan and its split dimensions divide by ``--tp`` (on the meta
    device: no memory)."""
    from fullshard.app.models.gpt import build_model, unit_types_of
    from fullshard.app.models.tensor_parallel import check_divisible

    model = build_model(cfg.model, 256, device="meta")
    types = unit_types_of(model)
    for block in [m for m in model.modules() if isinstance(m, types)][:1]:
        check_divisible(block, cfg.tp)


def validate_trace(args: argparse.Namespace, dims: ParallelDims | int) -> None:
    """Every check of ``fullshard trace`` (``dims``: the ranks it will have)."""
    dims = _dims(dims, 1, args.strategy, args.shard_size)
    _at_least(args, 1, "nproc", "batch_size", "seq_len", "steps", "threads")
    _at_least(args, 0, "warmup", "shard_size")
    _positive_seconds(args.timeout, "--timeout")
    _model_and_length(args.model, args.seq_len, "--seq-len")
    if dims.hybrid:  # the size the ranks will choose (the engine's default when 0)
        _hybrid_group(dims)
    _writable_folder(args.out, "--out")
    from fullshard.app.launch.local import check_devices

    check_devices(args.device, args.backend, dims.local_world)


def validate_bench(args: argparse.Namespace) -> list[str]:
    """Every check of ``fullshard bench`` (outside torchrun); returns the variants to run."""
    from fullshard.app.commands.bench_variants import MIXED_PRECISION, parse_variants

    if args.mixed_precision not in MIXED_PRECISION:
        raise ConfigError(
            f"--mixed-precision {args.mixed_precision}: bench compares "
            f"{' and '.join(MIXED_PRECISION)} (fp16 needs loss scaling, which not every variant "
            "has): use one of those"
        )

    _at_least(args, 1, "nproc", "batch_size", "seq_len", "rounds", "threads", "memory_steps")
    _at_least(args, 0, "warmup")
    try:
        variants = parse_variants(args.variants, args.nproc)
    except ValueError as exc:
        raise ConfigError(f"--variants {args.variants}: {exc}") from None
    _positive_seconds(args.timeout, "--timeout")
    _model_and_length(args.model, args.seq_len, "--seq-len")
    _writable_folder(args.out, "--out")
    from fullshard.app.launch.local import check_devices

    check_devices(args.device, args.backend, args.nproc)
    return variants


def validate_plan(args: argparse.Namespace) -> None:
    """The numbers of ``fullshard plan`` (both modes): counts at least 1, a finite positive
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
    _at_least(args, 1, "devices", "layers", "batch", "devices_per_node", "tp", "pp", "cp")
    for dest in ("hidden", "heads", "seq", "hybrid_group", "vocab", "microbatches"):
        if getattr(args, dest, None) is not None:
            _at_least(args, 1, dest)


def validate_plan_check(args: argparse.Namespace) -> None:
    """Every check of ``fullshard plan --check``: the plan it compares with, and the run."""
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
    validate_plan(args)
    _at_least(args, 1, "check_steps")
    _model_and_length(args.model, args.seq or 128, "--seq")
    from fullshard.app.commands.plan_check import check_config, check_target

    try:
        check_config(args).shard_group(args.devices)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    from fullshard.app.launch.local import check_devices

    check_devices(*check_target(args), args.devices, flag="--check-device")
