"""Corpus loading, the rank-disjoint train/validation split, and the resumable sampler."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fullshard.app.data.corpus import (
    ByteTokenizer,
    RankBatches,
    build_tokenizer,
    check_text_file,
    default_corpus,
    encode_corpus,
    eval_batches,
    load_text,
    split_for_rank,
)
from fullshard.app.errors import ConfigError


def test_default_corpus_is_pythons_documentation() -> None:
    text = default_corpus()
    assert len(text) > 400_000
    assert 'The "if" statement' in text
    assert text == default_corpus()  # deterministic order


def test_byte_tokenizer_round_trips() -> None:
    tok = build_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256
    text = "naïve café — 日本"
    assert tok.decode(tok.encode(text)) == text
    assert encode_corpus(text, tok).dtype == torch.uint8


def test_load_text_file_folder_and_missing(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a.md").write_text("first")
    (tmp_path / "skip.bin").write_text("not text")
    assert load_text(str(tmp_path)) == "first\n\nsecond"
    assert load_text(str(tmp_path / "b.txt")) == "second"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_text(str(tmp_path / "nope"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no text files"):
        load_text(str(empty))


def test_compressed_or_binary_text_is_refused_naming_the_file(tmp_path: Path) -> None:
    import gzip
    import lzma

    text = "the quick brown fox, naïve café\n" * 200
    (tmp_path / "c.txt.gz").write_bytes(gzip.compress(text.encode()))
    (tmp_path / "x.txt").write_bytes(lzma.compress(text.encode()))
    (tmp_path / "bin.txt").write_bytes(bytes(range(256)) * 40)
    for name, message in [
        ("c.txt.gz", "c.txt.gz is gzip-compressed, not text: decompress it first"),
        ("x.txt", "x.txt is xz-compressed"),
        ("bin.txt", "bin.txt is not UTF-8 text"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_text(str(tmp_path / name))
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "a.txt").write_text(text)
    (folder / "b.md").write_bytes((tmp_path / "x.txt").read_bytes())
    with pytest.raises(ConfigError, match="b.md is xz-compressed"):
        load_text(str(folder))
    # text with some invalid UTF-8 (12% replaced), Latin-1 prose and control-free bytes is text
    (tmp_path / "mixed.txt").write_bytes(b"bad \xe2\x82\nbytes \xff\xfe end\r" * 300)
    (tmp_path / "latin1.txt").write_bytes("café naïve über straße\n".encode("latin-1") * 100)
    for name in ("mixed.txt", "latin1.txt"):
        check_text_file(tmp_path / name)
        assert "\ufffd" in load_text(str(tmp_path / name))


def test_a_tokenizer_folder_without_a_tokenizer_says_so(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    with pytest.raises(ConfigError, match="has no tokenizer.json") as info:
        build_tokenizer(str(tmp_path))
    assert "\n" not in str(info.value)  # one line, not transformers' several


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_split_is_disjoint_across_ranks_and_splits(world: int) -> None:
    # Token values = positions, so a set of values is a set of positions in the stream.
    tokens = torch.arange(200_000)
    seen: set[int] = set()
    val_all: set[int] = set()
    lengths = set()
    for rank in range(world):
        train, val = split_for_rank(tokens, rank, world, 0.05)
        lengths.add((len(train), len(val)))
        tr, va = set(train.tolist()), set(val.tolist())
        assert not tr & seen and not va & seen and not tr & va
        seen |= tr | va
        val_all |= va
    assert len(lengths) == 1  # every rank the same size: same number of batches everywhere
    assert 0.04 < len(val_all) / len(tokens) < 0.06
    # The held-out blocks are spread through the stream, not only at its end.
    assert min(val_all) < len(tokens) // 2
    assert len(tokens) - len(seen) < world * 2  # only the division remainder is dropped


def test_ranks_draw_disjoint_windows_and_val_is_never_trained_on() -> None:
    tokens = torch.arange(100_000)
    world, seq, batch = 2, 32, 4
    drawn: list[set[int]] = []
    val_positions: set[int] = set()
    for rank in range(world):
        train, val = split_for_rank(tokens, rank, world, 0.1)
        val_positions |= set(val.tolist())
        sampler = RankBatches(train, seq, batch, seed=5, rank=rank)
        positions: set[int] = set()
        for _ in range(3 * sampler.windows_per_epoch() // batch):  # crosses epoch boundaries
            x, y = sampler.next_batch()
            assert x.shape == y.shape == (batch, seq)
            assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
            positions |= set(x.flatten().tolist()) | set(y.flatten().tolist())
        assert sampler.epoch >= 2
        drawn.append(positions)
    assert not drawn[0] & drawn[1]
    assert not (drawn[0] | drawn[1]) & val_positions


def test_sampler_is_seeded_and_resumes_from_its_state() -> None:
    tokens = torch.arange(20_000)
    a = RankBatches(tokens, 16, 8, seed=1, rank=0)
    b = RankBatches(tokens, 16, 8, seed=1, rank=0)
    other = RankBatches(tokens, 16, 8, seed=2, rank=0)
    first = [a.next_batch()[0] for _ in range(5)]
    assert all(torch.equal(x, b.next_batch()[0]) for x in first)
    assert not torch.equal(first[0], other.next_batch()[0])
    # Save mid-run (past an epoch boundary), then continue in a fresh sampler.
    for _ in range(a.windows_per_epoch() // 8):
        a.next_batch()
    state = a.state_dict()
    assert state["epoch"] == 1 and state["batches_drawn"] == 5 + a.windows_per_epoch() // 8
    c = RankBatches(tokens, 16, 8, seed=1, rank=0)
    c.load_state_dict(state)
    for _ in range(4):
        assert torch.equal(a.next_batch()[0], c.next_batch()[0])
    with pytest.raises(ValueError, match="seed"):
        other.load_state_dict(state)


def test_too_little_text_for_a_batch_says_what_to_do() -> None:
    with pytest.raises(ValueError, match="fewer than one batch"):
        RankBatches(torch.arange(100), 32, 8, seed=0, rank=1)


def test_eval_batches_are_fixed_and_bounded() -> None:
    val = torch.arange(5_000)
    batches = eval_batches(val, 64, 4, max_batches=3)
    assert len(batches) == 3
    x, y = batches[1]
    assert x[0, 0] == 4 * 64 and torch.equal(y, x + 1)
    assert len(eval_batches(val, 64, 4, max_batches=1000)) == (5_000 - 1) // 64 // 4
