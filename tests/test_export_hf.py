"""A sharded Hugging Face model exports to safetensors and loads back with ``from_pretrained``."""

from __future__ import annotations

import os

import pytest
import torch
from harness import run_ranks

pytest.importorskip("transformers")


def _export(rank: int, world: int, out: str) -> dict:
    from fullshard import parallelize
    from fullshard.app.models.hf import build_hf_model
    from fullshard.checkpoint import export_safetensors, full_state_dict

    model = build_hf_model("llama-tiny", 256, seed=0)
    parallelize(model, strategy="full_shard", unit_types=model.unit_types)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = torch.randint(256, (2, 9), generator=torch.Generator().manual_seed(rank))
    model(input_ids=idx, labels=idx).loss.backward()
    opt.step()  # trained weights, not the init: the export must carry them
    path = export_safetensors(model, out)
    full = full_state_dict(model)
    probe = torch.arange(12).reshape(1, 12) % 256
    with torch.no_grad():
        logits = model(input_ids=probe).logits
    same = None
    if rank == 0:  # the model loaded back, in the same process: the same kernels and threads
        import transformers

        loaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
        with torch.no_grad():
            same = torch.equal(loaded(input_ids=probe).logits, logits)
    return {"path": path, "full": full if rank == 0 else {}, "same_logits": same}


def test_sharded_hf_model_exports_and_loads_with_from_pretrained(tmp_path: str) -> None:
    import transformers

    out = str(tmp_path)
    res = run_ranks(_export, 2, out)
    assert res[0]["path"] == os.path.join(out, "model.safetensors")
    assert os.path.isfile(os.path.join(out, "config.json"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    sd = loaded.state_dict()
    for name, value in res[0]["full"].items():
        assert torch.equal(sd[name], value), name
    # and computes what the trained sharded model computed, to the bit: the same weights
    # through the same kernels, on the same thread count (in rank 0's process; one computed
    # here, on this process's threads, might block a matrix product differently)
    assert res[0]["same_logits"] is True
