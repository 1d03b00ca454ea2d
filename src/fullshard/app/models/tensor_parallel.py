"""``fullshard train --tp N``: tensor parallel inside each block, FSDP across the rest.

The ranks form a ``(data parallel..., tp)`` mesh: ``N`` consecutive ranks (on one node when ranks
per node is a multiple of N) split each block's matrices, and the data-parallel dims shard and
replicate as the strategy says. Each block gets a TP plan (``parallelize_module``) first, then
``fully_shard`` shards every parameter's TP-local tensor over the data-parallel mesh (NOTE
[Tensor parallel parameters]). The TP ranks of one data-parallel rank see the same batch.

Plans (Megatron's): column-wise for the matrices that fan out (attention's q, k, v; the MLP's up
and gate), row-wise for the ones that fan back in (attention's output; the MLP's down), so each
block all-reduces twice in forward and twice in backward.

- Llama-style Hugging Face blocks (``q_proj``/``k_proj``/``v_proj``/``o_proj``, ``gate_proj``/
  ``up_proj``/``down_proj``) and the built-in GPT (``attn.q``/``k``/``v``/``proj``, ``mlp.fc``/
  ``proj``): attention heads and the MLP are split; heads must divide by N (key/value heads
  too). Norms and embeddings stay replicated on the TP ranks (same input, same result).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from fullshard.app.errors import ConfigError
from fullshard.engine.sharding import ShardingPlan

__all__ = ["apply_tensor_parallel", "block_plan", "meshes"]

_LLAMA = {
    "self_attn.q_proj": "col",
    "self_attn.k_proj": "col",
    "self_attn.v_proj": "col",
    "self_attn.o_proj": "row",
    "mlp.gate_proj": "col",
    "mlp.up_proj": "col",
    "mlp.down_proj": "row",
}
_GPT = {
    "attn.q": "col",
    "attn.k": "col",
    "attn.v": "col",
    "attn.proj": "row",
    "mlp.fc": "col",
    "mlp.proj": "row",
}


def block_plan(block: nn.Module) -> dict[str, str]:
    """Submodule name -> ``"col"`` or ``"row"`` for one block, by what the block contains."""
    names = {n for n, _ in block.named_modules()}
    for plan in (_LLAMA, _GPT):
        if set(plan) <= names:
            return plan
    raise ConfigError(
        f"--tp: no tensor-parallel plan for block {type(block).__name__} (fullshard has plans "
        "for the built-in GPT and Llama-style Hugging Face decoder layers); use --tp 1"
    )


def check_divisible(block: nn.Module, tp: int) -> None:
    """Every split dimension and head count divides by ``tp`` (else TP would need padding)."""
    for name, kind in block_plan(block).items():
        linear = block.get_submodule(name)
        assert isinstance(linear, nn.Linear)
        size = linear.out_features if kind == "col" else linear.in_features
        if size % tp:
            raise ConfigError(
                f"--tp {tp}: {name} of {type(block).__name__} has {size} "
                f"{'outputs' if kind == 'col' else 'inputs'}, not divisible by {tp}"
            )
    config = getattr(getattr(block, "self_attn", None), "config", None)
    counts = {
        key: getattr(config, key, None) for key in ("num_attention_heads", "num_key_value_heads")
    }
    counts["attention heads"] = getattr(
        getattr(block, "attn", None), "n_head", None
    )  # built-in GPT
    for key, heads in counts.items():
        if isinstance(heads, int) and heads % tp:
            raise ConfigError(f"--tp {tp}: the model has {heads} {key}, not divisible by {tp}")


def meshes(plan: ShardingPlan, tp: int, device_type: str) -> tuple[DeviceMesh, DeviceMesh]:
    """The data-parallel mesh ``plan`` shards over and the TP mesh, from one
    ``(data parallel..., tp)`` mesh (TP innermost: consecutive ranks)."""
    shape = (*plan.mesh_shape, tp)
    names = ("replicate", "shard", "tp") if len(shape) == 3 else ("dp", "tp")
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    dp_mesh = mesh[names[:-1]] if len(names) == 3 else mesh["dp"]
    return dp_mesh, mesh["tp"]


def apply_tensor_parallel(model: nn.Module, blocks: list[nn.Module], tp_mesh: DeviceMesh) -> None:
    """Give every block its TP plan (before ``fully_shard``)."""
    tp = tp_mesh.size()
    for block in blocks:
        check_divisible(block, tp)
        styles: dict[str, Any] = {
            name: ColwiseParallel() if kind == "col" else RowwiseParallel()
            for name, kind in block_plan(block).items()
        }
        parallelize_module(block, tp_mesh, styles)
