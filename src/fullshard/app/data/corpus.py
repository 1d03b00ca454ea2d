"""Text corpora, tokenizers, and a rank-sharded, seeded, resumable batch sampler.

The default corpus is the English prose of Python's own documentation, shipped with every CPython
as ``pydoc_data.topics.topics`` (the text ``help("if")`` shows; PSF license): real text on every
machine, with no download.

A corpus prepared by ``fullshard prepare`` (:mod:`fullshard.app.data.prepare`) is read from its token
shards instead (:class:`fullshard.app.data.token_shards.TokenShards`): the same split, the same
sampler, without tokenizing or holding the corpus.

Splitting (every rank computes the same split from the same corpus, whatever the world size):
the token stream is cut into blocks of ``VAL_BLOCK`` tokens and an evenly spaced ``val_fraction``
of the blocks is held out for validation. Evenly spaced rather than "the last 5%" because a
corpus's end is rarely typical (the documentation topics end in reference tables that are much
easier to predict than prose). Train and validation streams are then each cut into ``world_size``
equal, contiguous, disjoint slices::

    train: [ rank 0 | rank 1 | ... | rank N-1 ]      val: [ rank 0 | ... | rank N-1 ]

so ranks never see each other's text, and every rank draws the same number of batches (each FSDP
forward is a collective, so the counts must match).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from fullshard.app.data.token_shards import TensorTokens, TokenShards, TokenSource, is_prepared
from fullshard.app.errors import ConfigError

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "RankBatches",
    "Tokenizer",
    "build_tokenizer",
    "check_text_file",
    "default_corpus",
    "encode_corpus",
    "eval_batches",
    "held_out_block",
    "load_text",
    "load_tokens",
    "split_for_rank",
    "split_sizes",
    "windows",
]

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")
# Granularity of the train/validation split, in tokens (see the module docstring).
VAL_BLOCK = 4096
# What a corpus file handed over by mistake starts with, and what to do about it: read as UTF-8
# it would become a stream of replacement characters, trained on without a word.
_MAGIC = {
    b"\x1f\x8b": ("gzip-compressed", "decompress it first (gunzip)"),
    b"BZh": ("bzip2-compressed", "decompress it first (bunzip2)"),
    b"\xfd7zXZ\x00": ("xz-compressed", "decompress it first (unxz)"),
    b"\x28\xb5\x2f\xfd": ("zstd-compressed", "decompress it first (unzstd)"),
    b"PK\x03\x04": ("a zip archive", "unpack it and give its files or folder"),
    b"PAR1": ("a Parquet file", "give it a .parquet name (fullshard prepare reads those)"),
}
# Characters of a file's head that are replacement (undecodable bytes) or control characters,
# above which it is binary, not text. Measured: compressed or random bytes give 53-55%, UTF-16
# 54%, the invalid-UTF-8 test corpus 12.5%, Latin-1 prose dense with accents 26%.
_BINARY_SHARE = 0.4
_SNIFF_BYTES = 64 << 10


class Tokenizer(Protocol):
    """What the trainer needs from a tokenizer."""

    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, nothing to download, any text round-trips."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        # A sampled byte sequence may cut a multi-byte character: replace, don't fail.
        return bytes(i % 256 for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A tokenizer from a local Hugging Face tokenizer directory (needs ``transformers``)."""

    def __init__(self, path: str) -> None:
        from fullshard.app.models.hf import require_transformers

        try:
            transformers = require_transformers()
        except ImportError as exc:
            raise ConfigError(f"--tokenizer {path}: {exc}") from None
        try:
            self._tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as exc:
            # transformers' own messages run over many lines and speak of downloads
            raise ConfigError(_tokenizer_problem(path, exc)) from None
        self.vocab_size = len(self._tok)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids))


def _tokenizer_problem(path: str, exc: Exception) -> str:
    """One line saying why the tokenizer folder ``path`` did not load, and what to give."""
    todo = "give a folder written by tokenizer.save_pretrained(DIR), or 'byte'"
    if not (Path(path) / "tokenizer.json").is_file():
        return f"--tokenizer {path}: no tokenizer in this folder (it has no tokenizer.json): {todo}"
    first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    return f"--tokenizer {path}: its tokenizer does not load ({first}): {todo}"


def build_tokenizer(spec: str) -> Tokenizer:
    """``"byte"`` for the byte-level tokenizer, else a local Hugging Face tokenizer directory."""
    if spec == "byte":
        return ByteTokenizer()
    if not Path(spec).is_dir():
        raise ValueError(
            f"tokenizer {spec!r} is neither 'byte' nor a local tokenizer directory "
            "(nothing is downloaded)"
        )
    return HFTokenizer(spec)


def check_text_file(path: Path) -> None:
    """Raise :class:`ConfigError` naming ``path`` when its first 64 KiB are not text: a
    compressed or archive format (by its magic bytes), or mostly undecodable as UTF-8."""
    try:
        with open(path, "rb") as f:
            head = f.read(_SNIFF_BYTES)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    for magic, (what, todo) in _MAGIC.items():
        if head.startswith(magic):
            raise ConfigError(f"{path} is {what}, not text: {todo}")
    text = head.decode("utf-8", errors="replace")
    bad = sum(1 for c in text if c == "\ufffd" or (c < " " and c not in "\t\n\r\f\v"))
    if text and bad > _BINARY_SHARE * len(text):
        raise ConfigError(
            f"{path} is not UTF-8 text ({100 * bad // len(text)}% of its first "
            f"{len(head):,} bytes are undecodable or control characters: binary, compressed "
            "or UTF-16?): give UTF-8 text, or convert the file first"
        )


def default_corpus() -> str:
    """Python's documentation topics (``pydoc_data.topics``), ~465k characters of English."""
    from pydoc_data.topics import topics

    # Sorted keys: the same text, in the same order, on every machine and Python build.
    return "\n\n".join(topics[key].strip() for key in sorted(topics))


def load_text(path: str | None) -> str:
    """The training text: ``path`` (a file, or a folder of text files), or the default corpus.

    A folder contributes every ``.txt``/``.md``/``.rst``/``.text`` file under it, in sorted order.
    A file that is not text (compressed, binary: :func:`check_text_file`) is refused.
    """
    if path is None:
        return default_corpus()
    p = Path(path)
    if p.is_file():
        check_text_file(p)
        return p.read_text(encoding="utf-8", errors="replace")
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
        if not files:
            raise ValueError(f"data folder {path} holds no text files ({', '.join(TEXT_SUFFIXES)})")
        for f in files:
            check_text_file(f)
        return "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)
    raise FileNotFoundError(f"data path {path} does not exist: give a text file or a folder")


def held_out_block(b: int, val_fraction: float) -> bool:
    """Whether block ``b`` is held out for validation: when the running count floor(b * f)
    steps up, so blocks are evenly spaced, ``int(b * f)`` of them come before block ``b``, and
    the answer depends on ``b`` alone (``fullshard prepare`` splits while streaming)."""
    return int((b + 1) * val_fraction) > int(b * val_fraction)


def _held_out(n_blocks: int, val_fraction: float) -> list[bool]:
    # exactly floor(n_blocks * f) blocks in all
    return [held_out_block(b, val_fraction) for b in range(n_blocks)]


def split_sizes(n_tokens: int, world_size: int, val_fraction: float) -> tuple[int, int]:
    """Tokens per rank of (train, validation) that :func:`split_for_rank` gives a stream of
    ``n_tokens``: the split's arithmetic alone, for checking a corpus before any rank starts."""
    n_blocks = max(1, -(-n_tokens // VAL_BLOCK))
    sizes = [VAL_BLOCK] * (n_blocks - 1) + [n_tokens - VAL_BLOCK * (n_blocks - 1)]
    val = sum(n for n, v in zip(sizes, _held_out(n_blocks, val_fraction), strict=True) if v)
    return (n_tokens - val) // world_size, val // world_size


def windows(n_tokens: int, seq_len: int) -> int:
    """Training windows of ``seq_len + 1`` tokens per epoch in a slice of ``n_tokens`` (the
    random start offset can cost one window, so counted without it)."""
    return max(0, (n_tokens - seq_len) // (seq_len + 1))


def split_for_rank(tokens: Any, rank: int, world_size: int, val_fraction: float) -> tuple[Any, Any]:
    """This rank's disjoint (train, validation) slices of the token stream (see module doc).

    ``tokens``: a tensor, or a prepared corpus (:class:`TokenShards`, split when it was
    prepared, with the same arithmetic; its ``val_fraction`` is checked before launch)."""
    if isinstance(tokens, TokenShards):
        return tokens.rank_split(rank, world_size)
    blocks = list(torch.split(tokens, VAL_BLOCK))
    is_val = _held_out(len(blocks), val_fraction)
    train = torch.cat([blk for blk, v in zip(blocks, is_val, strict=True) if not v] or [tokens[:0]])
    val = torch.cat([blk for blk, v in zip(blocks, is_val, strict=True) if v] or [tokens[:0]])
    tr, va = len(train) // world_size, len(val) // world_size
    return train[rank * tr : (rank + 1) * tr], val[rank * va : (rank + 1) * va]


class RankBatches:
    """Seeded (input, target) batches of windows from one rank's slice, with a resumable position.

    ``tokens``: a tensor or any :class:`TokenSource` (a prepared corpus's memory-mapped stream).
    Each epoch cuts the slice into non-overlapping windows of ``seq_len + 1`` tokens from a random
    start offset, and visits them in a random order; both come from a generator seeded by
    ``(seed, rank, epoch)``, so the position is fully described by ``state_dict()`` (epoch and
    cursor): no RNG state needs saving, and a restored sampler continues with the same batches.
    """

    def __init__(
        self,
        tokens: torch.Tensor | TokenSource,
        seq_len: int,
        batch_size: int,
        *,
        seed: int,
        rank: int,
        world_independent: bool = False,
    ) -> None:
        self.tokens = _source(tokens)
        # the global sampler (--deterministic): one stream for every rank, so one position,
        # valid at any world size (a checkpoint's is loaded as it is on another world size)
        self.world_independent = world_independent
        self.seq_len, self.batch_size = seq_len, batch_size
        self.seed, self.rank = seed, rank
        self.epoch, self.cursor, self.batches_drawn = 0, 0, 0
        if self.windows_per_epoch() < batch_size:
            raise ConfigError(
                f"rank {rank}'s training slice has {len(tokens)} tokens: fewer than one batch of "
                f"{batch_size} x {seq_len + 1}. Use more text, fewer ranks, or a smaller "
                "--batch-size/--seq-len."
            )
        self._order = self._epoch_order()

    def windows_per_epoch(self) -> int:
        """Windows per epoch (see :func:`windows`)."""
        return windows(len(self.tokens), self.seq_len)

    def _epoch_order(self) -> torch.Tensor:
        # Seed mixes epoch and rank so that each (rank, epoch) pair gets its own stream.
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.rank * 7919 + self.epoch)
        self._offset = int(torch.randint(0, self.seq_len + 1, (1,), generator=gen))
        # Only the permutation is kept, as int32 where it fits (4 bytes per window, not the 16+
        # of materialized int64 starts): torch's CPU randperm draws the same permutation for
        # every dtype, so the order is the one int64 starts[randperm] gave.
        n = self.windows_per_epoch()
        dtype = torch.int32 if n < 2**31 else torch.int64
        return torch.randperm(n, generator=gen, dtype=dtype)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``(inputs, targets)``, each ``(batch_size, seq_len)`` int64."""
        if self.cursor + self.batch_size > len(self._order):
            self.epoch, self.cursor = self.epoch + 1, 0
            self._order = self._epoch_order()
        window = self._order[self.cursor : self.cursor + self.batch_size].long()
        starts = self._offset + window * (self.seq_len + 1)
        self.cursor += self.batch_size
        self.batches_drawn += 1
        chunk = self.tokens.gather(starts, self.seq_len + 1)
        return chunk[:, :-1], chunk[:, 1:]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """The sampler position: enough to resume the same batch sequence."""
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "batches_drawn": self.batches_drawn,
            "seed": self.seed,
            "world_independent": self.world_independent,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by :meth:`state_dict`."""
        if state["seed"] != self.seed:
            raise ValueError(f"data state was saved with seed {state['seed']}, not {self.seed}")
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self.batches_drawn = int(state["batches_drawn"])
        self._order = self._epoch_order()


def eval_batches(
    tokens: torch.Tensor | TokenSource, seq_len: int, batch_size: int, max_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed, consecutive validation batches from one rank's validation slice.

    Deterministic (no sampling) so that validation losses are comparable across evaluations.
    Every rank's slice has the same length, so every rank gets the same number of batches.
    """
    source = _source(tokens)
    n_windows = (len(source) - 1) // seq_len
    n_batches = min(max_batches, n_windows // batch_size)
    out = []
    for b in range(n_batches):
        starts = (torch.arange(batch_size) + b * batch_size) * seq_len
        chunk = source.gather(starts, seq_len + 1)
        out.append((chunk[:, :-1], chunk[:, 1:]))
    return out


def _source(tokens: torch.Tensor | TokenSource) -> TokenSource:
    return TensorTokens(tokens) if isinstance(tokens, torch.Tensor) else tokens


def load_tokens(path: str | None, tokenizer: Tokenizer) -> torch.Tensor | TokenShards:
    """The training tokens of ``--data path``: a prepared folder opened as :class:`TokenShards`
    (nothing is read yet), else the text encoded in memory."""
    if is_prepared(path):
        assert path is not None
        return TokenShards(path, tokenizer.vocab_size)
    return encode_corpus(load_text(path), tokenizer)


def encode_corpus(text: str, tokenizer: Tokenizer) -> torch.Tensor:
    """Encode the whole corpus into a compact 1-D tensor (uint8 for bytes, else int32)."""
    ids = tokenizer.encode(text)
    dtype = torch.uint8 if tokenizer.vocab_size <= 256 else torch.int32
    return torch.tensor(ids, dtype=dtype)
