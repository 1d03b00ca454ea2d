"""Hugging Face ``transformers`` causal LMs: built locally, decoder layers as units, trained.

Skipped as a whole when transformers (the optional ``fullshard[hf]`` extra) is not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fullshard.app.models import build_model, count_params, model_context_length, unit_types_of

transformers = pytest.importorskip("transformers")

from fullshard.app.hf import HF_CONFIGS, build_hf_model, find_decoder_layers  # noqa: E402


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


@pytest.mark.e2e  # launches `fullshard train` through torchrun
def test_train_cli_with_a_tiny_llama(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    args = [
        "--model", "hf:llama-tiny", "--nproc", "2", "--max-steps", "6", "--seq-len", "32",
        "--batch-size", "8", "--log-every", "2", "--eval-every", "6", "--eval-batches", "1",
        "--sample-tokens", "8", "--no-progress", "--runs-dir", str(tmp_path), "--name", "hf",
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "fullshard.app.cli", "train", *args],
        capture_output=True, text=True, timeout=240, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    recs = [
        json.loads(line) for line in (tmp_path / "hf" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in recs] == [1, 2, 4, 6]
    assert recs[-1]["loss"] < recs[0]["loss"]
    assert "val_loss" in recs[-1]
