"""``TrainConfig``: every option of ``fullshard train``, in sections, from defaults, a TOML file
and the command line.

A run's configuration is a few sections, as torchtitan's ``JobConfig`` is: ``model`` (what is
trained), ``data`` (what it reads), ``training`` (the step: batch, accumulation, steps, seed),
``optimizer``, ``parallelism`` (how the model is sharded), ``output`` (evaluation, logging, the
sample, the run folder), ``checkpoint`` and ``launch`` (ranks, devices, restarts, ``--elastic``).
Each function takes the section it uses (``build_optimizer`` the optimizer's, ``shard_model``
the parallelism's); the trainer, validation and the launcher take the whole.

Precedence: section defaults < ``--config FILE.toml`` < command-line flags. The flags are
generated from the sections' fields (their ``help`` metadata), so ``fullshard train --help``
documents every option and cannot drift from the config; a flag's name is its field's, or the
field's ``flag`` (``--model`` sets ``model.name``). A TOML file uses the sections as tables::

    [model]
    name = "demo"
    [training]
    max_steps = 100

NOTE [Flat config keys]: before the sections, a config file set options by their flag names at
the top level or under ``[train]`` (``model = "demo"``, ``max_steps = 100``); run folders
hold such ``config.toml`` files. Those keys are still read, each to its option, and the file
then says once (stderr) that they are deprecated and which table each belongs in: a user's file
keeps working and is never read differently in silence. A key given both ways is an error.

This module is the data only: checking the values (and the files, models and devices they name)
is :mod:`fullshard.app.commands.train`'s, once per process before launch.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from fullshard.app.errors import ConfigError, say_once
from fullshard.policies import STRATEGY_NAMES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "OPTIONS",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "LaunchConfig",
    "ModelConfig",
    "OptimizerConfig",
    "OutputConfig",
    "ParallelismConfig",
    "TrainConfig",
    "TrainingConfig",
    "add_config_options",
    "add_train_arguments",
    "config_from_args",
    "from_env",
    "load_toml",
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


def _opt(
    default: Any, help: str, *, choices: tuple[str, ...] | None = None, flag: str | None = None
) -> Any:
    """A field of a section: its default, its ``--help`` text, its choices, and the option's
    name where it is not the field's (``flag``: ``model`` for ``model.name``)."""
    return field(default=default, metadata={"help": help, "choices": choices, "flag": flag})


@dataclass
class ModelConfig:
    """[model]: what is trained, and the tokens it reads."""

    name: str = _opt(
        "demo",
        "model: a built-in size (tiny, demo, small, gpt2-124m, 1b, 7b), hf:NAME for a built-in "
        "Hugging Face config (llama-tiny, gpt2-tiny, gpt2, llama-1b), or hf:DIR / DIR for a local "
        "Hugging Face config or checkpoint directory",
        flag="model",
    )
    tokenizer: str = _opt(
        "byte", "'byte' (UTF-8 bytes, vocabulary 256) or a local Hugging Face tokenizer directory"
    )


@dataclass
class DataConfig:
    """[data]: the training text, its validation split and its sequences."""

    path: str | None = _opt(
        None,
        "training text: a file, a folder of .txt/.md/.rst files, or a folder made by fullshard "
        "prepare (token shards, memory-mapped; its split and tokenizer are checked) (default: "
        "Python's bundled documentation topics, pydoc_data.topics)",
        flag="data",
    )
    val_fraction: float = _opt(
        0.05, "fraction of the text held out for validation (evenly spaced 4096-token blocks)"
    )
    seq_len: int = _opt(128, "tokens per training sequence")


@dataclass
class TrainingConfig:
    """[training]: the step (its batch and micro-batches), how many, and their seed."""

    batch_size: int = _opt(
        16,
        "global batch: sequences per optimizer step over all ranks and accumulation steps; "
        "must be divisible by world size x --grad-accum",
    )
    grad_accum: int = _opt(
        1, "micro-batches accumulated per optimizer step (no gradient sync until the last)"
    )
    deterministic: bool = _opt(
        False,
        "the same weights, bit for bit, at 1, 2, 4 or 8 ranks and after a resume on another "
        "world size: a global sampler (each step's batch is the same windows at any world "
        "size), micro-batches of a fixed --micro-batch-size, and every sum in a fixed order "
        "(fullshard.deterministic; one reduce-scatter per micro-batch)",
    )
    micro_batch_size: int = _opt(
        0,
        "--deterministic: sequences per micro-batch, the same at every world size (0: "
        "--batch-size / 8, or / its largest power-of-two factor below 8)",
    )
    max_steps: int = _opt(600, "optimizer steps to train")
    clip: float = _opt(1.0, "clip the global gradient norm to this (0 disables)")
    seed: int = _opt(1234, "seed for weights, data order and sampling")
    on_nonfinite: str = _opt(
        "skip",
        "a non-finite loss or gradient on any rank: skip the optimizer step on every rank "
        "(skip) or stop the run with an error (stop)",
        choices=("skip", "stop"),
    )


@dataclass
class OptimizerConfig:
    """[optimizer]: which optimizer, its implementation, and its learning-rate schedule."""

    name: str = _opt(
        "adamw",
        "adamw, or muon: fullshard.optim.Muon for the blocks' weight matrices (each matrix's "
        "Newton-Schulz on one rank; --lr and --weight-decay as AdamW's, adjusted to AdamW's "
        "update size), AdamW (--optimizer-impl) for embeddings, head, norms and biases",
        choices=OPTIMIZERS,
        flag="optimizer",
    )
    impl: str = _opt(
        "auto",
        "AdamW's implementation: auto (fused on the GPU path, where the device then skips a "
        "non-finite step itself; torch's default elsewhere, a per-parameter loop on CPU), "
        "for-loop, foreach or fused (on CPU several times faster than the loop, with other "
        "rounding; a GPU run with for-loop or foreach has the host decide each step, one "
        "synchronisation per step)",
        choices=OPTIMIZER_IMPLS,
        flag="optimizer_impl",
    )
    lr: float = _opt(3e-3, "peak learning rate (AdamW)")
    min_lr_ratio: float = _opt(
        0.1, "final learning rate of the cosine decay, as a fraction of --lr"
    )
    warmup_steps: int = _opt(20, "linear warmup steps")
    weight_decay: float = _opt(0.1, "AdamW weight decay (not applied to biases, norms, embeddings)")
    beta1: float = _opt(0.9, "AdamW beta1")
    beta2: float = _opt(0.95, "AdamW beta2")


@dataclass
class ParallelismConfig:
    """[parallelism]: how the model is sharded, in what precision, and what it saves."""

    strategy: str = _opt(
        "full_shard",
        "full_shard (blocks free their gathered parameters after forward), shard_grad_op (keep "
        "them until backward), no_shard (replicate, all-reduce), hybrid_shard / "
        "hybrid_shard_zero2 (shard inside groups of --shard-size ranks, replicate across them)",
        choices=STRATEGY_NAMES,
    )
    shard_size: int = _opt(
        0,
        "hybrid strategies: ranks per shard group (0: ranks per node, or half the world on one "
        "node)",
    )
    tp: int = _opt(
        1,
        "tensor parallel: split each block's matrices over this many consecutive ranks; the "
        "strategy shards over the rest (world / tp data-parallel ranks)",
    )
    activation_checkpointing: bool = _opt(
        False, "recompute each block's activations in backward (less memory)"
    )
    mixed_precision: str = _opt(
        "none",
        "compute dtype for gathered parameters (gradients are reduced in float32)",
        choices=MIXED_PRECISION,
    )
    float8: bool = _opt(
        False,
        "train the blocks' linear layers in float8 and all-gather their weights as float8 "
        "(torchao's Float8Linear with enable_fsdp_float8_all_gather; needs torchao, "
        "pip install 'fullshard[float8]', and a GPU with float8 matmuls, e.g. H100)",
    )
    cpu_offload: bool = _opt(
        False,
        "keep the parameter shards, gradients and optimizer state on the host "
        "(fullshard.CPUOffloadPolicy): units are copied to the device to be gathered and "
        "the optimizer steps on the CPU; less device memory, host-device copies every step "
        "(on CPU ranks everything is on the host already)",
    )
    reshard_after_forward: str | None = _opt(
        None,
        "what the blocks do with their gathered parameters after forward: true (free them), "
        "false (keep them for backward) or N (keep them sharded over N consecutive ranks, so "
        "backward gathers within that smaller group, e.g. a node; N divides the shard group, "
        "1 is false and the group size is true). Default: the --strategy's (true for "
        "full_shard and hybrid_shard, false for the others); a value given overrides it",
    )

    def describe(self) -> str:
        """What the run line says after the sharding plan's summary: the options that shape
        the sharding beyond the plan (", tensor parallel over 2 ranks, CPU offload"; '' for
        none)."""
        words = f", tensor parallel over {self.tp} ranks" if self.tp > 1 else ""
        raf = self.reshard_after_forward
        words += "" if raf is None else f", --reshard-after-forward {raf} for the blocks"
        return words + (", CPU offload" if self.cpu_offload else "")


@dataclass
class OutputConfig:
    """[output]: evaluation, the logged lines, the final sample and the run folder."""

    eval_every: int = _opt(
        100, "evaluate on the validation split every N steps (0: only at the end)"
    )
    eval_batches: int = _opt(
        8, "validation micro-batches per rank per evaluation (--deterministic: in all)"
    )
    log_every: int = _opt(10, "log metrics every N steps (the first step is always logged)")
    sample_tokens: int = _opt(300, "tokens to sample at the end (0: no sample)")
    prompt: str = _opt("The ", "prompt for the final sample")
    temperature: float = _opt(0.8, "sampling temperature (0: greedy)")
    top_k: int = _opt(40, "sample among the k most likely tokens (0: all)")
    runs_dir: str = _opt("runs", "parent folder of run folders")
    name: str | None = _opt(None, "run folder name under --runs-dir (default: a timestamp)")
    progress: bool = _opt(True, "show a progress bar on rank 0")


@dataclass
class CheckpointConfig:
    """[checkpoint]: where and how often checkpoints are saved, and the one to resume."""

    dir: str | None = _opt(
        None,
        "folder for sharded checkpoints (default: RUN_FOLDER/checkpoints)",
        flag="checkpoint_dir",
    )
    save_every: int = _opt(0, "save a checkpoint every N steps (0: only at the end)")
    keep: int = _opt(3, "keep the last N committed checkpoints")
    async_save: bool = _opt(False, "write checkpoints in the background while training goes on")
    resume: str | None = _opt(
        None,
        "resume from 'latest' (the newest committed checkpoint under the checkpoint folder) or "
        "a checkpoint path; needs the same --name or --checkpoint-dir as the run it continues",
    )
    stop_after: int = _opt(
        0,
        "stop (with a checkpoint) after this many steps of this invocation, as if preempted; "
        "resume with --resume latest (0: run to --max-steps)",
    )


@dataclass
class LaunchConfig:
    """[launch]: the ranks, their devices and process group, restarts and --elastic."""

    max_restarts: int = _opt(
        0,
        "restart all ranks this many times after a failure (torch.distributed.run "
        "--max-restarts); a restarted run resumes from its latest checkpoint",
    )
    elastic: bool = _opt(
        False,
        "live recovery: when a rank's process (or node) dies, the others keep running, rebuild "
        "its shards in memory from their copies (a ring neighbour's, or another replica's under "
        "HSDP), reshard to the new world and replay the steps since; a replacement, or a "
        "restarted node, joins at a step boundary (fullshard.elastic; the global sampler of "
        "--deterministic; with it, the bits of the uninterrupted run; --nproc N, or torchrun "
        "--rdzv-backend fullshard)",
    )
    elastic_every: int = _opt(
        1,
        "--elastic: copy the shards to host memory every this many steps, and send each copy "
        "to the ring neighbour at the next (recovery replays the steps since)",
    )
    max_replacements: int = _opt(
        2,
        "--elastic --nproc: replacement processes to start in all; after that the others go on "
        "at a smaller world where the job can run at one",
    )
    nproc: int = _opt(
        2,
        "local ranks to launch through torch.distributed.run (ignored under torchrun, which "
        "sets the world size)",
    )
    device: str = _opt(
        "auto",
        "auto (one GPU per rank with NCCL if CUDA is present, else CPU with gloo), cpu or cuda",
        choices=DEVICES,
    )
    backend: str = _opt(
        "auto",
        "process-group backend: auto (NCCL on CUDA, gloo on CPU), nccl, or gloo (on CUDA: the "
        "ranks share the visible GPUs, rank r on cuda:(r %% GPUs); a test mode, as NCCL refuses "
        "two ranks on one GPU)",
        choices=BACKENDS,
    )
    threads: int = _opt(1, "torch threads per rank on CPU")
    timeout: float = _opt(300.0, "seconds any collective may wait before the run fails")


@dataclass
class TrainConfig:
    """Every option of a training run, by section (see ``fullshard train --help``).

    ``TrainConfig.of(lr=2e-4, model="tiny")`` builds one from option names (flag words)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    @classmethod
    def of(cls, **options: Any) -> TrainConfig:
        """A config with ``options`` (by option name: ``batch_size``, ``model``, ``data``, ...)
        set, the rest at their defaults."""
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise TypeError(f"no TrainConfig option {', '.join(unknown)}")
        by_section: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        for option, value in options.items():
            section, name = OPTIONS[option]
            by_section[section][name] = value
        return cls(**{s: SECTIONS[s](**values) for s, values in by_section.items()})

    @classmethod
    def from_dict(cls, sections: dict[str, dict[str, Any]]) -> TrainConfig:
        """The config ``dataclasses.asdict`` gave (``{section: {field: value}}``)."""
        return cls(**{s: SECTIONS[s](**sections.get(s, {})) for s in SECTIONS})

    def options(self) -> dict[str, Any]:
        """Every option by its name (flag words), as ``of`` takes them."""
        return {o: getattr(getattr(self, s), n) for o, (s, n) in OPTIONS.items()}

    @property
    def global_sampler(self) -> bool:
        """Whether every rank draws the step's whole global batch, cut into micro-batches of
        ``--micro-batch-size`` (``fullshard.app.train.fixed_order``): with ``--deterministic``, and
        with ``--elastic``, whose memberships change the world size a step runs at."""
        return self.training.deterministic or self.launch.elastic

    def micro_batch(self, dp: int) -> int:
        """Sequences per rank per micro-batch over ``dp`` data-parallel ranks (the TP ranks of
        a data-parallel rank share it: ``ParallelDims.dp``); with the global sampler the fixed
        ``--micro-batch-size``, whatever ``dp``."""
        t = self.training
        if self.global_sampler:
            return t.micro_batch_size or t.batch_size // min(8, t.batch_size & -t.batch_size)
        return t.batch_size // (dp * t.grad_accum)


# the sections, in TrainConfig's order: TOML table -> its dataclass
SECTIONS: dict[str, type] = {f.name: f.default_factory for f in fields(TrainConfig)}  # type: ignore[misc]
# option name (flag words, the flat key of older config files) -> (section, field)
OPTIONS: dict[str, tuple[str, str]] = {
    f.metadata["flag"] or f.name: (section, f.name)
    for section, cls in SECTIONS.items()
    for f in fields(cls)
}


def _field(option: str) -> Any:
    section, name = OPTIONS[option]
    return next(f for f in fields(SECTIONS[section]) if f.name == name)


def _option_type(option: str) -> type:
    """``int`` for an ``int`` option, ``str`` for a ``str | None`` one."""
    section, name = OPTIONS[option]
    tp = typing.get_type_hints(SECTIONS[section])[name]
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args else tp


def _add_option(
    group: argparse._ActionsContainer, option: str, default: Any, help_text: str | None = None
) -> None:
    """One flag for ``option``: its type, choices and help."""
    f = _field(option)
    flag = "--" + option.replace("_", "-")
    tp = _option_type(option)
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
        metavar=option.upper() if choices is None else None,
        help=text,
    )


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--config`` and one flag per option, grouped by section.

    Defaults are suppressed so that only flags the user typed override the TOML file.
    """
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="TOML file of options, in the sections below ([model] name = ..., [training] "
        "max_steps = ...); flags override it",
    )
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(section, (cls.__doc__ or "").strip())
        for option, (s, _) in OPTIONS.items():
            if s == section:
                _add_option(group, option, argparse.SUPPRESS)


def add_config_options(
    parser: argparse._ActionsContainer,
    *names: str,
    defaults: dict[str, Any] | None = None,
    helps: dict[str, str] | None = None,
) -> None:
    """The flags of ``fullshard train`` named ``names`` (option names), for another command
    (trace, bench, plan): one definition per option, so a flag means and checks the same
    everywhere. ``defaults``: the command's own defaults (else the option's); ``helps``: a help
    text where the command uses the option more narrowly (e.g. bench's launch timeout)."""
    for name in names:
        if name not in OPTIONS:
            raise KeyError(f"{name!r} is no option of fullshard train")
        default = (defaults or {}).get(name, _field(name).default)
        _add_option(parser, name, default, (helps or {}).get(name))


def load_toml(path: str) -> dict[str, Any]:
    """The options a TOML config file sets, by option name: its sections' keys (``[training]
    max_steps = 100``), and the flat keys of older files (NOTE [Flat config keys]: at the top
    level or under ``[train]``, said once to be deprecated). ``-`` in keys reads as ``_``. Unknown
    tables and keys are errors naming the file; a value's type is checked in ``config_from_args``."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        raw = tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    if isinstance(raw.get("train"), dict):
        raw = {**{k: v for k, v in raw.items() if k != "train"}, **raw["train"]}
    options: dict[str, Any] = {}
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        key = key.replace("-", "_")
        if key in SECTIONS and isinstance(value, dict):
            for name, v in value.items():
                options[_section_option(key, name.replace("-", "_"), path)] = v
        elif key in OPTIONS:
            flat[key] = value
        else:
            close = difflib.get_close_matches(key, [*SECTIONS, *OPTIONS], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown option {key!r} in {path}{hint}")
    twice = sorted(set(flat) & set(options))
    if twice:
        raise ConfigError(
            f"{path} sets {', '.join(twice)} twice, outside a section and in its section: keep "
            "the section's"
        )
    if flat:
        _say_flat_keys_are_deprecated(path, flat)
    return {**options, **flat}


def _section_option(section: str, name: str, path: str) -> str:
    """The option that key ``name`` of table ``[section]`` sets."""
    for option, (s, n) in OPTIONS.items():
        if (s, n) == (section, name):
            return option
    names = [n for s, n in OPTIONS.values() if s == section]
    close = difflib.get_close_matches(name, names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(f"unknown option {name!r} in [{section}] of {path}{hint}")


def _say_flat_keys_are_deprecated(path: str, values: dict[str, Any]) -> None:
    """NOTE [Flat config keys]: once per file, on stderr, with the sections to write instead."""
    if path in _SAID:
        return
    _SAID.add(path)
    moved = TrainConfig.of(**_check_values(values, path))
    tables = _toml_tables(moved, only=set(values))
    say_once(
        f"fullshard train: {path}: options outside a section ({', '.join(values)}) are "
        "deprecated, and read as before; write them in their sections:\n" + tables.rstrip(),
        "flat-config",
    )


_SAID: set[str] = set()


def _check_values(values: dict[str, Any], source: str) -> dict[str, Any]:
    """Reject wrongly typed values and ones outside their choices, naming the option and the
    source."""
    out = {}
    for key, value in values.items():
        tp = _option_type(key)
        if key == "reshard_after_forward" and isinstance(value, (bool, int)):
            value = str(value).lower()  # TOML's true / 2 read as the flag's words
        if tp is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            raise ConfigError(f"option {key!r} in {source} must be {tp.__name__}, got {value!r}")
        choices = _field(key).metadata["choices"]
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
    values.update({k: v for k, v in vars(args).items() if k in OPTIONS})
    return TrainConfig.of(**values)


def to_env(cfg: TrainConfig) -> dict[str, str]:
    """The validated ``cfg`` as the environment a launcher hands its ranks: they read the
    config itself back (:func:`from_env`), not flags to parse and check again."""
    return {CONFIG_ENV: json.dumps(asdict(cfg))}


def from_env(environ: dict[str, str] | Any) -> TrainConfig | None:
    """The config :func:`to_env` put in ``environ`` (``None`` when there is none)."""
    raw = environ.get(CONFIG_ENV)
    return None if raw is None else TrainConfig.from_dict(json.loads(raw))


def to_toml(cfg: TrainConfig) -> str:
    """The resolved config as TOML, by section (``load_toml`` reads it back to the same
    config)."""
    head = "# fullshard train: resolved configuration (defaults < config file < flags)\n"
    return head + _toml_tables(cfg)


def _toml_tables(cfg: TrainConfig, only: set[str] | None = None) -> str:
    """``cfg``'s sections as TOML tables (``only``: those options alone)."""
    lines: list[str] = []
    for section in SECTIONS:
        rows = [
            _toml_line(name, getattr(getattr(cfg, section), name))
            for option, (s, name) in OPTIONS.items()
            if s == section and (only is None or option in only)
        ]
        if rows:
            lines += [*([""] if lines else []), f"[{section}]", *rows]
    return "\n".join(lines) + "\n"


def _toml_line(name: str, value: Any) -> str:
    if value is None:
        return f"# {name} = (unset)"
    if isinstance(value, bool):
        return f"{name} = {'true' if value else 'false'}"
    if isinstance(value, (int, float)):
        return f"{name} = {value!r}"
    return f"{name} = {json.dumps(value)}"  # JSON string escapes are valid TOML escapes


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
