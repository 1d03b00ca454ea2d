"""Full (unsharded) weights (layer 9): a state dict on rank 0, safetensors export, offline convert.

``full_state_dict`` streams the model to rank 0 one unit at a time: each unit's shards are
all-gathered in the *master* dtype (one collective per unit, inside the shard group, by the
unit's public view: ``UnitView.full_parameters``), rank 0
copies the parameters to CPU, and the gathered buffer is dropped before the next unit. Rank 0
therefore holds the model plus one unit (and its gather buffer); other ranks never hold more
than one unit.
"""

from __future__ import annotations

import json
import os
import struct
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fullshard.engine.view import units
from fullshard.policies import FullshardError


def full_state_dict(model: nn.Module, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer as a full CPU tensor (on rank 0 only, by default).

    A collective: call it on every rank. Tied parameters map to the same tensor object.
    """
    rank = dist.get_rank()
    keep = rank == 0 or not rank0_only
    out: dict[str, torch.Tensor] = {}
    for view in units(model):
        for p, full in view.full_parameters():  # every rank iterates: collectives
            if keep:
                kept = full.to("cpu", copy=True)  # one tensor for every tied name
                for fqn in view.names_of(p):
                    out[fqn] = kept
            del full
    if keep:
        managed = set(out)
        for key, value in model.state_dict().items():
            if key not in managed and isinstance(value, torch.Tensor):
                out[key] = value.detach().to("cpu", copy=True)  # buffers, unsharded parameters
        order = list(model.state_dict().keys())
        out = {k: out[k] for k in order if k in out}
    return out


def _dedupe_ties(
    tensors: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    # safetensors refuses two names for one tensor; keep the first, record the others
    first: dict[int, str] = {}
    kept, tied = {}, {}
    for name, t in tensors.items():
        if id(t) in first:
            tied[name] = first[id(t)]
        else:
            first[id(t)] = name
            kept[name] = t.contiguous()
    return kept, tied


def save_safetensors(tensors: dict[str, torch.Tensor], path: str) -> None:
    """Write full tensors to ``path`` (tied duplicates listed in the metadata)."""
    from safetensors.torch import save_file

    kept, tied = _dedupe_ties(tensors)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_file(kept, path, metadata={"format": "pt", "fullshard_tied": json.dumps(tied)})
    _sort_metadata(path)


def _sort_metadata(path: str) -> None:
    """Rewrite the header of the safetensors file ``path`` with its metadata in sorted order,
    in place: safetensors writes the metadata from a hash map, in an order that changes from
    process to process, so equal tensors gave files of different bytes (and sha256)."""
    with open(path, "r+b") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(size))
        meta = header.get("__metadata__")
        if not meta:
            return
        header["__metadata__"] = dict(sorted(meta.items()))
        # the same entries, so the same length; the padding safetensors added stays as it was
        text = json.dumps(header, separators=(",", ":")).encode("utf-8")
        if len(text) > size:
            return  # not safetensors' compact form: leave the file as it was written
        f.seek(8)
        f.write(text.ljust(size, b" "))


def export_safetensors(model: nn.Module, out_dir: str) -> str | None:
    """Write ``model.safetensors`` (original parameter names) to ``out_dir`` on rank 0.

    A Hugging Face ``transformers`` model also gets its ``config.json``, so the folder loads
    back with ``from_pretrained``. Returns the file path on rank 0, ``None`` elsewhere.
    """
    full = full_state_dict(model)
    if dist.get_rank() != 0:
        return None
    path = os.path.join(out_dir, "model.safetensors")
    save_safetensors(full, path)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(out_dir)
    return path


def convert(checkpoint: str, out: str, *, key: str = "model") -> str:
    """Offline: a sharded DCP checkpoint's ``key`` section -> one safetensors file, no process group.

    Reads only that section's tensors (not the optimizer state) at their full shape.
    """
    reader = FileSystemReader(checkpoint)
    meta = reader.read_metadata()
    prefix = key + "."
    target: dict[str, Any] = {}
    for name, md in meta.state_dict_metadata.items():
        if name.startswith(prefix) and isinstance(md, TensorStorageMetadata):
            target[name[len(prefix) :]] = torch.empty(md.size, dtype=md.properties.dtype)
    if not target:
        raise FullshardError(
            f"{checkpoint} has no tensors under '{key}'; sections found: "
            f"{sorted({n.split('.')[0] for n in meta.state_dict_metadata})}"
        )
    with warnings.catch_warnings():  # "assuming ... a single process": that is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({key: target}, storage_reader=reader, no_dist=True)
    path = out if out.endswith(".safetensors") else os.path.join(out, "model.safetensors")
    save_safetensors(target, path)
    return path
