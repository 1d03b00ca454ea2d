"""The corpus checks of ``fullshard train``'s validation (:func:`check_data`, called by
``fullshard.app.commands.train.validate`` before launch): a text corpus is not empty and gives
every rank a micro-batch, counted from file sizes where they suffice; a prepared folder agrees with
the flags and is intact, from its index and its files' stats. Nothing is tokenized but bytes.
"""

from __future__ import annotations

from pathlib import Path

from fullshard.app.config import TrainConfig
from fullshard.app.dims import ParallelDims
from fullshard.app.errors import ConfigError

__all__ = ["check_data"]


def _text_files(path: str) -> list[Path]:
    """The files ``load_text`` would read for ``--data path``, each checked to be text (not
    compressed or binary: ``load_text`` would refuse it on every rank)."""
    from fullshard.app.data.corpus import TEXT_SUFFIXES, check_text_file

    p = Path(path)
    if p.is_file():
        check_text_file(p)
        return [p]
    if not p.is_dir():
        raise ConfigError(f"--data {path} is neither a file nor a folder: give a text file")
    files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
    if not files:
        raise ConfigError(
            f"--data {path}: the folder holds no text files ({', '.join(TEXT_SUFFIXES)}): "
            "add some, or give a text file"
        )
    for f in files:
        check_text_file(f)
    return files


def check_data(cfg: TrainConfig, dims: ParallelDims) -> None:
    """The corpus is not empty, and (byte tokens) gives every rank one training micro-batch."""
    from fullshard.app.data.corpus import default_corpus, load_text, split_sizes, windows
    from fullshard.app.data.token_shards import is_prepared

    data = cfg.data
    if is_prepared(data.path):
        _check_prepared(cfg, dims)
        return
    source = f"--data {data.path}" if data.path else "--data (default: the built-in corpus)"
    size = 0
    if data.path is not None:
        files = _text_files(data.path)
        size = sum(f.stat().st_size for f in files)
        if size == 0:
            what = "the file is empty" if len(files) == 1 else f"all {len(files)} files are empty"
            raise ConfigError(f"{source}: {what}: give text to train on")
    if cfg.model.tokenizer != "byte":
        return  # counting other tokens means tokenizing the corpus: the ranks check it
    micro, world_size = _draws(cfg, dims)

    def enough(n_tokens: int) -> bool:
        train = split_sizes(n_tokens, world_size, data.val_fraction)[0]
        return windows(train, data.seq_len) >= micro

    # Bytes on disk are at least twice the tokens (only "\r\n" -> "\n" shrinks text): a corpus
    # large enough by its sizes is not read here.
    if data.path is not None and enough(size // 2):
        return
    text = load_text(data.path) if data.path is not None else default_corpus()
    n = len(text.encode("utf-8"))
    if not enough(n):
        train = split_sizes(n, world_size, data.val_fraction)[0]
        raise ConfigError(
            f"{source}: {n:,} tokens are too few for one training batch: after --val-fraction "
            f"{data.val_fraction} is held out, each of {world_size} ranks gets {train:,} training "
            f"tokens, and one micro-batch of {micro} sequences of --seq-len {data.seq_len} needs "
            f"{_needed(micro, data.seq_len):,}. Give more text, or a smaller --batch-size, "
            "--seq-len or --nproc"
        )


def _needed(micro: int, seq_len: int) -> int:
    """Training tokens one rank needs for one micro-batch of ``micro`` windows."""
    return micro * (seq_len + 1) + seq_len


def _draws(cfg: TrainConfig, dims: ParallelDims) -> tuple[int, int]:
    """``(sequences one draw of a sampler takes, ranks the training stream is split over)``:
    a micro-batch from each data-parallel rank's slice, or with the global sampler
    (``--deterministic``, ``--elastic``) the whole global batch from the whole stream."""
    if cfg.global_sampler:
        return cfg.training.batch_size, 1
    return cfg.micro_batch(dims.dp), dims.dp


def _check_prepared(cfg: TrainConfig, dims: ParallelDims) -> None:
    """A prepared folder (``fullshard prepare``): its index, tokenizer and split agree with the
    flags, its shard files are intact (NOTE [Verifying token shards]: re-hashed only when their
    stat changed), every id is inside the vocabulary, and every data-parallel rank gets a batch.
    All from the index and file stats: the cost does not grow with the corpus."""
    from fullshard.app.data.corpus import windows
    from fullshard.app.data.token_shards import (
        describe_tokenizer,
        read_index,
        tokenizer_identity,
        verify_shards,
    )

    data, tokenizer = cfg.data, cfg.model.tokenizer
    assert data.path is not None
    source = f"--data {data.path}"
    index = read_index(data.path)
    prepared, mine = index["tokenizer"], tokenizer_identity(tokenizer)
    if prepared.get("kind") != mine["kind"] or prepared.get("sha256") != mine.get("sha256"):
        raise ConfigError(
            f"{source} was prepared with {describe_tokenizer(prepared)}, but --tokenizer "
            f"{tokenizer} is {describe_tokenizer(mine)}: train with the tokenizer it was "
            f"prepared with, or prepare it again with --tokenizer {tokenizer}"
        )
    if index["val_fraction"] != data.val_fraction:
        raise ConfigError(
            f"{source} was split with --val-fraction {index['val_fraction']} when it was "
            f"prepared, not {data.val_fraction}: train with --val-fraction "
            f"{index['val_fraction']}, or prepare it again"
        )
    verify_shards(data.path, full=False)
    vocab = int(prepared["vocab_size"])
    for split in ("train", "val"):
        for shard in index["splits"][split]["shards"]:
            if shard["max_token_id"] >= vocab:
                raise ConfigError(
                    f"{Path(data.path) / shard['file']}: token id {shard['max_token_id']} is "
                    f"outside the tokenizer's vocabulary of {vocab}: prepare the corpus again"
                )
    micro, dp = _draws(cfg, dims)
    train = int(index["splits"]["train"]["tokens"]) // dp
    if windows(train, data.seq_len) < micro:
        raise ConfigError(
            f"{source}: {index['tokens']:,} tokens are too few for one training batch: each of "
            f"{dp} ranks gets {train:,} training tokens, and one micro-batch of {micro} "
            f"sequences of --seq-len {data.seq_len} needs {_needed(micro, data.seq_len):,}. "
            "Give more text, or a smaller --batch-size, --seq-len or --nproc"
        )
