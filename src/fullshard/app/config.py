"""``TrainConfig``: every option of ``fullshard train``, from defaults, a TOML file and the CLI.

Precedence: dataclass defaults < ``--config FILE.toml`` < command-line flags. The argparse parser
is generated from the dataclass fields (their ``help`` metadata), so ``fullshard train --help``
documents every option and cannot drift from the config. This module is the data only:
checking the values (and the files, models and devices they name) is
:mod:`fullshard.app.commands.train`'s, once per process before launch.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from fullshard.app.errors import ConfigError
from fullshard.policies import STRATEGY_NAMES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "ConfigError",
    "TrainConfig",
    "add_config_options",
    "add_train_arguments",
    "config_from_args",
    "load_toml",
    "from_env",
    "reshard_after_forward_arg",
    "to_env",
    "to_toml",
]

MIXED_PRECISION = ("none", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda")
OPTIMIZER_IMPLS = ("auto", "for-loop", "foreach", "fused")  # --optimizer-impl (app/train/build.py)
OPTIMIZERS = ("adamw", "muon")  # --optimizer (app/train/build.py)
BACKENDS = ("auto", "nccl", "gloo")  # --backend; fullshard.app.launch.local resolves them
CONFIG_ENV = "FULLSHARD_TRAIN_CONFIG"  # the validated config a launcher hands its ranks (JSON)


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
    deterministic: bool = _opt(
        False,
        "the same weights, bit for bit, at 1, 2, 4 or 8 ranks and after a resume on another "
        "world size: a global sampler (each step's batch is the same windows at any world "
        "size), micro-batches of a fixed --micro-batch-size, and every sum in a fixed order "
        "(fullshard.deterministic; one reduce-scatter per micro-batch)",
        group="optimisation",
    )
    micro_batch_size: int = _opt(
        0,
        "--deterministic: sequences per micro-batch, the same at every world size (0: "
        "--batch-size / 8, or / its largest power-of-two factor below 8)",
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
    optimizer_impl: str = _opt(
        "auto",
        "AdamW's implementation: auto (fused on the GPU path, where the device then skips a "
        "non-finite step itself; torch's default elsewhere, a per-parameter loop on CPU), "
        "for-loop, foreach or fused (on CPU several times faster than the loop, with other "
        "rounding; a GPU run with for-loop or foreach has the host decide each step, one "
        "synchronisation per step)",
        group="optimisation",
        choices=OPTIMIZER_IMPLS,
    )
    optimizer: str = _opt(
        "adamw",
        "adamw, or muon: fullshard.optim.Muon for the blocks' weight matrices (each matrix's "
        "Newton-Schulz on one rank; --lr and --weight-decay as AdamW's, adjusted to AdamW's "
        "update size), AdamW (--optimizer-impl) for embeddings, head, norms and biases",
        group="optimisation",
        choices=OPTIMIZERS,
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
    eval_batches: int = _opt(
        8,
        "validation micro-batches per rank per evaluation (--deterministic: in all)",
        group="output",
    )
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
    elastic: bool = _opt(
        False,
        "live recovery: when a rank's process (or node) dies, the others keep running, rebuild "
        "its shards in memory from their copies (a ring neighbour's, or another replica's under "
        "HSDP), reshard to the new world and replay the steps since; a replacement, or a "
        "restarted node, joins at a step boundary (fullshard.elastic; the global sampler of "
        "--deterministic; with it, the bits of the uninterrupted run; --nproc N, or torchrun "
        "--rdzv-backend fullshard)",
        group="launch",
    )
    elastic_every: int = _opt(
        1,
        "--elastic: copy the shards to host memory every this many steps, and send each copy "
        "to the ring neighbour at the next (recovery replays the steps since)",
        group="launch",
    )
    max_replacements: int = _opt(
        2,
        "--elastic --nproc: replacement processes to start in all; after that the others go on "
        "at a smaller world where the job can run at one",
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

    @property
    def global_sampler(self) -> bool:
        """Whether every rank draws the step's whole global batch, cut into micro-batches of
        ``--micro-batch-size`` (``fullshard.app.train.fixed_order``): with ``--deterministic``, and
        with ``--elastic``, whose memberships change the world size a step runs at."""
        return self.deterministic or self.elastic

    def micro_batch(self, dp: int) -> int:
        """Sequences per rank per micro-batch over ``dp`` data-parallel ranks (the TP ranks of
        a data-parallel rank share it: ``ParallelDims.dp``); with the global sampler the fixed
        ``--micro-batch-size``, whatever ``dp``."""
        if self.global_sampler:
            return self.micro_batch_size or self.batch_size // min(
                8, self.batch_size & -self.batch_size
            )
        return self.batch_size // (dp * self.grad_accum)


def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(TrainConfig)


def _base_type(tp: Any) -> type:
    """``int`` for ``int``, ``str`` for ``str | None``."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args else tp


def _add_field(
    group: argparse._ActionsContainer, name: str, default: Any, help_text: str | None = None
) -> None:
    """One flag for the :class:`TrainConfig` field ``name``: its type, choices and help."""
    f = _FIELDS[name]
    flag = "--" + name.replace("_", "-")
    tp = _base_type(_field_types()[name])
    shown = f.default if default is argparse.SUPPRESS else default
    text = (help_text or f.metadata["help"]) + ("" if shown is None else f" (default: {shown})")
    if tp is bool:
        group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=text)
        return
    choices = f.metadata["choices"]
    group.add_argument(
        flag,
        type=tp,
        choices=choices,
        default=default,
        metavar=name.upper() if choices is None else None,
        help=text,
    )


_FIELDS = {f.name: f for f in fields(TrainConfig)}


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--config`` and one flag per :class:`TrainConfig` field, grouped as in the dataclass.

    Defaults are suppressed so that only flags the user typed override the TOML file.
    """
    parser.add_argument(
        "--config", metavar="FILE", help="TOML file of options (keys as below); flags override it"
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in fields(TrainConfig):
        meta = f.metadata
        group = groups.setdefault(meta["group"], parser.add_argument_group(meta["group"]))
        _add_field(group, f.name, argparse.SUPPRESS)


def add_config_options(
    parser: argparse._ActionsContainer,
    *names: str,
    defaults: dict[str, Any] | None = None,
    helps: dict[str, str] | None = None,
) -> None:
    """The flags of ``fullshard train`` named ``names`` (field names), for another command
    (trace, bench, plan): one definition per option, so a flag means and checks the same
    everywhere. ``defaults``: the command's own defaults (else the field's); ``helps``: a help
    text where the command uses the option more narrowly (e.g. bench's launch timeout)."""
    for name in names:
        if name not in _FIELDS:
            raise KeyError(f"{name!r} is no TrainConfig field")
        default = (defaults or {}).get(name, _FIELDS[name].default)
        _add_field(parser, name, default, (helps or {}).get(name))


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


def to_env(cfg: TrainConfig) -> dict[str, str]:
    """The validated ``cfg`` as the environment a launcher hands its ranks: they read the
    config itself back (:func:`from_env`), not flags to parse and check again."""
    return {CONFIG_ENV: json.dumps({f.name: getattr(cfg, f.name) for f in fields(TrainConfig)})}


def from_env(environ: dict[str, str] | Any) -> TrainConfig | None:
    """The config :func:`to_env` put in ``environ`` (``None`` when there is none)."""
    raw = environ.get(CONFIG_ENV)
    return None if raw is None else TrainConfig(**json.loads(raw))


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
    other word; whether a number fits the shard group is ``fullshard.app.train.world``'s check."""
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
