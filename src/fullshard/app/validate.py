"""One validation step per command, before any rank starts.

A bad input must give one clear message and exit status 2, not a traceback from every rank behind
torchrun's ``ChildFailedError``. Each command that launches ranks has one function here, which
``fullshard.app.cli`` calls before launching: :func:`validate_train`, :func:`validate_trace`,
:func:`validate_bench` and :func:`validate_plan_check`. Each raises :class:`ConfigError` saying
what is wrong, where (the flag or the file) and what to do.

Everything here is cheap and touches no device: flag values, file sizes and folder listings, model
configurations on paper. The only text ever read is a corpus already too small to train on by its
file sizes (to count its tokens exactly), or the built-in corpus; nothing is tokenized but bytes.
A prepared folder (``fullshard prepare``) is checked from its index and its files' stats; only a
shard whose stat changed since it was written is read (re-hashed, NOTE [Verifying token shards]).
So the verdict is the same in the launcher and on every rank.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

from fullshard.app.config import (
    ConfigError,
    TrainConfig,
    check_model_spec,
    hybrid_shard_size,
    reshard_after_forward_arg,
    validate,
)
from fullshard.policies import FullshardError

__all__ = [
    "model_context",
    "validate_bench",
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


def _local_ranks(default: int) -> int:
    """Ranks on this machine: torchrun's ``LOCAL_WORLD_SIZE``, else what we are about to launch."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", default))


def model_context(kind: str, name: str) -> int | None:
    """The longest sequence a ``--model`` accepts, read from its configuration (no model is
    built); ``None`` when the configuration does not say."""
    if kind == "gpt":
        from fullshard.app.models import MODEL_SIZES

        return MODEL_SIZES[name].max_seq_len
    from fullshard.app.hf import HF_CONFIGS

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


def _model_and_length(spec: str, seq_len: int, seq_flag: str) -> None:
    """``--model`` names a model we can build, and ``seq_len`` fits its context."""
    kind, name = check_model_spec(spec)
    context = model_context(kind, name)
    if context is not None and seq_len > context:
        raise ConfigError(
            f"{seq_flag} {seq_len} exceeds the {context}-token context of model {spec!r}: "
            f"use {seq_flag} {context} or less, or a model with a longer context"
        )


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


# ----------------------------------------------------------------------------------------------
# train


def validate_train(cfg: TrainConfig, world_size: int) -> None:
    """Every check of ``fullshard train`` (``world_size``: the ranks the run will have)."""
    validate(cfg, world_size)  # flags and their combinations; the model; devices
    _check_reshard_after_forward(cfg, world_size)
    _model_and_length(cfg.model, cfg.seq_len, "--seq-len")
    run_dir = Path(cfg.runs_dir) / cfg.name if cfg.name else Path(cfg.runs_dir)
    _writable_folder(run_dir, "--runs-dir/--name" if cfg.name else "--runs-dir")
    if cfg.checkpoint_dir is not None:
        _writable_folder(cfg.checkpoint_dir, "--checkpoint-dir")
    _check_resume(cfg)
    _check_data(cfg, world_size)
    _check_hf_weights(cfg.model)
    if cfg.tp > 1:
        _check_tensor_parallel(cfg)


def _check_reshard_after_forward(cfg: TrainConfig, world_size: int) -> None:
    """``--reshard-after-forward`` is true, false or a number of ranks the blocks' shard group
    can be split into, and (a number other than 1 or the group size: resharding to a smaller
    group) not combined with what cannot reshard that way. The ranks' ``fully_shard`` applies
    the same rules (``fullshard.engine.api``); here they come before launch, in flag words."""
    value = reshard_after_forward_arg(cfg.reshard_after_forward)
    if value is None or isinstance(value, bool):
        return
    # the ranks one parameter is split over (``ShardingPlan.shard_size``): 1 for no_shard, the
    # hybrid group, else every data-parallel rank
    if cfg.strategy == "no_shard":
        group = 1
    elif cfg.strategy.startswith("hybrid"):
        group = hybrid_shard_size(cfg, world_size)
    else:
        group = world_size // cfg.tp
    if group % value:
        sizes = ", ".join(str(d) for d in range(1, group + 1) if group % d == 0)
        what = f"{world_size} ranks" + (f" / --tp {cfg.tp}" if cfg.tp > 1 else "")
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


def _check_resume(cfg: TrainConfig) -> None:
    """``--resume`` names a committed checkpoint that exists now.

    ``latest`` is the newest under the run's checkpoint folder. A folder without one is an error
    rather than a fresh start: a typo in ``--name`` would otherwise silently train from scratch.
    (A run that torchrun restarts resumes from its latest checkpoint without ``--resume``, and
    starts fresh when it has none; see the trainer.)
    """
    if cfg.resume is None:
        return
    from fullshard.checkpoint.store import MANIFEST, latest_checkpoint

    fresh = "to start a new run instead, drop --resume"
    if cfg.resume != "latest":
        path = cfg.resume
        if not os.path.isfile(os.path.join(path, MANIFEST)) and latest_checkpoint(path) is None:
            raise ConfigError(
                f"--resume {path}: not a committed checkpoint (no {MANIFEST}) nor a folder "
                f"holding one (step_N/): give a checkpoint folder, or 'latest'; {fresh}"
            )
        return
    if cfg.checkpoint_dir is None and cfg.name is None:
        raise ConfigError(
            "--resume latest continues a named run, but no --name was given (a run without one "
            "gets a new, empty folder): give the --name of the run to continue, or its "
            f"--checkpoint-dir; {fresh}"
        )
    folder = cfg.checkpoint_dir or str(Path(cfg.runs_dir) / str(cfg.name) / "checkpoints")
    if latest_checkpoint(folder) is None:
        raise ConfigError(
            f"--resume latest: {folder} holds no committed checkpoint (check --name, --runs-dir "
            f"or --checkpoint-dir: they must be those of the run to continue); {fresh}"
        )


def _text_files(path: str) -> list[Path]:
    """The files ``load_text`` would read for ``--data path``."""
    from fullshard.app.data import TEXT_SUFFIXES

    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise ConfigError(f"--data {path} is neither a file nor a folder: give a text file")
    files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
    if not files:
        raise ConfigError(
            f"--data {path}: the folder holds no text files ({', '.join(TEXT_SUFFIXES)}): "
            "add some, or give a text file"
        )
    return files


def _check_data(cfg: TrainConfig, world_size: int) -> None:
    """The corpus is not empty, and (byte tokens) gives every rank one training micro-batch."""
    from fullshard.app.data import default_corpus, load_text, split_sizes, windows
    from fullshard.app.token_shards import is_prepared

    if is_prepared(cfg.data):
        _check_prepared(cfg, world_size)
        return
    source = f"--data {cfg.data}" if cfg.data else "--data (default: the built-in corpus)"
    size = 0
    if cfg.data is not None:
        files = _text_files(cfg.data)
        size = sum(f.stat().st_size for f in files)
        if size == 0:
            what = "the file is empty" if len(files) == 1 else f"all {len(files)} files are empty"
            raise ConfigError(f"{source}: {what}: give text to train on")
    if cfg.tokenizer != "byte":
        return  # counting other tokens means tokenizing the corpus: the ranks check it
    micro = cfg.micro_batch(world_size)
    world_size //= cfg.tp  # the data-parallel ranks split the corpus
    need = micro * (cfg.seq_len + 1) + cfg.seq_len  # training tokens per rank for one batch

    def enough(n_tokens: int) -> bool:
        return windows(split_sizes(n_tokens, world_size, cfg.val_fraction)[0], cfg.seq_len) >= micro

    # Bytes on disk are at least twice the tokens (only "\r\n" -> "\n" shrinks text): a corpus
    # large enough by its sizes is not read here.
    if cfg.data is not None and enough(size // 2):
        return
    text = load_text(cfg.data) if cfg.data is not None else default_corpus()
    n = len(text.encode("utf-8"))
    if not enough(n):
        train = split_sizes(n, world_size, cfg.val_fraction)[0]
        raise ConfigError(
            f"{source}: {n:,} tokens are too few for one training batch: after --val-fraction "
            f"{cfg.val_fraction} is held out, each of {world_size} ranks gets {train:,} training "
            f"tokens, and one micro-batch of {micro} sequences of --seq-len {cfg.seq_len} needs "
            f"{need:,}. Give more text, or a smaller --batch-size, --seq-len or --nproc"
        )


def _check_prepared(cfg: TrainConfig, world_size: int) -> None:
    """A prepared folder (``fullshard prepare``): its index, tokenizer and split agree with the
    flags, its shard files are intact (NOTE [Verifying token shards]: re-hashed only when their
    stat changed), every id is inside the vocabulary, and every data-parallel rank gets a batch.
    All from the index and file stats: the cost does not grow with the corpus."""
    from fullshard.app.data import windows
    from fullshard.app.token_shards import (
        describe_tokenizer,
        read_index,
        tokenizer_identity,
        verify_shards,
    )

    assert cfg.data is not None
    source = f"--data {cfg.data}"
    index = read_index(cfg.data)
    prepared, mine = index["tokenizer"], tokenizer_identity(cfg.tokenizer)
    if prepared.get("kind") != mine["kind"] or prepared.get("sha256") != mine.get("sha256"):
        raise ConfigError(
            f"{source} was prepared with {describe_tokenizer(prepared)}, but --tokenizer "
            f"{cfg.tokenizer} is {describe_tokenizer(mine)}: train with the tokenizer it was "
            f"prepared with, or prepare it again with --tokenizer {cfg.tokenizer}"
        )
    if index["val_fraction"] != cfg.val_fraction:
        raise ConfigError(
            f"{source} was split with --val-fraction {index['val_fraction']} when it was "
            f"prepared, not {cfg.val_fraction}: train with --val-fraction {index['val_fraction']}"
            ", or prepare it again"
        )
    verify_shards(cfg.data, full=False)
    vocab = int(prepared["vocab_size"])
    for split in ("train", "val"):
        for shard in index["splits"][split]["shards"]:
            if shard["max_token_id"] >= vocab:
                raise ConfigError(
                    f"{Path(cfg.data) / shard['file']}: token id {shard['max_token_id']} is "
                    f"outside the tokenizer's vocabulary of {vocab}: prepare the corpus again"
                )
    micro = cfg.micro_batch(world_size)
    dp = world_size // cfg.tp
    train = int(index["splits"]["train"]["tokens"]) // dp
    if windows(train, cfg.seq_len) < micro:
        raise ConfigError(
            f"{source}: {index['tokens']:,} tokens are too few for one training batch: each of "
            f"{dp} ranks gets {train:,} training tokens, and one micro-batch of {micro} "
            f"sequences of --seq-len {cfg.seq_len} needs {micro * (cfg.seq_len + 1) + cfg.seq_len:,}"
            ". Give more text, or a smaller --batch-size, --seq-len or --nproc"
        )


# ----------------------------------------------------------------------------------------------
# trace, bench, plan --check


def _check_hf_weights(spec: str) -> None:
    """A local Hugging Face checkpoint's safetensors fit its model: every parameter present
    with its shape, every shard file of the index there (headers only; the model on meta)."""
    kind, name = check_model_spec(spec)
    if kind != "hf":
        return
    from fullshard.app.hf import safetensors_dir

    folder = safetensors_dir(name)
    if folder is None:
        return
    from fullshard.app.models import build_model
    from fullshard.checkpoint import check_safetensors

    try:
        check_safetensors(build_model(spec, 256, device="meta"), folder)
    except FullshardError as exc:
        raise ConfigError(f"--model {spec}: {exc}") from None


def _check_tensor_parallel(cfg: TrainConfig) -> None:
    """The model has a TP plan and its split dimensions divide by ``--tp`` (on the meta
    device: no memory)."""
    from fullshard.app.models import build_model, unit_types_of
    from fullshard.app.tensor_parallel import check_divisible

    model = build_model(cfg.model, 256, device="meta")
    types = unit_types_of(model)
    for block in [m for m in model.modules() if isinstance(m, types)][:1]:
        check_divisible(block, cfg.tp)


def validate_trace(args: argparse.Namespace, world_size: int) -> None:
    """Every check of ``fullshard trace`` (``world_size``: the ranks it will have)."""
    _at_least(args, 1, "nproc", "batch_size", "seq_len", "steps", "threads")
    _at_least(args, 0, "warmup", "shard_size")
    _positive_seconds(args.timeout, "--timeout")
    _model_and_length(args.model, args.seq_len, "--seq-len")
    if args.strategy.startswith("hybrid"):
        from fullshard.engine.sharding import hybrid_shard_size

        try:  # the size the ranks will choose (the engine's default when --shard-size is 0)
            hybrid_shard_size(world_size, args.shard_size, _local_ranks(world_size))
        except FullshardError as exc:
            raise ConfigError(f"--strategy {args.strategy}: {exc}") from None
    _writable_folder(args.out, "--out")
    from fullshard.app.launch import check_devices

    check_devices(args.device, args.backend, _local_ranks(world_size))


def validate_bench(args: argparse.Namespace) -> list[str]:
    """Every check of ``fullshard bench`` (outside torchrun); returns the variants to run."""
    from fullshard.app.bench_variants import parse_variants

    _at_least(args, 1, "nproc", "batch_size", "seq_len", "rounds", "threads", "memory_steps")
    _at_least(args, 0, "warmup")
    try:
        variants = parse_variants(args.variants, args.nproc)
    except ValueError as exc:
        raise ConfigError(f"--variants {args.variants}: {exc}") from None
    _positive_seconds(args.timeout, "--timeout")
    _model_and_length(args.model, args.seq_len, "--seq-len")
    _writable_folder(args.out, "--out")
    from fullshard.app.launch import check_devices

    check_devices(args.device, args.backend, args.nproc)
    return variants


def validate_plan_check(args: argparse.Namespace) -> None:
    """Every check of ``fullshard plan --check``: the plan it compares with, and the run."""
    if args.model is None:
        raise ConfigError("--check runs a model: give --model (model mode)")
    if getattr(args, "tp", 1) > 1:
        raise ConfigError("--check does not run tensor parallel yet: drop --tp (or --check)")
    _at_least(args, 1, "devices", "batch", "check_steps", "devices_per_node")
    if args.seq is not None:
        _at_least(args, 1, "seq")
    _model_and_length(args.model, args.seq or 128, "--seq")
    from fullshard.app.plan_check import check_config, check_target

    try:
        check_config(args).shard_group(args.devices)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    from fullshard.app.launch import check_devices

    check_devices(*check_target(args), args.devices, flag="--check-device")
