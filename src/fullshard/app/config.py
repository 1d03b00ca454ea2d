"""``TrainConfig``: every option of ``fullshard train``, from defaults, a TOML file and the CLI.

Precedence: dataclass defaults < ``--config FILE.toml`` < command-line flags. The argparse parser
is generated from the dataclass fields (their ``help`` metadata), so ``fullshard train --help``
documents every option and cannot drift from the config. :func:`validate` raises
:class:`ConfigError` with the same message on every rank, before any collective runs.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import sys
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from fullshard.policies import STRATEGY_NAMES, FullshardError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "ConfigError",
    "TrainConfig",
    "add_train_arguments",
    "check_model_spec",
    "config_from_args",
    "load_toml",
    "reshard_after_forward_arg",
    "to_flags",
    "to_toml",
    "validate",
]

MIXED_PRECISION = ("none", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "nccl", "gloo")  # fullshard.app.launch.BACKENDS; here to keep config light


class ConfigError(ValueError):
    """Bad training input: the message says what is wrong and what to do."""


def _opt(default: Any, help: str, *, group: str, choices: tuple[str, ...] | None = None) -> Any:
    return field(default=default, metadata={"help": help, "group": group, "choices": choices})


@dataclass
class TrainConfig:
    """Every option of a training run (see ``fullshard train --help``)."""

    # model and data
    model: str = _opt(
        "demo",
        "model: a built-in size (tiny, demo, small, gpt2-124m, 1b, 7b), hf:NAME for a built-in "
        "Hugging Face config (llama-tiny, gpt2-tiny, gpt2, llama-1b), or hf:DIR / DIR for a local "
        "Hugging Face config or checkpoint directory",
        group="model and data",
    )
    data: str | None = _opt(
        None,
        "training text: a file, a folder of .txt/.md/.rst files, or a folder made by fullshard "
        "prepare (token shards, memory-mapped; its split and tokenizer are checked) (default: "
        "Python's bundled documentation topics, pydoc_data.topics)",
        group="model and data",
    )
    tokenizer: str = _opt(
        "byte",
        "'byte' (UTF-8 bytes, vocabulary 256) or a local Hugging Face tokenizer directory",
        group="model and data",
    )
    val_fraction: float = _opt(
        0.05,
        "fraction of the text held out for validation (evenly spaced 4096-token blocks)",
        group="model and data",
    )
    seq_len: int = _opt(128, "tokens per training sequence", group="model and data")
    # optimisation
    batch_size: int = _opt(
        16,
        "global batch: sequences per optimizer step over all ranks and accumulation steps; "
        "must be divisible by world size x --grad-accum",
        group="optimisation",
    )
    grad_accum: int = _opt(
        1,
        "micro-batches accumulated per optimizer step (no gradient sync until the last)",
        group="optimisation",
    )
    max_steps: int = _opt(600, "optimizer steps to train", group="optimisation")
    lr: float = _opt(3e-3, "peak learning rate (AdamW)", group="optimisation")
    min_lr_ratio: float = _opt(
        0.1, "final learning rate of the cosine decay, as a fraction of --lr", group="optimisation"
    )
    warmup_steps: int = _opt(20, "linear warmup steps", group="optimisation")
    weight_decay: float = _opt(
        0.1, "AdamW weight decay (not applied to biases, norms, embeddings)", group="optimisation"
    )
    beta1: float = _opt(0.9, "AdamW beta1", group="optimisation")
    beta2: float = _opt(0.95, "AdamW beta2", group="optimisation")
    clip: float = _opt(
        1.0, "clip the global gradient norm to this (0 disables)", group="optimisation"
    )
    seed: int = _opt(1234, "seed for weights, data order and sampling", group="optimisation")
    # sharding
    strategy: str = _opt(
        "full_shard",
        "full_shard (blocks free their gathered parameters after forward), shard_grad_op (keep "
        "them until backward), no_shard (replicate, all-reduce), hybrid_shard / "
        "hybrid_shard_zero2 (shard inside groups of --shard-size ranks, replicate across them)",
        group="sharding",
        choices=STRATEGY_NAMES,
    )
    shard_size: int = _opt(
        0,
        "hybrid strategies: ranks per shard group (0: ranks per node, or half the world on one "
        "node)",
        group="sharding",
    )
    tp: int = _opt(
        1,
        "tensor parallel: split each block's matrices over this many consecutive ranks; the "
        "strategy shards over the rest (world / tp data-parallel ranks)",
        group="sharding",
    )
    activation_checkpointing: bool = _opt(
        False, "recompute each block's activations in backward (less memory)", group="sharding"
    )
    mixed_precision: str = _opt(
        "none",
        "compute dtype for gathered parameters (gradients are reduced in float32)",
        group="sharding",
        choices=MIXED_PRECISION,
    )
    float8: bool = _opt(
        False,
        "train the blocks' linear layers in float8 and all-gather their weights as float8 "
        "(torchao's Float8Linear with enable_fsdp_float8_all_gather; needs torchao, "
        "pip install 'fullshard[float8]', and a GPU with float8 matmuls, e.g. H100)",
        group="sharding",
    )
    cpu_offload: bool = _opt(
        False,
        "keep the parameter shards, gradients and optimizer state on the host "
        "(fullshard.CPUOffloadPolicy): units are copied to the device to be gathered and "
        "the optimizer steps on the CPU; less device memory, host-device copies every step "
        "(on CPU ranks everything is on the host already)",
        group="sharding",
    )
    reshard_after_forward: str | None = _opt(
        None,
        "what the blocks do with their gathered parameters after forward: true (free them), "
        "false (keep them for backward) or N (keep them sharded over N consecutive ranks, so "
        "backward gathers within that smaller group, e.g. a node; N divides the shard group, "
        "1 is false and the group size is true). Default: the --strategy's (true for "
        "full_shard and hybrid_shard, false for the others); a value given overrides it",
        group="sharding",
    )
    # evaluation and output
    eval_every: int = _opt(
        100, "evaluate on the validation split every N steps (0: only at the end)", group="output"
    )
    eval_batches: int = _opt(8, "validation micro-batches per rank per evaluation", group="output")
    log_every: int = _opt(
        10, "log metrics every N steps (the first step is always logged)", group="output"
    )
    sample_tokens: int = _opt(300, "tokens to sample at the end (0: no sample)", group="output")
    prompt: str = _opt("The ", "prompt for the final sample", group="output")
    temperature: float = _opt(0.8, "sampling temperature (0: greedy)", group="output")
    top_k: int = _opt(40, "sample among the k most likely tokens (0: all)", group="output")
    runs_dir: str = _opt("runs", "parent folder of run folders", group="output")
    name: str | None = _opt(
        None, "run folder name under --runs-dir (default: a timestamp)", group="output"
    )
    progress: bool = _opt(True, "show a progress bar on rank 0", group="output")
    # checkpoints
    checkpoint_dir: str | None = _opt(
        None,
        "folder for sharded checkpoints (default: RUN_FOLDER/checkpoints)",
        group="checkpoints",
    )
    save_every: int = _opt(
        0, "save a checkpoint every N steps (0: only at the end)", group="checkpoints"
    )
    keep: int = _opt(3, "keep the last N committed checkpoints", group="checkpoints")
    async_save: bool = _opt(
        False, "write checkpoints in the background while training goes on", group="checkpoints"
    )
    resume: str | None = _opt(
        None,
        "resume from 'latest' (the newest committed checkpoint under the checkpoint folder) or "
        "a checkpoint path; needs the same --name or --checkpoint-dir as the run it continues",
        group="checkpoints",
    )
    stop_after: int = _opt(
        0,
        "stop (with a checkpoint) after this many steps of this invocation, as if preempted; "
        "resume with --resume latest (0: run to --max-steps)",
        group="checkpoints",
    )
    on_nonfinite: str = _opt(
        "skip",
        "a non-finite loss or gradient on any rank: skip the optimizer step on every rank "
        "(skip) or stop the run with an error (stop)",
        group="optimisation",
        choices=("skip", "stop"),
    )
    # launch
    max_restarts: int = _opt(
        0,
        "restart all ranks this many times after a failure (torch.distributed.run "
        "--max-restarts); a restarted run resumes from its latest checkpoint",
        group="launch",
    )
    nproc: int = _opt(
        2,
        "local ranks to launch through torch.distributed.run (ignored under torchrun, which "
        "sets the world size)",
        group="launch",
    )
    device: str = _opt(
        "auto",
        "auto (one GPU per rank with NCCL if CUDA is present, else CPU with gloo), cpu or cuda",
        group="launch",
        choices=DEVICES,
    )
    backend: str = _opt(
        "auto",
        "process-group backend: auto (NCCL on CUDA, gloo on CPU), nccl, or gloo (on CUDA: the "
        "ranks share the visible GPUs, rank r on cuda:(r %% GPUs); a test mode, as NCCL refuses "
        "two ranks on one GPU)",
        group="launch",
        choices=BACKENDS,
    )
    threads: int = _opt(1, "torch threads per rank on CPU", group="launch")
    timeout: float = _opt(
        300.0, "seconds any collective may wait before the run fails", group="launch"
    )

    def micro_batch(self, world_size: int) -> int:
        """Sequences per rank per micro-batch (the TP ranks of a data-parallel rank share it)."""
        return self.batch_size // (world_size // self.tp * self.grad_accum)


def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(TrainConfig)


def _base_type(tp: Any) -> type:
    """``int`` for ``int``, ``str`` for ``str | None``."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args else tp


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--config`` and one flag per :class:`TrainConfig` field, grouped as in the dataclass.

    Defaults are suppressed so that only flags the user typed override the TOML file.
    """
    parser.add_argument(
        "--config", metavar="FILE", help="TOML file of options (keys as below); flags override it"
    )
    types = _field_types()
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in fields(TrainConfig):
        meta = f.metadata
        group = groups.setdefault(meta["group"], parser.add_argument_group(meta["group"]))
        flag = "--" + f.name.replace("_", "-")
        tp = _base_type(types[f.name])
        help_text = meta["help"] + ("" if f.default is None else f" (default: {f.default})")
        if tp is bool:
            group.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=help_text,
            )
        else:
            group.add_argument(
                flag,
                type=tp,
                choices=meta["choices"],
                default=argparse.SUPPRESS,
                metavar=f.name.upper() if meta["choices"] is None else None,
                help=help_text,
            )


def load_toml(path: str) -> dict[str, Any]:
    """Read a TOML config: top-level keys, or a ``[train]`` table; ``-`` in keys reads as ``_``."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        raw = tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    if isinstance(raw.get("train"), dict):
        raw = raw["train"]
    return {k.replace("-", "_"): v for k, v in raw.items()}


def _check_values(values: dict[str, Any], source: str) -> dict[str, Any]:
    """Reject unknown keys and wrongly typed values, naming the key and the source."""
    types = _field_types()
    out = {}
    for key, value in values.items():
        if key not in types:
            close = difflib.get_close_matches(key, list(types), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown option {key!r} in {source}{hint}")
        tp = _base_type(types[key])
        if key == "reshard_after_forward" and isinstance(value, (bool, int)):
            value = str(value).lower()  # TOML's true / 2 read as the flag's words
        if tp is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            raise ConfigError(f"option {key!r} in {source} must be {tp.__name__}, got {value!r}")
        choices = next(f.metadata["choices"] for f in fields(TrainConfig) if f.name == key)
        if choices is not None and value not in choices:
            raise ConfigError(f"option {key!r} in {source} must be one of {', '.join(choices)}")
        out[key] = value
    return out


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Resolve the config: defaults, then ``args.config`` (TOML), then the flags given."""
    values: dict[str, Any] = {}
    config_path = getattr(args, "config", None)
    if config_path:
        values.update(_check_values(load_toml(config_path), config_path))
    names = {f.name for f in fields(TrainConfig)}
    values.update({k: v for k, v in vars(args).items() if k in names})
    return TrainConfig(**values)


def to_flags(cfg: TrainConfig, *, exclude: tuple[str, ...] = ()) -> list[str]:
    """Command-line flags (full names) that reproduce ``cfg``: the options that differ from the
    defaults, minus ``exclude``. Used to hand the resolved config to launched ranks.
    """
    flags: list[str] = []
    for f in fields(TrainConfig):
        value = getattr(cfg, f.name)
        if f.name in exclude or value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            # "--flag=value" keeps a value that starts with "-" from reading as an option.
            flags.append(f"{flag}={value!r}" if isinstance(value, float) else f"{flag}={value}")
    return flags


def to_toml(cfg: TrainConfig) -> str:
    """The resolved config as TOML (``load_toml`` reads it back to the same config)."""
    lines = ["# fullshard train: resolved configuration (defaults < config file < flags)"]
    for f in fields(TrainConfig):
        value = getattr(cfg, f.name)
        if value is None:
            lines.append(f"# {f.name} = (unset)")
        elif isinstance(value, bool):
            lines.append(f"{f.name} = {'true' if value else 'false'}")
        elif isinstance(value, (int, float)):
            lines.append(f"{f.name} = {value!r}")
        else:
            # JSON string escapes are valid TOML basic-string escapes.
            lines.append(f"{f.name} = {json.dumps(value)}")
    return "\n".join(lines) + "\n"


def reshard_after_forward_arg(value: str | None) -> bool | int | None:
    """``--reshard-after-forward`` as ``fully_shard`` takes it: ``None`` (unset: the strategy's
    default), ``True``/``False``, or a number of ranks. Raises :class:`ConfigError` for any
    other word; whether a number fits the shard group is ``validate_train``'s check."""
    if value is None:
        return None
    word = value.strip().lower()
    if word in ("true", "false"):
        return word == "true"
    if word.isascii() and word.isdigit() and int(word) >= 1:
        return int(word)
    raise ConfigError(
        f"--reshard-after-forward {value!r} is neither true, false nor a number of ranks: give "
        "true (free the blocks' gathered parameters after forward), false (keep them for "
        "backward) or N >= 1 (keep them sharded over N ranks), or drop it for the --strategy's "
        "default"
    )


def hybrid_shard_size(cfg: TrainConfig, world_size: int) -> int:
    """Ranks per shard group for the hybrid strategies (``--shard-size``, or the engine's
    default, :func:`fullshard.engine.sharding.hybrid_shard_size`)."""
    from fullshard.engine.sharding import hybrid_shard_size as default

    # tensor parallel: the strategy shards over the data-parallel ranks only
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) // cfg.tp
    return default(world_size // cfg.tp, cfg.shard_size, max(local, 1))


def check_model_spec(spec: str, flag: str = "--model") -> tuple[str, str]:
    """``(kind, name)`` of a ``--model`` value (see ``resolve_model_spec``), or a
    :class:`ConfigError` naming the flag: unknown names, a missing ``transformers``."""
    from fullshard.app.models import resolve_model_spec

    try:
        kind, name = resolve_model_spec(spec)
    except ValueError as exc:
        raise ConfigError(f"{flag}: {exc}") from None
    if kind == "hf":
        from fullshard.app.hf import HF_CONFIGS, require_transformers

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


def validate(cfg: TrainConfig, world_size: int) -> None:
    """Raise :class:`ConfigError` for bad input. Pure: same answer on every rank."""
    from fullshard.app.models import MODEL_SIZES

    kind, name = check_model_spec(cfg.model)
    if cfg.data is not None and not Path(cfg.data).exists():
        raise ConfigError(
            f"data path {cfg.data!r} does not exist: give a text file or a folder of text files "
            "(or omit --data for the built-in corpus)"
        )
    if cfg.tokenizer != "byte" and not Path(cfg.tokenizer).is_dir():
        raise ConfigError(
            f"tokenizer {cfg.tokenizer!r} is neither 'byte' nor a local tokenizer directory"
        )
    positive = (
        "seq_len", "batch_size", "grad_accum", "max_steps", "log_every", "nproc", "threads", "tp"
    )  # fmt: skip
    for key in positive:
        if getattr(cfg, key) < 1:
            raise ConfigError(
                f"--{key.replace('_', '-')} must be at least 1, got {getattr(cfg, key)}"
            )
    for key in (
        "eval_every",
        "eval_batches",
        "warmup_steps",
        "sample_tokens",
        "top_k",
        "shard_size",
        "max_restarts",
        "save_every",
        "keep",
        "stop_after",
    ):
        if getattr(cfg, key) < 0:
            raise ConfigError(f"--{key.replace('_', '-')} must be >= 0, got {getattr(cfg, key)}")
    if not 0.0 <= cfg.val_fraction < 1.0:
        raise ConfigError(f"--val-fraction must be in [0, 1), got {cfg.val_fraction}")
    for key in ("lr", "timeout", "clip", "weight_decay", "temperature", "beta1", "beta2"):
        if not math.isfinite(getattr(cfg, key)):  # argparse's float() takes "nan" and "inf"
            raise ConfigError(f"--{key.replace('_', '-')} must be a finite number")
    if cfg.lr <= 0 or cfg.timeout <= 0 or cfg.clip < 0 or cfg.weight_decay < 0:
        raise ConfigError("--lr and --timeout must be positive, --clip and --weight-decay >= 0")
    if not (0.0 <= cfg.beta1 < 1.0 and 0.0 <= cfg.beta2 < 1.0):
        raise ConfigError(
            f"AdamW's --beta1 and --beta2 must be in [0, 1), got {cfg.beta1} and {cfg.beta2}"
        )
    if not 0.0 <= cfg.min_lr_ratio <= 1.0:
        raise ConfigError(f"--min-lr-ratio must be in [0, 1], got {cfg.min_lr_ratio}")
    if world_size % cfg.tp:
        raise ConfigError(
            f"--tp {cfg.tp} does not divide the {world_size} ranks: each data-parallel rank needs "
            f"{cfg.tp} ranks for tensor parallel; use --nproc {cfg.tp * max(1, world_size // cfg.tp)}"
        )
    per_step = world_size // cfg.tp * cfg.grad_accum
    if cfg.batch_size % per_step != 0:
        lower = max(per_step, cfg.batch_size - cfg.batch_size % per_step)
        raise ConfigError(
            f"--batch-size {cfg.batch_size} (global) is not divisible by world size {world_size} "
            + (f"/ --tp {cfg.tp} " if cfg.tp > 1 else "")
            + f"x --grad-accum {cfg.grad_accum} = {per_step}: every rank needs the same whole "
            f"number of sequences per micro-batch. Use e.g. --batch-size {lower} or "
            f"{lower + per_step}."
        )
    if cfg.strategy.startswith("hybrid"):
        try:
            hybrid_shard_size(cfg, world_size)
        except FullshardError as exc:
            raise ConfigError(f"--strategy {cfg.strategy}: {exc}") from None
    if cfg.resume is not None and cfg.resume != "latest" and not Path(cfg.resume).exists():
        raise ConfigError(f"--resume {cfg.resume!r}: no such checkpoint (or use 'latest')")
    if kind == "gpt" and cfg.seq_len > MODEL_SIZES[name].max_seq_len:
        raise ConfigError(
            f"--seq-len {cfg.seq_len} exceeds model {name!r}'s context of "
            f"{MODEL_SIZES[name].max_seq_len} tokens"
        )
    if cfg.float8 and cfg.tp > 1:
        raise ConfigError("--float8 with --tp is not supported yet: drop one of them")
    if cfg.float8:
        from fullshard.app.wrap import float8_missing

        missing = float8_missing()
        if missing:
            raise ConfigError(missing)
    from fullshard.app.launch import check_devices

    # No device is touched: the same verdict on every rank, and in the CLI before launching.
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    check_devices(cfg.device, cfg.backend, local)
