"""The reading half of ``fullshard prepare``: inputs as documents, tokenized in worker processes.

A text file is one document, read in chunks cut after a newline and decoded exactly as
:func:`fullshard.app.data.corpus.load_text` decodes it (UTF-8 with invalid bytes replaced, universal
newlines), so its chunks join to the same text; a JSONL line's ``text`` field, or a Parquet or
Arrow row's ``text`` column, is one document. Documents become *segments* (the ``"\n\n"``
separator between documents, then the document's chunks), batched by size; worker processes
tokenize the batches and the results come back in input order, with a bounded number in flight.
"""

from __future__ import annotations

import io
import json
import multiprocessing
import sys
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from fullshard.app.data.corpus import TEXT_SUFFIXES, check_text_file
from fullshard.app.errors import ConfigError

__all__ = [
    "DATA_SUFFIXES",
    "SEPARATOR",
    "encoded",
    "fast_tokenizer_matches",
    "fingerprint",
    "input_files",
    "segment_batches",
]

DATA_SUFFIXES = (".jsonl", ".parquet", ".arrow")
SEPARATOR = "\n\n"  # between documents, as load_text joins files
COMPRESSED_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".zip")
PYARROW_HINT = "pip install 'fullshard[data]' (or pip install pyarrow)"
Segment = tuple[str, bool]  # (text, starts a document)

# ----------------------------------------------------------------------------------------------
# inputs


def input_files(inputs: list[str]) -> list[Path]:
    """The files to read, in order: each input file as given, each folder's files sorted.

    Every text or JSONL file's head is checked to be text (:func:`check_text_file`): a
    compressed or binary file is refused, naming it, before any output is written (read as
    UTF-8 it would be tokenized as replacement characters)."""
    if not inputs:
        raise ConfigError("no input: give text/JSONL/Parquet files or folders, and --out DIR")
    files: list[Path] = []
    for spec in inputs:
        p = Path(spec)
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            found = sorted(
                f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES + DATA_SUFFIXES
            )
            packed = sorted(f for f in p.rglob("*") if f.is_file() and _compressed_input(f))
            hint = f" (e.g. {packed[0]}): decompress them to read them" if packed else ""
            if not found:
                raise ConfigError(
                    f"{spec}: the folder holds no input files "
                    f"({', '.join(TEXT_SUFFIXES + DATA_SUFFIXES)})"
                    + (f"; {len(packed)} compressed one(s){hint}" if packed else "")
                )
            if packed:  # skipped like any other file, but likely meant to be read: say so
                print(
                    f"fullshard prepare: warning: {spec}: skipping {len(packed)} compressed "
                    f"file(s){hint}",
                    file=sys.stderr,
                )
            files.extend(found)
        else:
            raise ConfigError(f"{spec} does not exist: give a file or a folder")
    if any(f.suffix in (".parquet", ".arrow") for f in files):
        _pyarrow(next(f for f in files if f.suffix in (".parquet", ".arrow")))
    for f in files:
        if f.suffix not in (".parquet", ".arrow"):  # binary formats, read by pyarrow
            check_text_file(f)
    return files


def _compressed_input(path: Path) -> bool:
    """Whether ``path`` is a compressed text or JSONL file (``a.jsonl.gz``, ``b.txt.zst``)."""
    return path.suffix in COMPRESSED_SUFFIXES and (
        Path(path.stem).suffix in TEXT_SUFFIXES + DATA_SUFFIXES
    )


def _pyarrow(path: Path) -> Any:
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"{path}: reading {path.suffix} files needs pyarrow: {PYARROW_HINT}"
        ) from None
    return pyarrow


def fingerprint(files: list[Path]) -> list[dict[str, Any]]:
    out = []
    for f in files:
        st = f.stat()
        out.append({"path": str(f.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return out


def _text_pieces(path: Path, chunk_chars: int, advance: Callable[[int], None]) -> Iterator[str]:
    """A text file as chunks cut after a newline, decoded as ``load_text`` decodes it (UTF-8,
    invalid bytes replaced, universal newlines), so the pieces join to exactly its text."""
    with open(path, "rb") as raw:
        text = io.TextIOWrapper(raw, encoding="utf-8", errors="replace")
        carry, pos = "", 0
        while chunk := text.read(chunk_chars):
            chunk = carry + chunk
            cut = chunk.rfind("\n") + 1 or len(chunk)  # no newline at all: cut anywhere
            carry = chunk[cut:]
            advance(raw.tell() - pos)
            pos = raw.tell()
            yield chunk[:cut]
        if carry:
            yield carry


def _records(path: Path, advance: Callable[[int], None]) -> Iterator[str]:
    """The ``text`` of each record of a JSONL, Parquet or Arrow file."""
    if path.suffix == ".jsonl":
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                advance(len(line))
                if not line.strip():
                    continue  # a blank line (often the last) is no record
                try:
                    record = json.loads(line)
                except ValueError as exc:
                    raise ConfigError(f"{path}:{lineno}: malformed JSON ({exc})") from None
                text = record.get("text") if isinstance(record, dict) else None
                if not isinstance(text, str):
                    raise ConfigError(
                        f'{path}:{lineno}: no "text" field (a string): each line must be a '
                        'JSON object like {"text": "..."}'
                    )
                yield text
        return
    pa = _pyarrow(path)
    size = max(path.stat().st_size, 1)
    if path.suffix == ".parquet":
        pf = pa.parquet.ParquetFile(path)
        if "text" not in pf.schema_arrow.names:
            raise ConfigError(
                f"{path}: no 'text' column (columns: {', '.join(pf.schema_arrow.names)})"
            )
        rows = max(pf.metadata.num_rows, 1)
        batches: Iterator[Any] = pf.iter_batches(batch_size=1024, columns=["text"])
    else:
        source = pa.memory_map(str(path))
        try:  # datasets.save_to_disk writes the IPC stream format; accept the file format too
            reader = pa.ipc.open_stream(source)
            batches = iter(reader)
        except pa.ArrowInvalid:
            reader = pa.ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        rows = 0
    row = 0
    for batch in batches:
        if "text" not in batch.schema.names:
            raise ConfigError(
                f"{path}: no 'text' column (columns: {', '.join(batch.schema.names)})"
            )
        for text in batch.column(batch.schema.get_field_index("text")).to_pylist():
            row += 1
            if not isinstance(text, str):
                raise ConfigError(f"{path}: row {row} has no text ({text!r} in the 'text' column)")
            yield text
        advance(size * len(batch) // rows if rows else 0)
    if not rows:
        advance(size)


def _documents(
    files: list[Path], chunk_chars: int, advance: Callable[[int], None]
) -> Iterator[Iterator[str]]:
    """Each document as its pieces of text."""
    for f in files:
        if f.suffix in DATA_SUFFIXES:
            for text in _records(f, advance):
                yield iter((text,))
        else:
            yield _text_pieces(f, chunk_chars, advance)


def segment_batches(
    files: list[Path], chunk_chars: int, advance: Callable[[int], None], stats: dict[str, int]
) -> Iterator[list[Segment]]:
    """Batches of about ``chunk_chars`` characters of segments: separators and document text."""
    batch: list[Segment] = []
    size = 0
    for n, pieces in enumerate(_documents(files, chunk_chars, advance)):
        if n:
            batch.append((SEPARATOR, False))
        stats["documents"] += 1
        first = True
        for piece in pieces:
            batch.append((piece, first))
            stats["chars"] += len(piece)
            size, first = size + len(piece), False
            if size >= chunk_chars:
                yield batch
                batch, size = [], 0
        if first:  # an empty document still starts (and has no text)
            batch.append(("", True))
    if batch:
        yield batch


# ----------------------------------------------------------------------------------------------
# tokenizing (in worker processes)

_ENCODE: Callable[[list[str]], list[np.ndarray]] | None = None


def _init_worker(spec: str, fast: bool, dtype: str) -> None:
    """Build this process's encoder: ``spec``'s tokenizer, producing ``dtype`` arrays."""
    global _ENCODE
    if spec == "byte":

        def encode(texts: list[str]) -> list[np.ndarray]:
            # "replace": JSON may carry lone surrogates, which UTF-8 cannot encode
            return [np.frombuffer(t.encode("utf-8", "replace"), np.uint8) for t in texts]

    elif fast:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(spec) / "tokenizer.json"))
        batch = getattr(tok, "encode_batch_fast", tok.encode_batch)

        def encode(texts: list[str]) -> list[np.ndarray]:
            # encode_batch_fast (tokenizers >= 0.20) skips the character offsets we never
            # read: the same ids, 2.3x faster on this machine's 2 cores
            encs = batch(texts, add_special_tokens=False)
            return [np.asarray(e.ids, dtype=dtype) for e in encs]

    else:
        from fullshard.app.data.corpus import HFTokenizer

        slow = HFTokenizer(spec)

        def encode(texts: list[str]) -> list[np.ndarray]:
            return [np.asarray(slow.encode(t), dtype=dtype) for t in texts]

    _ENCODE = encode


def _encode(segments: list[Segment]) -> tuple[np.ndarray, list[int]]:
    """Tokens of a batch of segments, concatenated, and each segment's token count."""
    assert _ENCODE is not None, "worker not initialised"
    arrays = _ENCODE([text for text, _ in segments])
    return np.concatenate(arrays) if arrays else np.zeros(0, np.uint8), [len(a) for a in arrays]


PROBE = (
    "Hello, world! The  quick\tbrown fox -- 1234.5678 jumps.\n\nNew paragraph:\r\n  indented "
    "line, naïve café 日本語 🙂 émoji\n\n\n trailing spaces   \nend"
)


def fast_tokenizer_matches(spec: str) -> bool:
    """Whether ``tokenizers.Tokenizer.from_file(spec/tokenizer.json)`` gives the ids that
    :class:`~fullshard.app.data.corpus.HFTokenizer` gives (without special tokens) on a probe text.
    The fast tokenizer is cheap to load in each worker; when it disagrees (a tokenizer whose
    Python class adds its own processing), workers load the transformers tokenizer instead."""
    path = Path(spec) / "tokenizer.json"
    if not path.is_file():
        return False
    from tokenizers import Tokenizer

    from fullshard.app.data.corpus import HFTokenizer

    fast, slow = Tokenizer.from_file(str(path)), HFTokenizer(spec)
    probes = [PROBE, *PROBE.split("\n"), SEPARATOR, ""]
    return all(fast.encode(t, add_special_tokens=False).ids == slow.encode(t) for t in probes)


def encoded(
    batches: Iterator[list[Segment]], workers: int, init: tuple[str, bool, str]
) -> Iterator[tuple[list[Segment], np.ndarray, list[int]]]:
    """Tokenize batches in ``workers`` processes, yielding results in input order with a bounded
    number in flight (memory stays flat however large the corpus)."""
    if workers <= 1:
        _init_worker(*init)
        for batch in batches:
            yield (batch, *_encode(batch))
        return
    # fork: workers start in milliseconds and need not import torch (spawn re-imports fullshard)
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    ex = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=init)
    pending: deque[Any] = deque()
    try:
        for batch in batches:
            pending.append((batch, ex.submit(_encode, batch)))
            if len(pending) >= 2 * workers:
                done, fut = pending.popleft()
                yield (done, *fut.result())
        while pending:
            done, fut = pending.popleft()
            yield (done, *fut.result())
    finally:
        ex.shutdown(wait=True, cancel_futures=True)
