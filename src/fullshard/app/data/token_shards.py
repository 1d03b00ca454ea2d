"""The on-disk format of a prepared corpus (``fullshard prepare``) and its memory-mapped reader.

A prepared folder holds, per split (``train`` and ``val``)::

    train-00000.bin  train-00001.bin ...   tokens, raw little-endian uint8/uint16/uint32
    train.docs.bin                         uint64 token offsets (in the split) of document starts
    val-00000.bin ...  val.docs.bin
    index.json                             written last, atomically: the commit marker

``index.json`` records the format version, dtype, the tokenizer's identity, the split
(``val_fraction`` over ``VAL_BLOCK``-token blocks, exactly as :func:`fullshard.app.data.corpus.split_for_rank`
cuts the in-memory stream), every shard's name, token count, size, mtime and sha256 and largest
token id, and the inputs' fingerprint and options (so that re-running ``prepare`` on unchanged
inputs is a no-op). A folder without ``index.json`` is not a prepared corpus, whatever else it holds.

The reader (:class:`TokenStream`) presents a split as one stream across its shard files and
gathers windows into int64 tensors; nothing is read until a window is asked for, so opening a
prepared corpus costs the same whatever its size.

NOTE [Verifying token shards]
A full sha256 of every shard at every start-up would make start-up time proportional to the
corpus (minutes for tens of GB). So ``prepare`` records each shard's sha256 *with* its size and
mtime_ns, and the start-up check (:func:`verify_shards` with ``full=False``, run by ``fullshard
train``'s validation before any rank starts) trusts a shard whose size and mtime are as recorded
and re-hashes in full (streamed, not mapped, so memory stays flat) one whose stat changed; a
mismatch is an error naming the file. ``fullshard prepare --verify DIR`` re-hashes every shard and,
when all match, records their current stats (after a copy that did not keep mtimes, the next
start-ups trust them again). What this catches: truncated or extended files (size), files
rewritten or replaced by tools that update mtime (any edit through the file system API), files
copied without their mtimes (re-hashed). What it does not: a change that keeps both size and mtime
(bit rot on disk, ``touch -d`` back-dating after an edit, writes through a still-open mapping in
the same second on file systems with coarse timestamps); ``--verify`` catches those. As a last
line of defence every batch's largest id is checked against the vocabulary on the host, so a
corrupted id never reaches the device (on CUDA an out-of-range embedding index is a device-side
assert, not an error message).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from fullshard.app.errors import ConfigError
from fullshard.checkpoint.store import file_sha256

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "INDEX",
    "SPLITS",
    "Shard",
    "TensorTokens",
    "TokenShards",
    "TokenSource",
    "TokenStream",
    "dtype_for_vocab",
    "is_prepared",
    "read_index",
    "tokenizer_identity",
    "verify_shards",
    "write_json_atomic",
]

FORMAT = "fullshard-tokens"
FORMAT_VERSION = 1
INDEX = "index.json"
SPLITS = ("train", "val")


class TokenSource(Protocol):
    """What the samplers need from a token stream: a length and windows as int64 tensors."""

    def __len__(self) -> int: ...

    def gather(self, starts: torch.Tensor, length: int) -> torch.Tensor:
        """``(len(starts), length)`` int64 tokens: row i is ``stream[starts[i] : starts[i] + length]``."""
        ...


class TensorTokens:
    """An in-memory token tensor as a :class:`TokenSource` (the ``--data file.txt`` path)."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def gather(self, starts: torch.Tensor, length: int) -> torch.Tensor:
        return self.tokens[starts[:, None] + torch.arange(length)[None, :]].long()


def dtype_for_vocab(vocab_size: int) -> str:
    """The smallest unsigned dtype that holds every id of a ``vocab_size`` vocabulary."""
    if vocab_size <= 1 << 8:
        return "uint8"
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def tokenizer_identity(spec: str, vocab_size: int | None = None) -> dict[str, Any]:
    """What a prepared corpus records of its tokenizer, to refuse training with another one.

    ``"byte"``: ``{"kind": "byte", "vocab_size": 256}``. A tokenizer directory: its kind, the
    vocabulary size (``vocab_size``, when the caller has loaded the tokenizer) and one sha256 over
    the names and contents of the files in the directory (not its path: a copied tokenizer is the
    same tokenizer).
    """
    if spec == "byte":
        return {"kind": "byte", "vocab_size": 256}
    files = sorted(p for p in Path(spec).iterdir() if p.is_file())
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.name}\0{file_sha256(p)}\n".encode())
    out: dict[str, Any] = {"kind": "hf", "sha256": h.hexdigest(), "files": [p.name for p in files]}
    if vocab_size is not None:
        out["vocab_size"] = vocab_size
    return out


def describe_tokenizer(identity: dict[str, Any]) -> str:
    """One phrase naming a tokenizer identity, for error messages."""
    if identity.get("kind") == "byte":
        return "the byte tokenizer"
    vocab = identity.get("vocab_size")
    return f"a Hugging Face tokenizer (sha256 {str(identity.get('sha256'))[:12]}" + (
        f", vocabulary {vocab})" if vocab else ")"
    )


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON to a temporary name, flush it to disk, then rename: readers see all or nothing."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def is_prepared(path: str | None) -> bool:
    """Whether ``path`` is a folder holding a prepared corpus (its committed index)."""
    return path is not None and (Path(path) / INDEX).is_file()


def read_index(folder: str | Path) -> dict[str, Any]:
    """The index of a prepared folder, checked for format and version (ConfigError otherwise)."""
    path = Path(folder) / INDEX
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read the prepared corpus's index ({exc})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ConfigError(f"{path} is not a fullshard prepared-corpus index")
    if index.get("version") != FORMAT_VERSION:
        raise ConfigError(
            f"{path}: format version {index.get('version')}, this fullshard reads version "
            f"{FORMAT_VERSION}: prepare the corpus again with this fullshard"
        )
    return index


@dataclass(frozen=True)
class Shard:
    """One token file of a split."""

    path: Path
    tokens: int
    max_token_id: int


def _shards(folder: Path, index: dict[str, Any], split: str) -> list[Shard]:
    return [
        Shard(folder / s["file"], int(s["tokens"]), int(s["max_token_id"]))
        for s in index["splits"][split]["shards"]
    ]


def verify_shards(folder: str | Path, *, full: bool) -> tuple[int, int]:
    """Check every shard file of a prepared folder against its index (see NOTE [Verifying token
    shards]); returns ``(shards trusted by stat, shards re-hashed)``.

    ``full=False`` re-hashes only shards whose size or mtime changed; ``full=True`` all of them.
    Raises :class:`ConfigError` naming the first missing, resized or corrupted file.
    """
    folder = Path(folder)
    index = read_index(folder)
    itemsize = np.dtype(index["dtype"]).itemsize
    trusted = hashed = 0
    for split in SPLITS:
        entry = index["splits"][split]
        files = [(s, s["tokens"] * itemsize) for s in entry["shards"]]
        files.append((entry["doc_starts"], entry["doc_starts"]["documents"] * 8))
        for rec, want in files:
            path = folder / rec["file"]
            try:
                st = path.stat()
            except OSError:
                raise ConfigError(
                    f"{path}: missing shard of the prepared corpus {folder}: prepare it again"
                ) from None
            if st.st_size != want or st.st_size != rec["bytes"]:
                raise ConfigError(
                    f"{path}: {st.st_size:,} bytes, the index records {want:,}: the shard was "
                    f"truncated or changed; prepare the corpus again"
                )
            if not full and st.st_mtime_ns == rec["mtime_ns"]:
                trusted += 1
                continue
            hashed += 1
            if file_sha256(path) != rec["sha256"]:
                raise ConfigError(
                    f"{path}: checksum mismatch (sha256 differs from the index): the shard is "
                    "corrupted; prepare the corpus again"
                )
    return trusted, hashed


class TokenStream:
    """A contiguous range ``[start, stop)`` of a split, read through memory maps of its shards.

    Implements :class:`TokenSource`. Each shard is mapped on first use, so a rank maps (and the
    OS reads) only the shards its windows fall in. ``vocab_size``: every gathered window's largest
    id is checked against it on the host (see NOTE [Verifying token shards]).
    """

    def __init__(
        self,
        shards: list[Shard],
        dtype: str,
        vocab_size: int,
        start: int = 0,
        stop: int | None = None,
    ) -> None:
        self.shards, self.dtype, self.vocab_size = shards, np.dtype(dtype), vocab_size
        # ends[i]: stream offset one past shard i's last token
        self._ends = np.cumsum([s.tokens for s in shards], dtype=np.int64)
        total = int(self._ends[-1]) if shards else 0
        self.start, self.stop = start, total if stop is None else stop
        if not 0 <= self.start <= self.stop <= total:
            raise ValueError(f"range [{start}, {stop}) outside a stream of {total} tokens")
        self._maps: dict[int, np.memmap] = {}

    def __len__(self) -> int:
        return self.stop - self.start

    def slice(self, start: int, stop: int) -> TokenStream:
        """The sub-range ``[start, stop)`` of this stream (offsets relative to it)."""
        return TokenStream(
            self.shards, self.dtype.name, self.vocab_size, self.start + start, self.start + stop
        )

    def _map(self, i: int) -> np.memmap:
        if i not in self._maps:
            self._maps[i] = np.memmap(self.shards[i].path, dtype=self.dtype, mode="r")
        return self._maps[i]

    def _read(self, pos: int, length: int, out: np.ndarray) -> list[int]:
        """Copy ``length`` tokens from absolute offset ``pos`` into ``out``, across shard ends;
        returns the shards read."""
        i = int(np.searchsorted(self._ends, pos, side="right"))
        used, done = [], 0
        while done < length:
            first = int(self._ends[i - 1]) if i else 0
            n = min(length - done, int(self._ends[i]) - pos)
            out[done : done + n] = self._map(i)[pos - first : pos - first + n]
            used.append(i)
            done, pos, i = done + n, pos + n, i + 1
        return used

    def gather(self, starts: torch.Tensor, length: int) -> torch.Tensor:
        out = np.empty((len(starts), length), dtype=np.int64)
        used: set[int] = set()
        for row, s in enumerate(starts.tolist()):
            if s < 0 or s + length > len(self):
                raise IndexError(f"window [{s}, {s + length}) outside {len(self)} tokens")
            used.update(self._read(self.start + s, length, out[row]))
        if out.size and int(out.max()) >= self.vocab_size:
            names = ", ".join(str(self.shards[i].path) for i in sorted(used))
            raise ConfigError(
                f"{names}: token id {int(out.max())} is outside the tokenizer's vocabulary of "
                f"{self.vocab_size}: the shard is corrupted or was prepared with another "
                "tokenizer; run fullshard prepare --verify, or prepare the corpus again"
            )
        return torch.from_numpy(out)


class TokenShards:
    """A prepared corpus, opened for training: each split as a :class:`TokenStream`.

    Opening reads only the index (no token is read), so it costs the same for 10 MB or 10 GB.
    ``len()`` is the whole corpus's token count (train + validation), like the in-memory tensor's.
    """

    def __init__(self, folder: str | Path, vocab_size: int) -> None:
        self.folder = Path(folder)
        self.index = read_index(self.folder)
        self.val_fraction = float(self.index["val_fraction"])
        self.streams = {
            split: TokenStream(
                _shards(self.folder, self.index, split), self.index["dtype"], vocab_size
            )
            for split in SPLITS
        }

    def __len__(self) -> int:
        return sum(len(s) for s in self.streams.values())

    def rank_split(self, rank: int, world_size: int) -> tuple[TokenStream, TokenStream]:
        """This rank's (train, validation) slices, cut exactly as
        :func:`fullshard.app.data.corpus.split_for_rank` cuts the in-memory stream."""
        train, val = self.streams["train"], self.streams["val"]
        tr, va = len(train) // world_size, len(val) // world_size
        return (
            train.slice(rank * tr, (rank + 1) * tr),
            val.slice(rank * va, (rank + 1) * va),
        )


def shard_files(index: dict[str, Any]) -> Iterable[str]:
    """Every file name a committed index refers to (shards and document offsets)."""
    for split in SPLITS:
        entry = index["splits"][split]
        yield from (s["file"] for s in entry["shards"])
        yield entry["doc_starts"]["file"]
