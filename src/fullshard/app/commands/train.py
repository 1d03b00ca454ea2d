"""``fullshard train``: its options (``fullshard.app.config``), its validation, and its run.

Outside torchrun it validates the options once (:func:`validate`: a bad input gives one message
and status 2 before any rank starts, not a traceback per rank), names the run, and re-launches
itself on ``--nproc`` local ranks (``--elastic``: under fullshard's own launcher); the ranks get
the validated config itself. Under torchrun (launched by us, or by an external ``torchrun
--nnodes ...``, whose ranks each validate) it trains.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

from fullshard.app.commands.checks import dims_of, flag, model_and_length, writable_folder
from fullshard.app.config import (
    CheckpointConfig,
    DataConfig,
    ModelConfig,
    OutputConfig,
    ParallelismConfig,
    TrainConfig,
    add_train_arguments,
    config_from_args,
    from_env,
    to_env,
)
from fullshard.app.dims import ParallelDims, under_torchrun
from fullshard.app.errors import ConfigError
from fullshard.policies import FullshardError

__all__ = ["DESCRIPTION", "EPILOG", "HELP", "add_arguments", "resume_folder", "run", "validate"]

HELP = "train a decoder-only language model on N ranks"
DESCRIPTION = "Train a decoder-only transformer LM with fullshard on N ranks."
EPILOG = """\
examples:
  fullshard train                                  # the demo: 2 CPU ranks, 'demo' model, Python docs
  fullshard train --nproc 4 --model small --strategy shard_grad_op
  fullshard train --config run.toml --max-steps 100 # flags override the TOML file
  torchrun --nnodes 2 --nproc-per-node 8 ... -m fullshard.app.cli train --model 1b

Each run writes runs/<name>/: config.toml (resolved), metrics.jsonl, loss.png, sample.txt and
summary.json.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config`` and one flag per :class:`TrainConfig` option."""
    add_train_arguments(parser)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Validate and launch the ranks (outside torchrun), or train as one of them."""
    # a rank our launcher started gets the config it validated (an external torchrun's parse)
    cfg = from_env(os.environ) if under_torchrun() else None
    launched = cfg is not None
    cfg = cfg or config_from_args(args)
    # the run's parallel dimensions, built once: validation, the launch and the trainer share it
    p = cfg.parallelism
    dims = ParallelDims.from_env(
        cfg.launch.nproc, tp=p.tp, strategy=p.strategy, shard_size=p.shard_size
    )
    if not launched:
        validate(cfg, dims)
    if not under_torchrun():
        return _launch(cfg, argv)
    from fullshard.app.launch.preempt import PREEMPTED_EXIT

    if cfg.launch.elastic:
        from fullshard.app.train.elastic import train_elastic as train
    else:
        from fullshard.app.train.trainer import train
    summary = train(cfg, dims)
    # a stop signal (NOTE [Preemption]): checkpointed, unfinished, to be resumed
    return PREEMPTED_EXIT if summary.get("preempted_after") is not None else 0


def _launch(cfg: TrainConfig, argv: list[str]) -> int:
    """The ranks, started on this machine with the validated config itself (their argv is just
    the command: torchrun's own parser would claim abbreviations such as "--nproc", a prefix of
    its --nproc-per-node)."""
    from fullshard.app.errors import RESUME_ENV, resume_command
    from fullshard.app.launch.local import launch_local

    if cfg.output.name is None:  # named here, so that restarted ranks find the same run folder
        cfg.output.name = time.strftime("%Y%m%d-%H%M%S")
    env = {**os.environ, **to_env(cfg), RESUME_ENV: resume_command(argv, cfg.output.name)}
    launch = cfg.launch
    if launch.elastic:
        from fullshard.app.launch.elastic import launch_elastic

        return launch_elastic(
            launch.nproc, ["train"], max_replacements=launch.max_replacements, env=env
        )
    return launch_local(launch.nproc, ["train"], max_restarts=launch.max_restarts, env=env)


# ----------------------------------------------------------------------------------------------
# validation


def validate(cfg: TrainConfig, dims: ParallelDims | int) -> None:
    """Every check of ``fullshard train``. ``dims``: the run's parallel dimensions (a world size
    is taken as that many ranks on this machine).

    A prepared folder (``fullshard prepare``) is checked from its index and its files' stats
    (``fullshard.app.data.checks``); a checkpoint to resume from its manifest and its files'
    sizes, the ranks hash the files (NOTE [Input errors on the ranks] in
    ``fullshard.app.errors``)."""
    from fullshard.app.data.checks import check_data
    from fullshard.app.train.world import check_world

    p = cfg.parallelism
    dims = dims_of(dims, p.tp, p.strategy, p.shard_size)
    _check_numbers(cfg)
    _check_paths(cfg.model, cfg.data)
    if cfg.launch.elastic:
        _check_elastic(cfg)
    check_world(cfg, dims)
    kind, name = model_and_length(cfg.model.name, cfg.data.seq_len, "--seq-len")
    _check_float8(p)
    _check_devices(cfg, dims)
    _check_folders(cfg.output, cfg.checkpoint)
    _check_resume(cfg)
    check_data(cfg, dims)
    if kind == "hf":
        _check_hf_weights(cfg.model.name, name)
    if p.tp > 1:
        _check_tensor_parallel(cfg.model.name, p.tp)


# the options that count something: at least 1, or at least 0
POSITIVE = ("seq_len", "batch_size", "grad_accum", "max_steps", "log_every", "nproc", "threads")
COUNTS = ("eval_every", "eval_batches", "warmup_steps", "sample_tokens", "top_k", "shard_size")
COUNTS_TOO = ("max_restarts", "save_every", "keep", "stop_after", "micro_batch_size")
FINITE = ("lr", "timeout", "clip", "weight_decay", "temperature", "beta1", "beta2")


def _check_numbers(cfg: TrainConfig) -> None:
    """Counts, fractions and rates in their ranges."""
    options = cfg.options()
    for key in (*POSITIVE, "tp"):
        if options[key] < 1:
            raise ConfigError(f"{flag(key)} must be at least 1, got {options[key]}")
    for key in (*COUNTS, *COUNTS_TOO, "max_replacements"):
        if options[key] < 0:
            raise ConfigError(f"{flag(key)} must be >= 0, got {options[key]}")
    if not 0.0 <= cfg.data.val_fraction < 1.0:
        raise ConfigError(f"--val-fraction must be in [0, 1), got {cfg.data.val_fraction}")
    for key in FINITE:
        if not math.isfinite(options[key]):  # argparse's float() takes "nan" and "inf"
            raise ConfigError(f"{flag(key)} must be a finite number")
    o = cfg.optimizer
    if o.lr <= 0 or cfg.launch.timeout <= 0 or cfg.training.clip < 0 or o.weight_decay < 0:
        raise ConfigError("--lr and --timeout must be positive, --clip and --weight-decay >= 0")
    if not (0.0 <= o.beta1 < 1.0 and 0.0 <= o.beta2 < 1.0):
        raise ConfigError(
            f"AdamW's --beta1 and --beta2 must be in [0, 1), got {o.beta1} and {o.beta2}"
        )
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        raise ConfigError(f"--min-lr-ratio must be in [0, 1], got {o.min_lr_ratio}")


def _check_paths(model: ModelConfig, data: DataConfig) -> None:
    """``--data`` exists (the corpus itself: ``check_data``), ``--tokenizer`` is one."""
    if data.path is not None and not Path(data.path).exists():
        raise ConfigError(
            f"data path {data.path!r} does not exist: give a text file or a folder of text files "
            "(or omit --data for the built-in corpus)"
        )
    if model.tokenizer != "byte" and not Path(model.tokenizer).is_dir():
        raise ConfigError(
            f"tokenizer {model.tokenizer!r} is neither 'byte' nor a local tokenizer directory"
        )


def _check_folders(output: OutputConfig, checkpoint: CheckpointConfig) -> None:
    """The run folder and the checkpoint folder can be written."""
    run_dir = Path(output.runs_dir) / output.name if output.name else Path(output.runs_dir)
    writable_folder(run_dir, "--runs-dir/--name" if output.name else "--runs-dir")
    if checkpoint.dir is not None:
        writable_folder(checkpoint.dir, "--checkpoint-dir")


def _check_elastic(cfg: TrainConfig) -> None:
    """``--elastic``: what live recovery supports (``fullshard.elastic``)."""
    from fullshard.app.launch.elastic import RDZV_ENV

    if under_torchrun() and not os.environ.get(RDZV_ENV):
        raise ConfigError(
            "--elastic under torchrun needs fullshard's rendezvous, --rdzv-backend fullshard "
            "(torchrun's own restarts every worker when a node joins): torchrun --nnodes MIN:MAX "
            "--rdzv-backend fullshard --rdzv-endpoint HOST:PORT ..., or fullshard train --nproc N "
            "--elastic on one machine"
        )
    unsupported = {
        "--max-restarts": cfg.launch.max_restarts > 0,
        "--cpu-offload": cfg.parallelism.cpu_offload,
        "--async-save": cfg.checkpoint.async_save,
        "--tp": cfg.parallelism.tp > 1,
        "--mixed-precision fp16": cfg.parallelism.mixed_precision == "fp16",
    }
    for option, on in unsupported.items():
        if on:
            raise ConfigError(f"--elastic with {option} is not supported: drop one of them")
    if cfg.launch.elastic_every < 1:
        raise ConfigError(f"--elastic-every must be at least 1, got {cfg.launch.elastic_every}")


def _check_float8(p: ParallelismConfig) -> None:
    """``--float8``: not with ``--tp`` yet, and torchao installed."""
    if not p.float8:
        return
    if p.tp > 1:
        raise ConfigError("--float8 with --tp is not supported yet: drop one of them")
    from fullshard.app.models.wrap import float8_missing

    missing = float8_missing()
    if missing:
        raise ConfigError(missing)


def _check_devices(cfg: TrainConfig, dims: ParallelDims) -> None:
    """``--device`` and ``--backend`` can run here (no device is touched), and the optimizer's
    implementation gives the same bits where ``--deterministic`` promises them."""
    from fullshard.app.launch.local import check_devices

    device_type, _ = check_devices(cfg.launch.device, cfg.launch.backend, dims.local_world)
    if cfg.optimizer.impl == "fused" and cfg.training.deterministic and device_type == "cpu":
        # measured: 49 of 60 seeded runs of 5 steps differed between a whole tensor and the
        # same tensor split in two or in 142 pieces (CUDA's fused kernel does one float
        # computation for every element)
        raise ConfigError(
            "--deterministic with --optimizer-impl fused on CPU: torch's CPU fused AdamW "
            "computes a shard's elements past its last full vector in double precision and the "
            "rest in float, so the weights' bits depend on how the rows are split over ranks. "
            "Use --optimizer-impl auto (the per-parameter loop on CPU), for-loop or foreach"
        )


def _checkpoint_root(cfg: TrainConfig) -> str:
    """The run's checkpoint folder: ``--checkpoint-dir``, or the run folder's."""
    run = Path(cfg.output.runs_dir) / str(cfg.output.name)
    return cfg.checkpoint.dir or str(run / "checkpoints")


def resume_folder(cfg: TrainConfig) -> str | None:
    """The committed checkpoint folder ``--resume`` names now (``None``: none there)."""
    from fullshard.checkpoint.store import MANIFEST, latest_checkpoint

    resume = cfg.checkpoint.resume
    if resume is None:
        return None
    if resume == "latest":
        return latest_checkpoint(_checkpoint_root(cfg))
    if os.path.isfile(os.path.join(resume, MANIFEST)):
        return resume
    return latest_checkpoint(resume)


def _check_resume(cfg: TrainConfig) -> None:
    """``--resume`` names a committed checkpoint that exists now, whose manifest parses and
    whose files are all there with their recorded sizes (the ranks hash them).

    ``latest`` is the newest under the run's checkpoint folder. A folder without one is an error
    rather than a fresh start: a typo in ``--name`` would otherwise silently train from scratch.
    (A run that torchrun restarts resumes from its latest checkpoint without ``--resume``, and
    starts fresh when it has none; see the trainer.)
    """
    resume = cfg.checkpoint.resume
    if resume is None:
        return
    from fullshard.checkpoint.store import MANIFEST, read_manifest, verify

    fresh = "to start a new run instead, drop --resume"
    if resume != "latest" and not Path(resume).exists():
        raise ConfigError(f"--resume {resume!r}: no such checkpoint (or use 'latest')")
    if resume == "latest" and cfg.checkpoint.dir is None and cfg.output.name is None:
        raise ConfigError(
            "--resume latest continues a named run, but no --name was given (a run without one "
            "gets a new, empty folder): give the --name of the run to continue, or its "
            f"--checkpoint-dir; {fresh}"
        )
    folder = resume_folder(cfg)
    if folder is None and resume != "latest":
        raise ConfigError(
            f"--resume {resume}: not a committed checkpoint (no {MANIFEST}) nor a folder "
            f"holding one (step_N/): give a checkpoint folder, or 'latest'; {fresh}"
        )
    if folder is None:
        raise ConfigError(
            f"--resume latest: {_checkpoint_root(cfg)} holds no committed checkpoint (check "
            "--name, --runs-dir or --checkpoint-dir: they must be those of the run to continue); "
            f"{fresh}"
        )
    problem = verify(folder, hashes=False)
    if problem:
        raise ConfigError(
            f"--resume {resume}: checkpoint {folder} is damaged: {problem}. Nothing was "
            "changed: resume from an earlier checkpoint (--resume PATH), or drop --resume"
        )
    saved = read_manifest(folder).get("optimizer", "adamw")  # (older checkpoints: AdamW)
    if saved != cfg.optimizer.name:
        raise ConfigError(
            f"--resume {resume}: checkpoint {folder} holds {saved}'s optimizer state, and this "
            f"run asks for --optimizer {cfg.optimizer.name}: resume with --optimizer {saved}"
        )


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


def _check_tensor_parallel(spec: str, tp: int) -> None:
    """The model has a TP plan and its split dimensions divide by ``--tp`` (on the meta
    device: no memory)."""
    from fullshard.app.models.gpt import build_model, unit_types_of
    from fullshard.app.models.tensor_parallel import check_divisible

    model = build_model(spec, 256, device="meta")
    types = unit_types_of(model)
    for block in [m for m in model.modules() if isinstance(m, types)][:1]:
        check_divisible(block, tp)
