"""Sharded safetensors loading: each rank reads its own rows, and the result is the full load.

The toy model (tests/toy.py) has uneven shards, a one-row parameter (fewer rows than ranks) and
an embedding tied to the head; the file stores the tied weight under one of its names only, as
Hugging Face checkpoints do.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from harness import run_ranks
from safetensors.torch import save_file
from torch import nn
from toy import ToyLM, batches, shard_toy

from fullshard import FullshardError
from fullshard.checkpoint import check_safetensors, load_safetensors


class BufferedToy(ToyLM):
    """The toy with a persistent buffer (loaded from the file) and a computed one (never)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.full((3,), 2.0))
        self.register_buffer("cache", torch.arange(4.0), persistent=False)


def _reference(seed: int = 0) -> BufferedToy:
    torch.manual_seed(seed)
    model = BufferedToy()
    with torch.no_grad():
        for p in model.parameters():  # LayerNorm's ones and zeros would hide a missed copy
            p.add_(torch.randn_like(p))
        model.scale.fill_(3.0)
    return model


def _write(
    folder: Path, layout: str, dtype: torch.dtype = torch.float32, alias: str = "head.weight"
) -> Path:
    """Save the reference as ``layout``: 'single' (one file) or 'index' (three shard files and
    an index, as save_pretrained splits a large model). The tied weight is stored once, as
    ``alias``."""
    sd = {k: v.to(dtype).contiguous() for k, v in _reference().state_dict().items()}
    tied = {"embed.weight", "head.weight"} - {alias}
    for k in tied:
        del sd[k]
    if layout == "single":
        save_file(sd, str(folder / "model.safetensors"))
        return folder / "model.safetensors"
    keys = sorted(sd)
    weight_map = {}
    for i in range(3):
        name = f"model-{i + 1:05d}-of-00003.safetensors"
        part = {k: sd[k] for k in keys[i::3]}
        save_file(part, str(folder / name))
        weight_map.update(dict.fromkeys(part, name))
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def _meta_toy() -> BufferedToy:
    with torch.device("meta"):
        return BufferedToy()


def _locals(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
        for k, v in model.state_dict().items()
    }


def _load_vs_full(rank: int, world: int, path: str, kind: str, dtype: torch.dtype) -> dict:
    """Sharded load vs full-load-then-shard on this rank: locals, a forward, the tie."""
    from torch.distributed.device_mesh import init_device_mesh

    kwargs = {}
    if kind == "hybrid":  # 2 replicas x 2 shards: (Replicate(), Shard(0))
        kwargs["mesh"] = init_device_mesh("cpu", (2, world // 2))
    ref = _reference()
    if dtype != torch.float32:  # the file holds rounded values: so does the full load
        with torch.no_grad():
            for t in [*ref.parameters(), *ref.buffers()]:
                t.copy_(t.to(dtype))
    model = _meta_toy()
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for m in (*ref.blocks, ref, *model.blocks, model):
            fully_shard(m)
    else:
        shard_toy(ref, **kwargs)
        shard_toy(model, **kwargs)
    model.to_empty(device="cpu")
    report = load_safetensors(model, path)
    x = batches(1, 1)[0][0]
    with torch.no_grad():
        same_forward = torch.equal(model(x), ref(x))
    mine, theirs = _locals(model), _locals(ref)
    return {
        "unequal": [k for k in theirs if not torch.equal(mine[k], theirs[k])],
        "forward": same_forward,
        "tied": model.head.weight is model.embed.weight,
        "rows": {k: v.shape[0] for k, v in mine.items() if v.dim()},
        "loaded": sorted(report.loaded),
    }


@pytest.mark.parametrize(
    "world,layout,kind,dtype",
    [
        (2, "single", "fullshard", torch.float32),
        (3, "index", "fullshard", torch.float32),
        (2, "index", "fullshard", torch.bfloat16),
        (4, "single", "hybrid", torch.float32),
        (2, "single", "fsdp2", torch.float32),
    ],
)
def test_sharded_load_equals_full_load_then_shard(
    tmp_path: Path, world: int, layout: str, kind: str, dtype: torch.dtype
) -> None:
    path = _write(tmp_path, layout, dtype)
    results = run_ranks(_load_vs_full, world, str(path), kind, dtype)
    for r in results:
        assert r["unequal"] == [] and r["forward"] and r["tied"], r
    rows = [r["rows"] for r in results]
    if kind != "hybrid":  # uneven shards, and ranks without a row of the one-row gate
        assert sum(r["embed.weight"] for r in rows) == 37
        assert sorted(r["blocks.0.gate"] for r in rows)[0] == 0
    assert "scale" in results[0]["loaded"] and "cache" not in results[0]["loaded"]


def test_tied_weight_stored_under_either_name(tmp_path: Path) -> None:
    for alias in ("embed.weight", "head.weight"):
        folder = tmp_path / alias
        folder.mkdir()
        path = _write(folder, "single", alias=alias)
        model = _reference(seed=1)  # unsharded: plain parameters load whole
        load_safetensors(model, path)
        assert torch.equal(model.embed.weight, _reference().embed.weight)
        assert model.head.weight is model.embed.weight


def _error_of(load: object, model: nn.Module, path: str) -> str:
    """The message ``load(model, path)`` raised ('' if none): ranks return it to the test."""
    try:
        load(model, path)  # type: ignore[operator]
    except FullshardError as exc:
        return str(exc)
    return ""


def _raises_everywhere(rank: int, world: int, path: str) -> str:
    model = _meta_toy()
    shard_toy(model)
    model.to_empty(device="cpu")
    return _error_of(load_safetensors, model, path)


def test_missing_parameter_raises_on_every_rank(tmp_path: Path) -> None:
    sd = _reference().state_dict()
    for k in ("blocks.1.fc1.weight", "norm.bias", "embed.weight", "head.weight"):
        del sd[k]
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "model.safetensors"))
    messages = run_ranks(_raises_everywhere, 2, str(tmp_path))
    for rank, msg in enumerate(messages):
        assert msg.startswith(f"rank {rank}: ")
        assert "3 parameter(s)" in msg and "blocks.1.fc1.weight" in msg and "norm.bias" in msg
        assert "embed.weight = head.weight" in msg and "model.safetensors" in msg


def test_shape_mismatch_names_the_file_and_both_shapes(tmp_path: Path) -> None:
    sd = {k: v.contiguous() for k, v in _reference().state_dict().items() if k != "head.weight"}
    sd["blocks.0.fc1.weight"] = torch.zeros(14, 12)
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        FullshardError,
        match=r"'blocks.0.fc1.weight' is \(14, 12\) in .*model"
        r"\.safetensors, the model's is \(13, 12\)",
    ):
        check_safetensors(_meta_toy(), tmp_path)


def test_bad_paths_and_indexes(tmp_path: Path) -> None:
    model = _reference()
    with pytest.raises(FullshardError, match="does not exist"):
        load_safetensors(model, tmp_path / "nothing.safetensors")
    with pytest.raises(FullshardError, match="holds neither model.safetensors nor"):
        load_safetensors(model, tmp_path)
    _write(tmp_path, "index")
    (tmp_path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(FullshardError, match="model-00002-of-00003.safetensors"):
        load_safetensors(model, tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(FullshardError, match="not a valid index"):
        load_safetensors(model, tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!")
    with pytest.raises(FullshardError, match="cannot read safetensors file"):
        load_safetensors(model, tmp_path / "model.safetensors")


def test_unexpected_keys_warn_or_fail_when_strict(tmp_path: Path) -> None:
    sd = {k: v.contiguous() for k, v in _reference().state_dict().items() if k != "head.weight"}
    sd["rotary.inv_freq"] = torch.ones(2)
    sd["cache"] = torch.ones(4)  # a computed buffer of the model: known, not loaded, no warning
    save_file(sd, str(tmp_path / "model.safetensors"))
    model = _reference(seed=2)
    with pytest.warns(UserWarning, match=r"1 tensor\(s\) .*rotary.inv_freq"):
        load_safetensors(model, tmp_path)
    assert torch.equal(model.cache, torch.arange(4.0))
    with pytest.raises(FullshardError, match="strict=True"):
        load_safetensors(model, tmp_path, strict=True)


def test_meta_model_is_refused_but_can_be_checked(tmp_path: Path) -> None:
    _write(tmp_path, "single")
    report = check_safetensors(_meta_toy(), tmp_path)  # headers only: fine on meta
    assert report.unexpected == [] and report.loaded == []
    with warnings.catch_warnings(), pytest.raises(FullshardError, match="to_empty"):
        load_safetensors(_meta_toy(), tmp_path)


def _strided(rank: int, world: int, path: str) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (world,))
    local = torch.zeros(4, 2)
    module = nn.Linear(2, 4, bias=False)
    placement = _StridedShard(0, split_factor=2)
    module.weight = nn.Parameter(DTensor.from_local(local, mesh, [placement], run_check=False))
    return _error_of(check_safetensors, module, path)


def test_tensor_parallel_strided_shards_are_refused(tmp_path: Path) -> None:
    save_file({"weight": torch.zeros(4, 2)}, str(tmp_path / "model.safetensors"))
    (msg,) = run_ranks(_strided, 1, str(tmp_path))
    assert "'weight' is placed" in msg and "strided" in msg
