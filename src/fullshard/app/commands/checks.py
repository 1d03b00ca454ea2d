"""The checks several commands share, in flag words: counts and seconds in range, a ``--model``
that can be built and a sequence length that fits its context, a folder that can be written.

Each command validates its own options in its own module (``train.py``, ``trace.py``,
``bench.py``, ``plan.py``, ...), once per process before any rank starts, with these. They are
cheap and touch no device: flag values, file sizes and folder listings, model configurations on
paper.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from fullshard.app.dims import ParallelDims
from fullshard.app.errors import ConfigError

__all__ = [
    "at_least",
    "check_model_spec",
    "dims_of",
    "flag",
    "model_and_length",
    "model_context",
    "positive_seconds",
    "writable_folder",
]


def flag(dest: str) -> str:
    """The command-line flag of the option ``dest``: ``--seq-len`` for ``seq_len``."""
    return "--" + dest.replace("_", "-")


def at_least(args: object, minimum: int, *dests: str) -> None:
    """Each option ``dests`` of ``args`` is at least ``minimum``."""
    for dest in dests:
        value = getattr(args, dest)
        if value < minimum:
            raise ConfigError(f"{flag(dest)} must be at least {minimum}, got {value}")


def positive_seconds(value: float, flag: str) -> None:
    """``value`` is a finite, positive number of seconds (argparse's ``float`` takes ``nan``)."""
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{flag} must be a positive number of seconds, got {value}")


def dims_of(
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


def model_and_length(spec: str, seq_len: int, seq_flag: str) -> tuple[str, str]:
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


def writable_folder(path: str | Path, flag: str) -> None:
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
