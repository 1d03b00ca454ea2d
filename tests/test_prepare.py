"""``fullshard prepare`` and training from its token shards.

The contract: for the byte tokenizer, a prepared folder holds exactly the train and validation
streams that the in-memory path (``split_for_rank(encode_corpus(load_text(path)))``) trains on,
so training from either gives the same losses; bad input is one error line, status 2, and no
output; shards are verified without reading the corpus at every start-up.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import fullshard.app.data.corpus_stream as corpus_stream
import fullshard.app.launch.local as launch_module
from fullshard.app.cli import main
from fullshard.app.data.corpus import (
    ByteTokenizer,
    HFTokenizer,
    RankBatches,
    encode_corpus,
    eval_batches,
    load_text,
    split_for_rank,
)
from fullshard.app.data.prepare import PrepareOptions, prepare
from fullshard.app.data.token_shards import INDEX, TokenShards
from fullshard.app.errors import ConfigError
from fullshard.checkpoint.store import file_sha256

WORDS = ["the", "quick", "brown", "fox", "naïve", "café", "日本", "jumps", "over", "a", "lazy"]


def _text(seed: int, n_words: int) -> str:
    r = random.Random(seed)
    return " ".join(r.choice(WORDS) + ("\n" if r.random() < 0.1 else "") for _ in range(n_words))


def _stream(ts: TokenShards, split: str) -> torch.Tensor:
    s = ts.streams[split]
    return s.gather(torch.tensor([0]), len(s))[0] if len(s) else torch.zeros(0, dtype=torch.long)


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """A folder of text files: CRLF and lone CR newlines, invalid UTF-8 (one sequence cut by a
    newline), an empty file, a non-text file that is skipped."""
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text(_text(0, 9000), encoding="utf-8")
    (root / "sub" / "b.md").write_bytes(_text(1, 6000).replace("\n", "\r\n").encode())
    (root / "c.rst").write_bytes(b"x\ry\r\nbad \xe2\x82\nbytes \xff\xfe end\r" * 300)
    (root / "d.text").write_text("")
    (root / "skip.bin").write_bytes(b"\0\1\2")
    return root


def _prepare(inputs: list[Path], out: Path, **kw: object) -> TokenShards:
    opts = PrepareOptions([str(p) for p in inputs], str(out), progress=False, **kw)  # type: ignore[arg-type]
    prepare(opts)
    return TokenShards(out, 256 if opts.tokenizer == "byte" else 10**9)


def test_byte_prepare_equals_the_in_memory_split(corpus: Path, tmp_path: Path) -> None:
    # small chunks and shards: documents span many chunks, windows span shard files
    ts = _prepare([corpus], tmp_path / "out", chunk_chars=1000, shard_tokens=7000, workers=1)
    tokens = encode_corpus(load_text(str(corpus)), ByteTokenizer())
    assert len(ts) == len(tokens) and len(ts.streams["train"].shards) > 5
    for world in (1, 2, 3):
        for rank in range(world):
            train, val = split_for_rank(tokens, rank, world, 0.05)
            ptrain, pval = split_for_rank(ts, rank, world, 0.05)
            assert len(ptrain) == len(train) and len(pval) == len(val) > 0
            assert torch.equal(ptrain.gather(torch.tensor([0]), len(train))[0], train.long())
            assert torch.equal(pval.gather(torch.tensor([0]), len(val))[0], val.long())
    # the output does not depend on the number of workers
    again = _prepare([corpus], tmp_path / "out2", chunk_chars=1000, shard_tokens=7000, workers=2)
    for split in ("train", "val"):
        assert torch.equal(_stream(ts, split), _stream(again, split))
    index = json.loads((tmp_path / "out" / INDEX).read_text())
    assert index["documents"] == 4 and index["dtype"] == "uint8"
    # document starts: one per file (sorted: a, c, d, sub/b), at the file's first byte
    starts = np.fromfile(tmp_path / "out" / "train.docs.bin", dtype="<u8")
    train = _stream(ts, "train")
    assert len(starts) == 4 and starts[0] == 0
    assert bytes(train[int(starts[1]) : int(starts[1]) + 4].tolist()) == b"x\ny\n"  # c.rst
    assert starts[2] == starts[3] - 2  # d.text is empty: b.md starts after one more "\n\n"


def test_sampler_and_eval_batches_read_shards_as_the_tensor(corpus: Path, tmp_path: Path) -> None:
    ts = _prepare([corpus], tmp_path / "out", shard_tokens=3000, workers=1)
    tokens = encode_corpus(load_text(str(corpus)), ByteTokenizer())
    train, val = split_for_rank(tokens, 1, 2, 0.05)
    ptrain, pval = split_for_rank(ts, 1, 2, 0.05)
    a = RankBatches(train, 64, 8, seed=3, rank=1)
    b = RankBatches(ptrain, 64, 8, seed=3, rank=1)
    for _ in range(2 * a.windows_per_epoch() // 8):  # across an epoch boundary
        xa, ya = a.next_batch()
        xb, yb = b.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb) and xb.dtype == torch.int64
    c = RankBatches(ptrain, 64, 8, seed=3, rank=1)
    c.load_state_dict(b.state_dict())
    assert torch.equal(c.next_batch()[0], a.next_batch()[0])  # resumes bit for bit
    for (x1, y1), (x2, y2) in zip(
        eval_batches(val, 64, 4, 9), eval_batches(pval, 64, 4, 9), strict=True
    ):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


def _records(tmp_path: Path) -> tuple[list[str], Path]:
    docs = [_text(i, 700) for i in range(12)] + ["", "last"]
    folder = tmp_path / "as_text"
    folder.mkdir()
    for i, d in enumerate(docs):
        (folder / f"{i:03d}.txt").write_text(d, encoding="utf-8")
    return docs, folder


def test_jsonl_parquet_and_arrow_are_documents_like_files(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.ipc
    import pyarrow.parquet

    docs, folder = _records(tmp_path)
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text(
        "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)) + "\n"
    )
    table = pa.table({"text": docs})
    pyarrow.parquet.write_table(table, tmp_path / "d.parquet", row_group_size=5)
    ds = tmp_path / "dataset"  # as datasets.save_to_disk lays it out: IPC stream files
    ds.mkdir()
    with pyarrow.ipc.new_stream(ds / "data-00000-of-00001.arrow", table.schema) as w:
        for batch in table.to_batches(max_chunksize=4):
            w.write_batch(batch)
    (ds / "state.json").write_text("{}")
    want = _prepare([folder], tmp_path / "o_text", workers=1)
    for i, src in enumerate([jsonl, tmp_path / "d.parquet", ds]):
        got = _prepare([src], tmp_path / f"o{i}", workers=1)
        for split in ("train", "val"):
            assert torch.equal(_stream(got, split), _stream(want, split)), src
        assert json.loads((tmp_path / f"o{i}" / INDEX).read_text())["documents"] == len(docs)


@pytest.fixture
def bpe_dir(tmp_path: Path) -> Path:
    """A small BPE tokenizer, as a Hugging Face tokenizer directory."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["[UNK]", "<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # 256 byte symbols: ids > 255
    )
    tok.train_from_iterator([_text(i, 500) for i in range(20)], trainer)
    path = tmp_path / "bpe"
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|end|>"})
    )
    return path


def test_hf_tokenizer_workers_give_the_transformers_ids(
    bpe_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenizers import Tokenizer

    hf = HFTokenizer(str(bpe_dir))
    fast = Tokenizer.from_file(str(bpe_dir / "tokenizer.json"))
    for text in [_text(7, 300), "  a\n\nb <|end|> \r\n", "naïve 日本"]:
        assert fast.encode(text, add_special_tokens=False).ids == hf.encode(text)
    assert corpus_stream.fast_tokenizer_matches(str(bpe_dir))
    docs, folder = _records(tmp_path)
    # small batches: many go through the pool, and come back in order
    ts = _prepare([folder], tmp_path / "fast", tokenizer=str(bpe_dir), workers=2, chunk_chars=3000)
    index = json.loads((tmp_path / "fast" / INDEX).read_text())
    assert index["dtype"] == "uint16" and index["tokenizer"]["vocab_size"] == hf.vocab_size
    # each document and separator is encoded on its own: the stream is their concatenation
    ids: list[int] = []
    for i, d in enumerate(docs):
        ids += (hf.encode("\n\n") if i else []) + hf.encode(d)
    train = torch.tensor(ids)
    assert torch.equal(_stream(ts, "train"), split_for_rank(train, 0, 1, 0.05)[0])
    # workers with the transformers tokenizer (the fallback) write the same shards
    monkeypatch.setattr(corpus_stream, "fast_tokenizer_matches", lambda spec: False)
    import fullshard.app.data.prepare as prepare_module

    monkeypatch.setattr(prepare_module, "fast_tokenizer_matches", lambda spec: False)
    slow = _prepare(
        [folder], tmp_path / "slow", tokenizer=str(bpe_dir), workers=1, chunk_chars=3000
    )
    assert torch.equal(_stream(slow, "train"), _stream(ts, "train"))


def test_prepared_with_a_tokenizer_dir_refuses_the_byte_tokenizer(
    bpe_dir: Path, tmp_path: Path, no_launch: None, capsys: pytest.CaptureFixture[str]
) -> None:
    _, folder = _records(tmp_path)
    _prepare([folder], tmp_path / "out", tokenizer=str(bpe_dir), workers=1)
    message = "was prepared with a Hugging Face tokenizer (sha256 "
    _error(_train_argv(tmp_path / "out"), capsys, message)
    other = tmp_path / "other"  # same files but one: another tokenizer
    other.mkdir()
    for f in bpe_dir.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    (other / "special_tokens_map.json").write_text("{}")
    _error(_train_argv(tmp_path / "out", "--tokenizer", str(other)), capsys, message)


def test_rerun_is_a_no_op_and_a_change_rebuilds(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    _prepare([corpus], out, shard_tokens=5000)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    _prepare([corpus], out, shard_tokens=5000)
    assert "up to date" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    (corpus / "a.txt").write_text("changed " * 3000)  # fewer tokens: fewer shards
    ts = _prepare([corpus], out, shard_tokens=5000)
    assert "up to date" not in capsys.readouterr().out
    assert len(ts) == len(load_text(str(corpus)).encode())
    names = {p.name for p in out.iterdir()}
    index = json.loads((out / INDEX).read_text())
    listed = {s["file"] for sp in index["splits"].values() for s in sp["shards"]}
    assert names == listed | {INDEX, "train.docs.bin", "val.docs.bin"}  # no stale shard left


def test_interrupted_prepare_leaves_no_index_and_no_staging(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fullshard.app.data.prepare as prepare_module

    out = tmp_path / "out"
    _prepare([corpus], out)
    calls = {"n": 0}
    real = prepare_module._SplitWriter.write

    def dies(self: object, tokens: np.ndarray) -> None:
        calls["n"] += 1
        if calls["n"] > 3:
            raise KeyboardInterrupt
        real(self, tokens)  # type: ignore[arg-type]

    monkeypatch.setattr(prepare_module._SplitWriter, "write", dies)
    (corpus / "a.txt").write_text(_text(5, 9000))
    with pytest.raises(KeyboardInterrupt):
        _prepare([corpus], out, chunk_chars=500, workers=1)
    # the old, complete corpus is untouched until the new one commits
    assert (out / INDEX).is_file() and not list(out.glob(".prepare-*"))
    fresh = tmp_path / "fresh"
    calls["n"] = 0
    with pytest.raises(KeyboardInterrupt):
        _prepare([corpus], fresh, chunk_chars=500, workers=1)
    assert not fresh.exists()  # nothing left behind


# ----------------------------------------------------------------------------------------------
# bad input: one line, status 2, nothing launched, no output


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)

    def fail(*args: object, **kwargs: object) -> int:
        raise AssertionError("ranks were launched for bad input")

    monkeypatch.setattr(launch_module, "launch_local", fail)


def _error(argv: list[str], capsys: pytest.CaptureFixture[str], message: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert err[0].startswith(f"fullshard {argv[0]}: error: ") and message in err[0], err[0]


def test_prepare_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empties").mkdir()
    (tmp_path / "empties" / "a.txt").write_text("")
    (tmp_path / "empties" / "b.jsonl").write_text('{"text": ""}\n\n{"text": ""}\n')
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": "x"\n')
    (tmp_path / "notext.jsonl").write_text('{"text": "ok"}\n\n{"body": "x"}\n')
    out = tmp_path / "out"
    cases = [
        (["empties"], "no text to prepare (3 document(s), all empty)"),
        (["bad.jsonl"], "bad.jsonl:2: malformed JSON"),
        (["notext.jsonl"], 'notext.jsonl:3: no "text" field'),
        (["missing"], "missing does not exist"),
    ]
    os.chdir(tmp_path)
    for inputs, message in cases:
        _error(["prepare", *inputs, "--out", str(out), "--no-progress"], capsys, message)
        assert not out.exists()  # no partial output
    _error(["prepare", "--verify", "empties"], capsys, "not a prepared folder")


def test_missing_pyarrow_gives_the_install_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow raises ImportError
    argv = ["prepare", str(tmp_path / "d.parquet"), "--out", str(tmp_path / "o")]
    _error(argv, capsys, "pip install 'fullshard[data]'")


def _snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` and its bytes: what a refused command must leave as it was."""
    return {str(f.relative_to(root)): f.read_bytes() for f in root.rglob("*") if f.is_file()}


def test_prepare_refuses_a_folder_holding_someone_elses_index(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine\n")
    for index in ('{"pages": [1, 2, 3]}\n', "[1, 2]\n", "not json at all"):  # a user's files
        (theirs / INDEX).write_text(index)
        before = _snapshot(theirs)
        argv = ["prepare", str(corpus), "--out", str(theirs), "--no-progress"]
        _error(argv, capsys, f"{theirs / INDEX} exists and was not written by fullshard prepare")
        assert _snapshot(theirs) == before  # nothing deleted, nothing added
    # an earlier prepare's folder is rebuilt as before
    _prepare([corpus], tmp_path / "ours")
    (corpus / "a.txt").write_text(_text(7, 100))
    assert main(["prepare", str(corpus), "--out", str(tmp_path / "ours"), "--no-progress"]) == 0


def test_prepare_bad_out_and_tokenizer_folders(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    afile = tmp_path / "afile.txt"
    afile.write_text("keep me\n")
    empty_tok = tmp_path / "tok"
    empty_tok.mkdir()
    broken_tok = tmp_path / "broken"
    broken_tok.mkdir()
    (broken_tok / "tokenizer.json").write_text("{not json")
    out = tmp_path / "out"
    cases = [
        (["--out", f"{afile}/sub"], f"--out {afile}/sub cannot be created: {afile} is a file"),
        (["--out", str(afile)], f"--out {afile} is a file: give a folder"),
        (["--out", str(out), "--tokenizer", str(empty_tok)], "it has no tokenizer.json"),
        (["--out", str(out), "--tokenizer", str(broken_tok)], "its tokenizer does not load"),
    ]
    if Path("/proc/self").is_dir():  # a file system nobody creates folders in, even root
        cases.append((["--out", "/proc/fullshard-x"], "--out /proc/fullshard-x: cannot write"))
    for flags, message in cases:
        if "--tokenizer" in flags:
            pytest.importorskip("transformers")
        _error(["prepare", str(corpus), *flags, "--no-progress"], capsys, message)
        assert afile.read_text() == "keep me\n" and not out.exists()
        assert [p.name for p in empty_tok.iterdir()] == []


def test_prepare_refuses_compressed_and_binary_inputs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import bz2
    import gzip

    jsonl = b'{"text": "hello world"}\n' * 50
    files = {
        "d.jsonl.gz": (gzip.compress(jsonl), "d.jsonl.gz is gzip-compressed, not text"),
        "d.jsonl": (gzip.compress(jsonl), "d.jsonl is gzip-compressed"),  # whatever its name
        "t.txt": (bz2.compress(jsonl), "t.txt is bzip2-compressed"),
        "utf16.txt": ("hello world\n".encode("utf-16") * 20, "utf16.txt is not UTF-8 text"),
        "random.md": (random.Random(0).randbytes(5000), "random.md is not UTF-8 text"),
    }
    out = tmp_path / "out"
    os.chdir(tmp_path)
    for name, (data, message) in files.items():
        (tmp_path / name).write_bytes(data)
        _error(["prepare", name, "--out", str(out), "--no-progress"], capsys, message)
        assert not out.exists()
    # in a folder, a compressed corpus file is skipped with a warning naming it
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.txt").write_text(_text(0, 50))
    os.replace(tmp_path / "d.jsonl.gz", tmp_path / "mixed" / "d.jsonl.gz")
    assert main(["prepare", "mixed", "--out", str(out), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "skipping 1 compressed file(s) (e.g. mixed/d.jsonl.gz)" in err


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A committed one-rank checkpoint (a DCP save and its manifest, as the store writes them),
    written in this process: no ranks are launched."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from fullshard.checkpoint.store import write_manifest

    folder = tmp_path_factory.mktemp("ckpt") / "step_00000001"
    with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process, meant
        warnings.simplefilter("ignore")
        dcp.save(
            {"model": {"w": torch.arange(6.0).reshape(2, 3)}}, checkpoint_id=folder, no_dist=True
        )
    write_manifest(str(folder))
    return folder


def test_convert_bad_output_paths(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import load_file

    afile = tmp_path / "afile.txt"
    afile.write_text("keep me\n")
    named = tmp_path / "notes.safetensors"  # a user's file that merely has the name
    named.write_text("not weights\n")
    ck = str(checkpoint)
    cases = [
        ([f"{afile}/out.safetensors"], f"{afile} is a file, not a folder"),
        ([str(afile)], f"{afile} is a file, not a folder"),  # a folder for model.safetensors
        ([str(named)], f"{named} exists and is not a safetensors file"),
    ]
    if Path("/proc/self").is_dir():
        cases.append((["/proc/x.safetensors"], "cannot create a file in /proc"))
    for out, message in cases:
        _error(["convert", ck, *out], capsys, message)
        assert afile.read_text() == "keep me\n" and named.read_text() == "not weights\n"
    # a good path works, and an earlier convert's output is replaced
    good = tmp_path / "w.safetensors"
    for _ in range(2):
        assert main(["convert", ck, str(good)]) == 0
        assert torch.equal(load_file(good)["w"], torch.arange(6.0).reshape(2, 3))


def _train_argv(data: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--data",
        str(data),
        *["--model", "tiny", "--seq-len", "32", "--batch-size", "4"],
        *extra,
    ]


def test_train_rejects_bad_prepared_folders(
    corpus: Path, tmp_path: Path, no_launch: None, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    _prepare([corpus], out, shard_tokens=20_000)
    shard = out / "train-00001.bin"
    # a tokenizer mismatch, both ways
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    _error(
        _train_argv(out, "--tokenizer", str(tok)),
        capsys,
        "was prepared with the byte tokenizer, but --tokenizer",
    )
    _error(
        _train_argv(out, "--val-fraction", "0.1"),
        capsys,
        "--val-fraction 0.05 when it was prepared",
    )
    _error(_train_argv(out, "--batch-size", "4096"), capsys, "too few for one training batch")
    # corrupted in place: a changed mtime makes start-up re-hash it
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    _error(_train_argv(out), capsys, f"{shard}: checksum mismatch")
    # the same corruption with the recorded mtime restored passes start-up; --verify finds it
    index = json.loads((out / INDEX).read_text())
    rec = index["splits"]["train"]["shards"][1]
    os.utime(shard, ns=(rec["mtime_ns"], rec["mtime_ns"]))
    assert main(["prepare", "--verify", str(out)]) == 2
    assert f"{shard}: checksum mismatch" in capsys.readouterr().err
    shard.write_bytes(shard.read_bytes()[:-1])
    _error(_train_argv(out), capsys, f"{shard}: 19,999 bytes, the index records 20,000")
    shard.unlink()
    _error(_train_argv(out), capsys, f"{shard}: missing shard")


def _hand_written(folder: Path, ids: np.ndarray, max_id: int) -> Path:
    """A one-shard prepared folder written by hand (uint16 ids with the byte tokenizer)."""
    folder.mkdir()
    (folder / "train-00000.bin").write_bytes(ids.astype("<u2").tobytes())
    for name in ("val-00000.bin", "train.docs.bin", "val.docs.bin"):
        (folder / name).write_bytes(b"")

    def rec(name: str, **kw: int) -> dict:
        p = folder / name
        return {
            "file": name,
            "bytes": p.stat().st_size,
            "sha256": file_sha256(p),
            "mtime_ns": p.stat().st_mtime_ns,
            **kw,
        }

    index = {
        "format": "fullshard-tokens",
        "version": 1,
        "dtype": "uint16",
        "tokenizer": {"kind": "byte", "vocab_size": 256},
        "val_fraction": 0.05,
        "val_block": 4096,
        "documents": 1,
        "tokens": len(ids),
        "splits": {
            "train": {
                "tokens": len(ids),
                "shards": [rec("train-00000.bin", tokens=len(ids), max_token_id=max_id)],
                "doc_starts": rec("train.docs.bin", documents=0),
            },
            "val": {"tokens": 0, "shards": [], "doc_starts": rec("val.docs.bin", documents=0)},
        },
    }
    (folder / INDEX).write_text(json.dumps(index))
    return folder / "train-00000.bin"


def test_token_ids_beyond_the_vocabulary_are_refused(
    tmp_path: Path, no_launch: None, capsys: pytest.CaptureFixture[str]
) -> None:
    ids = np.arange(20_000) % 256
    ids[12_345] = 300
    shard = _hand_written(tmp_path / "honest", ids, max_id=300)
    _error(_train_argv(tmp_path / "honest"), capsys, f"{shard}: token id 300 is outside")
    # an index that lies about it: the host-side check of each batch stops it
    shard = _hand_written(tmp_path / "lying", ids, max_id=255)
    train, _ = TokenShards(tmp_path / "lying", 256).rank_split(0, 1)
    sampler = RankBatches(train, 63, 4, seed=0, rank=0)
    with pytest.raises(ConfigError, match=f"{shard}: token id 300 is outside"):
        for _ in range(sampler.windows_per_epoch()):
            sampler.next_batch()


# ----------------------------------------------------------------------------------------------
# end to end: training from the prepared folder equals training from the text


@pytest.mark.e2e
def test_training_from_shards_equals_training_from_text(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # prepare, and the two launches of 2 ranks, from this process: what is compared is the
    # files they write (the console entry is test_app_bad_inputs.py's and test_app_cli.py's)
    from test_app_cli import main_in_process

    text = tmp_path / "corpus.txt"
    text.write_text(_text(11, 30_000), encoding="utf-8")
    prepared = tmp_path / "prepared"
    argv = ["prepare", str(text), "--out", str(prepared), "--shard-tokens", "10000"]
    assert main([*argv, "--workers", "2", "--no-progress"]) == 0
    runs = {}
    for name, data in (("text", text), ("shards", prepared)):
        argv = [
            "train",
            "--data",
            str(data),
            *["--model", "tiny", "--nproc", "2", "--max-steps", "6"],
            *["--log-every", "1", "--eval-every", "3", "--batch-size", "8"],
            *["--seq-len", "64", "--sample-tokens", "0", "--no-progress"],
            "--runs-dir",
            str(tmp_path / "runs"),
        ]
        assert main_in_process([*argv, "--name", name], monkeypatch) == 0
        lines = (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()
        runs[name] = [
            {k: r.get(k) for k in ("step", "loss", "grad_norm", "val_loss")}
            for r in map(json.loads, lines)
        ]
        runs[name + "_summary"] = json.loads(
            (tmp_path / "runs" / name / "summary.json").read_text()
        )
    assert len(runs["text"]) == 6 and runs["text"][2]["val_loss"] is not None
    assert runs["text"] == runs["shards"]
    for key in ("start_loss", "end_loss", "final_val_loss", "data_state"):
        assert runs["text_summary"][key] == runs["shards_summary"][key]
