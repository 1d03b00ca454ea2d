"""Hugging Face ``transformers`` causal LMs: built locally, decoder layers as units, trained.

Skipped as a whole when transformers (the optional ``fullshard[hf]`` extra) is not installed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fullshard.app.models.gpt import build_model, count_params, model_context_length, unit_types_of

transformers = pytest.importorskip("transformers")

from fullshard.app.models.hf import HF_CONFIGS, build_hf_model, find_decoder_layers  # noqa: E402


@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny"])
def test_builtin_tiny_configs_build_with_the_tokenizers_vocab(name: str) -> None:
    model = build_model(f"hf:{name}", 256, seed=0)
    layers = find_decoder_layers(model)
    assert len(layers) == 2
    assert unit_types_of(model) == (type(layers[0]),)
    assert model_context_length(model) == 256
    logits = model(torch.randint(0, 256, (2, 10))).logits
    assert logits.shape == (2, 10, 256)


def test_init_is_seeded() -> None:
    a, b = build_hf_model("llama-tiny", 256, seed=3), build_hf_model("llama-tiny", 256, seed=3)
    c = build_hf_model("llama-tiny", 256, seed=4)
    pa, pb, pc = (torch.cat([p.flatten() for p in m.parameters()]) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)


def test_local_config_and_checkpoint_directories(tmp_path: Path) -> None:
    model_type, kwargs = HF_CONFIGS["gpt2-tiny"]
    config = transformers.AutoConfig.for_model(model_type, vocab_size=300, **kwargs)
    cfg_dir = tmp_path / "cfg"
    config.save_pretrained(cfg_dir)
    # A bare directory with a config.json is recognised without the hf: prefix.
    from_config = build_model(str(cfg_dir), 256)
    assert from_config.config.vocab_size == 256  # config only: the tokenizer's vocabulary
    ckpt_dir = tmp_path / "ckpt"
    saved = transformers.AutoModelForCausalLM.from_config(config)
    saved.save_pretrained(ckpt_dir)
    loaded = build_model(f"hf:{ckpt_dir}", 256)
    assert loaded.config.vocab_size == 300  # weights: their own vocabulary, loaded as saved
    assert count_params(loaded) == count_params(saved)
    for p, q in zip(loaded.parameters(), saved.parameters(), strict=True):
        assert torch.equal(p, q)


def test_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="neither a built-in config"):
        build_hf_model(str(tmp_path / "nothing"), 256)


def _train(runs: Path, name: str, monkeypatch: pytest.MonkeyPatch, *args: str) -> list[dict]:
    """``fullshard train ... --nproc 2`` into ``runs/name``, launched from this process (the
    console entry is the other train tests'); its metrics records."""
    from test_app_cli import main_in_process

    argv = ["train", *args, "--nproc", "2", "--no-progress", "--runs-dir", str(runs)]
    assert main_in_process([*argv, "--name", name], monkeypatch) == 0
    return [json.loads(line) for line in (runs / name / "metrics.jsonl").read_text().splitlines()]


def _save_llama(folder: Path, *, tie: bool, max_shard_size: str = "5GB") -> Path:
    """A tiny llama with random weights, saved as save_pretrained writes it."""
    model_type, kwargs = HF_CONFIGS["llama-tiny"]
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=300, tie_word_embeddings=tie, **kwargs
    )
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():  # norm weights of ones would hide a missed copy
            p.add_(torch.randn_like(p) * 0.01)
    model.save_pretrained(folder, safe_serialization=True, max_shard_size=max_shard_size)
    return folder


def _lazy_vs_full(rank: int, world: int, folder: str) -> dict:
    from fullshard.app.config import ParallelismConfig
    from fullshard.app.models.wrap import shard_model

    lazy = build_model(f"hf:{folder}", 256, lazy_weights=True)
    on_meta = all(p.is_meta for p in lazy.parameters())
    buffers_real = not any(b.is_meta for b in lazy.buffers())
    full = build_model(f"hf:{folder}", 256)
    for m in (lazy, full):
        shard_model(m, ParallelismConfig(), unit_types_of(m))
    x = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        same_logits = torch.equal(lazy(x).logits, full(x).logits)
    return {
        "on_meta": on_meta,
        "buffers_real": buffers_real,
        "unequal": [
            n
            for (n, p), q in zip(lazy.named_parameters(), full.parameters(), strict=True)
            if not torch.equal(p.to_local(), q.to_local())
        ],
        "buffers": all(
            torch.equal(a, b) for a, b in zip(lazy.buffers(), full.buffers(), strict=True)
        ),
        "logits": same_logits,
        "tied": lazy.lm_head.weight is lazy.get_input_embeddings().weight,
    }


def _lazy_vs_full_each(rank: int, world: int, folders: list[str]) -> list[dict]:
    """``_lazy_vs_full`` of each checkpoint folder in turn, on the same ranks."""
    return [_lazy_vs_full(rank, world, folder) for folder in folders]


LAZY_CASES = [(True, "5GB"), (False, "60KB")]  # tied, one file; untied, sharded with an index


@pytest.fixture(scope="module")
def lazy_loads(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[bool, str], tuple]:
    """``(folder, every rank's result)`` per ``LAZY_CASES`` case; one launch of 2 ranks loads
    every folder (each rank imports transformers once)."""
    from harness import run_ranks

    folders = [
        _save_llama(tmp_path_factory.mktemp(f"llama_{shards}"), tie=tie, max_shard_size=shards)
        for tie, shards in LAZY_CASES
    ]
    per_rank = run_ranks(_lazy_vs_full_each, 2, [str(f) for f in folders])
    return {
        case: (folder, [r[i] for r in per_rank])
        for i, (case, folder) in enumerate(zip(LAZY_CASES, folders, strict=True))
    }


@pytest.mark.parametrize("tie,shards", LAZY_CASES)
def test_lazy_safetensors_build_loads_each_ranks_rows(
    lazy_loads: dict[tuple[bool, str], tuple], tie: bool, shards: str
) -> None:
    folder, results = lazy_loads[(tie, shards)]
    assert (folder / "model.safetensors.index.json").is_file() == (shards == "60KB")
    assert len(results) == 2
    for r in results:
        assert r["on_meta"] and r["buffers_real"], r
        assert r["unequal"] == [] and r["buffers"] and r["logits"], r
        assert r["tied"] == tie


@pytest.mark.e2e  # launches `fullshard train` through torchrun
def test_train_cli_with_a_tiny_llama_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--model hf:DIR`` with safetensors weights: built on meta, each rank loads its own rows
    (the same weights as the full load: test_lazy_safetensors_build_loads_each_ranks_rows),
    then trains, evaluates and samples."""
    folder = _save_llama(tmp_path / "llama", tie=True)
    recs = _train(
        tmp_path / "runs",
        "hf",
        monkeypatch,
        "--model",
        f"hf:{folder}",
        *["--max-steps", "6", "--seq-len", "32", "--batch-size", "8"],
        *["--log-every", "2", "--eval-every", "6", "--eval-batches", "1"],
        *["--sample-tokens", "8"],
    )
    assert [r["step"] for r in recs] == [1, 2, 4, 6]
    assert recs[-1]["loss"] < recs[0]["loss"]
    assert "val_loss" in recs[-1]


def test_train_refuses_a_checkpoint_that_does_not_fit_before_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import load_file, save_file

    from fullshard.app.cli import main

    folder = _save_llama(tmp_path / "ckpt", tie=True)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, folder / "model.safetensors")
    argv = ["train", "--model", f"hf:{folder}", "--nproc", "2", "--max-steps", "1"]
    assert main([*argv, "--runs-dir", str(tmp_path / "runs")]) == 2  # in this process
    err = capsys.readouterr().err
    assert "model.norm.weight" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()  # nothing launched
