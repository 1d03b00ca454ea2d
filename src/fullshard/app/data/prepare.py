"""``fullshard prepare``: tokenize a corpus once, in parallel, streaming to token shards on disk.

Inputs are read as *documents*, in order: a text file is one document (read in chunks cut at a
newline), a JSONL line's ``text`` field is one, a Parquet or Arrow row's ``text`` column is one.
A folder contributes its files in sorted order, recursively. Documents are joined with ``"\\n\\n"``
exactly as :func:`fullshard.app.data.corpus.load_text` joins a folder's files, and the token stream is
split into train and validation while it streams by, with the block arithmetic of
:func:`fullshard.app.data.corpus.split_for_rank` (block ``b`` is held out by ``_held_out``, which depends
on ``b`` alone). So for the byte tokenizer, preparing a file or a text folder gives exactly the
streams the in-memory path trains on, and training from either gives the same losses.

Nothing holds the corpus: the main process reads chunks of a few MiB, worker processes tokenize
them (a bounded number in flight), and the main process writes the results in order (the output
does not depend on ``--workers``). Files are written to a staging folder and moved in when all is
done, ``index.json`` last (see :mod:`fullshard.app.data.token_shards` for the format), so an interrupted
run never leaves a folder that looks complete, and bad input leaves no partial output.

A Hugging Face tokenizer's text is tokenized chunk by chunk (a chunk ends at a newline), and the
``"\\n\\n"`` between documents on its own: ids can differ from tokenizing the whole concatenated
text at those boundaries (never for the byte tokenizer).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fullshard.app.data.corpus import VAL_BLOCK, held_out_block
from fullshard.app.data.corpus_stream import (
    encoded,
    fast_tokenizer_matches,
    fingerprint,
    input_files,
    segment_batches,
)
from fullshard.app.data.token_shards import (
    FORMAT,
    FORMAT_VERSION,
    INDEX,
    SPLITS,
    dtype_for_vocab,
    read_index,
    shard_files,
    tokenizer_identity,
    verify_shards,
    write_json_atomic,
)
from fullshard.app.errors import ConfigError

__all__ = ["DEFAULT_SHARD_TOKENS", "PrepareOptions", "input_files", "prepare", "verify"]

DEFAULT_SHARD_TOKENS = 256 << 20


@dataclass
class PrepareOptions:
    """What ``fullshard prepare`` does (see ``fullshard prepare --help``)."""

    inputs: list[str]
    out: str
    tokenizer: str = "byte"
    val_fraction: float = 0.05
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    workers: int = 0  # 0: one per CPU
    # characters read per chunk (tests use small chunks); a worker holds a batch's encodings,
    # a few hundred bytes per token, so 1 Mi characters keep a worker near 300 MiB
    chunk_chars: int = 1 << 20
    progress: bool = True


# ----------------------------------------------------------------------------------------------
# writing


class _HashedFile:
    """A file written once, hashed as it is written."""

    def __init__(self, path: Path) -> None:
        self.path, self.bytes, self._h = path, 0, hashlib.sha256()
        self._f = open(path, "wb")  # noqa: SIM115 - closed by close()

    def write(self, data: bytes) -> None:
        self._f.write(data)
        self._h.update(data)
        self.bytes += len(data)

    def close(self) -> dict[str, Any]:
        self._f.flush()
        os.fsync(self._f.fileno())  # on disk before the index can commit it
        self._f.close()
        return {"file": self.path.name, "bytes": self.bytes, "sha256": self._h.hexdigest()}


class _SplitWriter:
    """One split's token shards (cut every ``shard_tokens`` tokens) and document offsets."""

    def __init__(self, folder: Path, split: str, dtype: str, shard_tokens: int) -> None:
        self.folder, self.split, self.shard_tokens = folder, split, shard_tokens
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.tokens = 0
        self.shards: list[dict[str, Any]] = []
        self._cur: _HashedFile | None = None
        self._n = self._max = 0
        self._docs = _HashedFile(folder / f"{split}.docs.bin")
        self.documents = 0

    def add_doc_starts(self, offsets: list[int]) -> None:
        self._docs.write(np.asarray(offsets, dtype="<u8").tobytes())
        self.documents += len(offsets)

    def write(self, tokens: np.ndarray) -> None:
        while len(tokens):
            if self._cur is None:
                name = f"{self.split}-{len(self.shards):05d}.bin"
                self._cur, self._n, self._max = _HashedFile(self.folder / name), 0, 0
            part = tokens[: self.shard_tokens - self._n]
            self._cur.write(part.astype(self.dtype, copy=False).tobytes())
            self._n += len(part)
            self._max = max(self._max, int(part.max()))
            self.tokens += len(part)
            tokens = tokens[len(part) :]
            if self._n == self.shard_tokens:
                self._close_shard()

    def _close_shard(self) -> None:
        assert self._cur is not None
        self.shards.append({**self._cur.close(), "tokens": self._n, "max_token_id": self._max})
        self._cur = None

    def finish(self) -> dict[str, Any]:
        if self._cur is not None:
            self._close_shard()
        docs = {**self._docs.close(), "documents": self.documents}
        return {"tokens": self.tokens, "shards": self.shards, "doc_starts": docs}


class _Splitter:
    """Routes the token stream to train or validation, block by block (see the module doc)."""

    def __init__(self, val_fraction: float, train: _SplitWriter, val: _SplitWriter) -> None:
        self.f, self.out, self.pos = val_fraction, (train, val), 0

    def _held(self, block: int) -> bool:
        return held_out_block(block, self.f)

    def doc_start(self, p: int) -> None:
        """Record a document starting at stream position ``p`` in the split its block is in."""
        block = p // VAL_BLOCK
        held = self._held(block)
        # blocks 0..block-1 hold int(block * f) held-out blocks (the running count of _held_out)
        val_before = int(block * self.f) * VAL_BLOCK + (p - block * VAL_BLOCK if held else 0)
        self.out[held].add_doc_starts([val_before if held else p - val_before])

    def write(self, tokens: np.ndarray) -> None:
        i, n = 0, len(tokens)
        while i < n:
            held = self._held(self.pos // VAL_BLOCK)
            end = (self.pos // VAL_BLOCK + 1) * VAL_BLOCK
            while end - self.pos < n - i and self._held(end // VAL_BLOCK) == held:
                end += VAL_BLOCK  # runs of same-side blocks in one write
            k = min(n - i, end - self.pos)
            self.out[held].write(tokens[i : i + k])
            i, self.pos = i + k, self.pos + k


# ----------------------------------------------------------------------------------------------
# the command


def _options(opts: PrepareOptions, identity: dict[str, Any], dtype: str) -> dict[str, Any]:
    """What the output depends on besides the inputs (``--workers`` and the bar do not count)."""
    return {
        "tokenizer": identity,
        "dtype": dtype,
        "val_fraction": opts.val_fraction,
        "val_block": VAL_BLOCK,
        "shard_tokens": opts.shard_tokens,
        "chunk_chars": opts.chunk_chars,
    }


def _up_to_date(out: Path, inputs: list[dict[str, Any]], options: dict[str, Any]) -> bool:
    try:
        index = read_index(out)
    except ConfigError:
        return False
    if index.get("inputs") != inputs or index.get("options") != options:
        return False
    try:
        verify_shards(out, full=False)  # stats as recorded: nothing is re-hashed
    except ConfigError:
        return False
    return True


def _check_options(opts: PrepareOptions) -> None:
    if not opts.out:
        raise ConfigError("give the output folder: --out DIR")
    if not 0.0 <= opts.val_fraction < 1.0:
        raise ConfigError(f"--val-fraction must be in [0, 1), got {opts.val_fraction}")
    if opts.shard_tokens < 1 or opts.workers < 0 or opts.chunk_chars < 1:
        raise ConfigError("--shard-tokens must be at least 1 and --workers at least 0")
    if opts.tokenizer != "byte" and not Path(opts.tokenizer).is_dir():
        raise ConfigError(
            f"--tokenizer {opts.tokenizer!r} is neither 'byte' nor a local tokenizer directory"
        )
    _check_out(Path(opts.out))


def _check_out(out: Path) -> None:
    """``--out`` is (or can become) a folder, with no ``index.json`` other than one prepare wrote:
    committing replaces the index, so anyone else's would be lost."""
    above = out
    while not above.exists() and above != above.parent:
        above = above.parent  # the nearest existing folder above it: created from there
    if not above.is_dir():
        what = "is a file" if above == out else f"cannot be created: {above} is a file"
        raise ConfigError(f"--out {out} {what}: give a folder (it is created if missing)")
    index = out / INDEX
    if index.exists() or index.is_symlink():
        try:
            ours = json.loads(index.read_text(encoding="utf-8")).get("format") == FORMAT
        except (OSError, ValueError, AttributeError):  # unreadable, not JSON, not an object
            ours = False
        if not ours:
            raise ConfigError(
                f"--out {out}: {index} exists and was not written by fullshard prepare (it is "
                "left as it is): give a new or empty folder, or the folder of an earlier prepare"
            )


def prepare(opts: PrepareOptions) -> dict[str, Any]:
    """Tokenize ``opts.inputs`` into the prepared folder ``opts.out``; returns the index (or
    the existing one, untouched, when it is up to date)."""
    _check_options(opts)
    files = input_files(opts.inputs)
    vocab = 256
    if opts.tokenizer != "byte":
        from fullshard.app.data.corpus import HFTokenizer

        vocab = HFTokenizer(opts.tokenizer).vocab_size
    identity = tokenizer_identity(opts.tokenizer, vocab)
    dtype = dtype_for_vocab(vocab)
    out = Path(opts.out)
    inputs, options = fingerprint(files), _options(opts, identity, dtype)
    if _up_to_date(out, inputs, options):
        print(f"fullshard prepare: {out} is up to date (same inputs and options); nothing to do")
        return read_index(out)

    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        for stale in out.glob(".prepare-*"):  # an interrupted run's staging folder
            if stale.name[len(".prepare-") :].isdigit() and stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
        stage = out / f".prepare-{os.getpid()}"
        stage.mkdir()
    except OSError as exc:  # no permission, a read-only or special file system
        raise ConfigError(f"--out {out}: cannot write there ({exc.strerror or exc})") from None
    try:
        index = _write(opts, files, stage, identity, dtype, vocab)
        index.update(inputs=inputs, options=options)
        _commit(out, stage, index)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        if created and not any(out.iterdir()):
            out.rmdir()
        raise
    return index


class _NoBar:
    """What ``prepare`` uses of a tqdm bar, drawing nothing."""

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def update(self, n: int) -> None:
        pass


def _progress_bar(total_bytes: int, wanted: bool) -> Any:
    """tqdm's bar in MB/s on stderr (only on a terminal: ``disable=None``), or, when tqdm (an
    optional extra) is missing, one line saying how to get it and a bar that draws nothing."""
    try:
        from tqdm import tqdm
    except ImportError:
        if wanted and sys.stderr.isatty():
            print(
                "fullshard prepare: no progress bar: tqdm is not installed "
                "(pip install 'fullshard[cli]')",
                file=sys.stderr,
                flush=True,
            )
        return _NoBar()
    return tqdm(
        total=total_bytes,
        unit="B",
        unit_scale=True,
        desc="prepare",
        file=sys.stderr,
        disable=None if wanted else True,
        dynamic_ncols=True,
    )


def _write(
    opts: PrepareOptions,
    files: list[Path],
    stage: Path,
    identity: dict[str, Any],
    dtype: str,
    vocab: int,
) -> dict[str, Any]:
    # Byte "tokenizing" is a copy (UTF-8 encode): shipping the text to a worker and the tokens
    # back costs more than doing it here (measured: 192 MB/s in-process vs 37 MB/s with 2
    # workers on 2 CPUs), so workers serve real tokenizers only.
    workers = 1 if opts.tokenizer == "byte" else opts.workers or os.cpu_count() or 1
    fast = opts.tokenizer != "byte" and fast_tokenizer_matches(opts.tokenizer)
    total_bytes = sum(f.stat().st_size for f in files)
    writers = {s: _SplitWriter(stage, s, dtype, opts.shard_tokens) for s in SPLITS}
    splitter = _Splitter(opts.val_fraction, writers["train"], writers["val"])
    stats = {"documents": 0, "chars": 0}
    start = time.perf_counter()
    with _progress_bar(total_bytes, opts.progress) as bar:
        batches = segment_batches(files, opts.chunk_chars, bar.update, stats)
        for segments, tokens, lengths in encoded(batches, workers, (opts.tokenizer, fast, dtype)):
            offset = 0
            for (_, starts_doc), n in zip(segments, lengths, strict=True):
                if starts_doc:
                    splitter.doc_start(splitter.pos + offset)
                offset += n
            if len(tokens) and int(tokens.max()) >= vocab:
                raise ConfigError(
                    f"tokenizer {opts.tokenizer} produced id {int(tokens.max())} >= its "
                    f"vocabulary of {vocab}"
                )
            splitter.write(tokens)
    seconds = time.perf_counter() - start
    if stats["chars"] == 0:
        what = ", ".join(opts.inputs)
        raise ConfigError(
            f"{what}: no text to prepare ({stats['documents']} document(s), all empty): give "
            "files or records with text"
        )
    splits = {s: w.finish() for s, w in writers.items()}
    mb = total_bytes / 1e6
    print(
        f"fullshard prepare: {stats['documents']:,} documents from {len(files)} file(s): "
        f"{mb:,.1f} MB read, {splitter.pos:,} tokens written (train {splits['train']['tokens']:,}"
        f", val {splits['val']['tokens']:,}) in {seconds:.1f} s, {mb / max(seconds, 1e-9):,.1f} "
        f"MB/s ({'in-process' if workers == 1 else f'{workers} workers'}"
        f"{', fast tokenizer' if fast else ''})",
        flush=True,
    )
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "dtype": dtype,
        "tokenizer": identity,
        "val_fraction": opts.val_fraction,
        "val_block": VAL_BLOCK,
        "documents": stats["documents"],
        "tokens": splitter.pos,
        "splits": splits,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _stat_records(folder: Path, index: dict[str, Any]) -> None:
    """Record each file's current mtime in ``index`` (see NOTE [Verifying token shards])."""
    for split in SPLITS:
        entry = index["splits"][split]
        for rec in [*entry["shards"], entry["doc_starts"]]:
            rec["mtime_ns"] = (folder / rec["file"]).stat().st_mtime_ns


def _commit(out: Path, stage: Path, index: dict[str, Any]) -> None:
    """Move the staged files in and write the index last: until the new index lands, the folder
    has none (an interrupted commit never looks complete)."""
    old = out / INDEX
    previous: list[str] = []
    if old.is_file():
        try:
            previous = list(shard_files(read_index(out)))
        except (ConfigError, KeyError):
            previous = []
        old.unlink()
    for name in previous:  # the old run's files that the new one does not overwrite
        (out / name).unlink(missing_ok=True)
    for f in stage.iterdir():
        os.replace(f, out / f.name)
    stage.rmdir()
    _stat_records(out, index)
    write_json_atomic(out / INDEX, index)


def verify(folder: str) -> str:
    """``fullshard prepare --verify``: re-hash every file; when all match, record their stats."""
    n = sum(verify_shards(folder, full=True))
    index = read_index(folder)
    _stat_records(Path(folder), index)
    write_json_atomic(Path(folder) / INDEX, index)
    return f"fullshard prepare: {folder}: all {n} files match their checksums"
