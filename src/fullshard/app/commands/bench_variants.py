"""The variants ``fullshard bench`` compares, and one training step of each.

Every variant trains the same model (same initial weights, same batches) on this rank: each
fullshard strategy, ``deterministic`` (full_shard with ``fullshard.deterministic``'s fixed-order
sums, each rank's batch one micro-batch), torch's FSDP2, torch's DDP, and ``single`` (one
process, the whole model, one rank's batch). Master weights and the optimizer stay float32 everywhere; ``--mixed-precision
bf16`` computes in bfloat16 the way each implementation does it: fullshard and FSDP2 gather
bf16 parameters and reduce gradients in float32 (their mixed-precision policies), DDP and
``single`` run forward and backward under ``torch.autocast``.

NOTE [Issue time]
On a GPU the host only *issues* work; the device runs it later. A step that never waits for the
device lets the host run ahead and hide its own overheads (hooks, Python, launches) behind the
GPU. :func:`bench_step` therefore returns when the host has issued everything, then the caller
synchronises: "issue time" (start to the last issue) next to "step time" (start to the device's
end) says how much host time a step costs and whether the host ever waited on the device inside
the step (issue close to step time). On CPU the host does the work itself: issue time is the
step time.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fullshard.app.models.gpt import lm_loss

__all__ = [
    "FULLSHARD_VARIANTS",
    "VARIANTS",
    "Variant",
    "bench_step",
    "build_variant",
    "default_variants",
    "finish_step",
    "make_batches",
    "parse_variants",
]

FULLSHARD_VARIANTS = (
    "full_shard",
    "shard_grad_op",
    "no_shard",
    "hybrid_shard",
    "hybrid_shard_zero2",
    "deterministic",  # full_shard with fullshard.deterministic's fixed-order sums
)
VARIANTS = (*FULLSHARD_VARIANTS, "fsdp2", "ddp", "single")
VOCAB = 256  # the built-in models' byte-level vocabulary
MIXED_PRECISION = ("none", "bf16")


def default_variants(nproc: int) -> list[str]:
    """Every fullshard strategy that makes sense at ``nproc`` ranks, FSDP2, DDP, one process."""
    names = ["full_shard", "shard_grad_op", "no_shard"]
    if nproc >= 4 and nproc % 2 == 0:
        names.append("hybrid_shard")  # a (2, nproc/2) mesh; below 4 ranks it is FULL_SHARD
    return [*names, "fsdp2", "ddp", "single"]


def parse_variants(text: str, nproc: int) -> list[str]:
    """``--variants``: a comma list (empty = :func:`default_variants`); raises ``ValueError``."""
    names = [v.strip().lower() for v in text.split(",") if v.strip()]
    if not names:
        return default_variants(nproc)
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown bench variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    hybrid = [v for v in names if v.startswith("hybrid")]
    if hybrid and (nproc < 4 or nproc % 2):
        raise ValueError(f"{hybrid} need an even --nproc of at least 4 (got {nproc})")
    return list(dict.fromkeys(names))  # drop repeats, keep order


@dataclass
class Variant:
    """One way of training the same model on this rank (``active``: this rank takes part).

    ``autocast``: run forward and backward under ``torch.autocast`` in this dtype (DDP and
    ``single`` with mixed precision; the sharded variants cast through their policies instead).
    """

    name: str
    model: nn.Module
    opt: torch.optim.Optimizer
    active: bool = True
    autocast: torch.dtype | None = None
    last_loss: float = float("nan")  # of the last timed step, read after its synchronisation
    # ``deterministic``: the fixed tree of gradients (each rank's batch is one micro-batch)
    tree: Any = None
    world: int = 1


def _fsdp2(model: nn.Module, world: int, device: torch.device, bf16: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from fullshard.app.models.gpt import unit_types_of
    from fullshard.engine.sharding import plan_sharding

    kwargs: dict[str, Any] = {}
    if bf16:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if device.type == "cuda":
        # FSDP2's default mesh follows the accelerator; say so explicitly for ranks that share a
        # GPU over gloo, whose world group is not a CUDA (NCCL) one.
        kwargs["mesh"] = init_device_mesh("cuda", (world,))
    plan = plan_sharding(model, "full_shard", unit_types_of(model), world)
    for m in plan.unit_modules(model):  # the units fullshard would make, the same order
        fully_shard(m, **kwargs)
    fully_shard(model, **kwargs)


def build_variant(
    name: str,
    model_name: str,
    rank: int,
    world: int,
    device: torch.device,
    mixed_precision: str = "none",
) -> Variant:
    """The model, wrapped the way ``name`` says, and its AdamW (built after wrapping)."""
    from fullshard.app.models.gpt import build_model, unit_types_of

    bf16 = mixed_precision == "bf16"
    model = build_model(model_name, VOCAB, seed=0, device=device)
    autocast = None
    tree = None
    if name in FULLSHARD_VARIANTS:
        from fullshard.app.config import ParallelismConfig
        from fullshard.app.models.wrap import shard_model

        strategy = "full_shard" if name == "deterministic" else name
        parallelism = ParallelismConfig(strategy=strategy, mixed_precision=mixed_precision)
        shard_model(model, parallelism, unit_types_of(model))
        if name == "deterministic":
            from fullshard import deterministic

            deterministic.enable(model)
            plan = deterministic.MicroBatches(global_batch=world, micro_batch=1)
            tree = deterministic.GradientTree(model.parameters(), plan, world)
    elif name == "fsdp2":
        _fsdp2(model, world, device, bf16)
    elif name in ("ddp", "single"):
        if name == "ddp":
            model = nn.parallel.DistributedDataParallel(model)
        autocast = torch.bfloat16 if bf16 else None
    else:
        raise ValueError(f"unknown variant {name!r}")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    active = name != "single" or rank == 0
    return Variant(name, model, opt, active=active, autocast=autocast, tree=tree, world=world)


def bench_step(v: Variant, batch: torch.Tensor) -> tuple[torch.Tensor, float]:
    """One training step (forward, loss, backward, optimizer), issued but not waited for.

    Returns the loss (a device tensor: reading it would wait for the device) and the
    ``time.perf_counter()`` at which the host had issued the whole step (NOTE [Issue time]).
    The caller synchronises the device, then reads the loss.
    """
    ctx = (
        torch.autocast(batch.device.type, dtype=v.autocast)
        if v.autocast is not None
        else contextlib.nullcontext()
    )
    with ctx:
        loss = lm_loss(v.model, batch)
    if v.tree is None:
        loss.backward()
    else:  # one micro-batch of world: its share of the sum, through the fixed tree
        (loss / v.world).backward()
        v.tree.push()
        v.tree.finish()
    v.opt.step()
    v.opt.zero_grad(set_to_none=True)
    return loss.detach(), time.perf_counter()


def finish_step(device: torch.device) -> None:
    """Wait for the device to finish the step just issued (nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_batches(
    batch_size: int, seq_len: int, rank: int, n: int, device: torch.device
) -> list[torch.Tensor]:
    """``n`` random token batches, seeded by rank: every variant sees the same ones, in order."""
    gen = torch.Generator().manual_seed(1000 + rank)
    return [
        torch.randint(VOCAB, (batch_size, seq_len + 1), generator=gen).to(device) for _ in range(n)
    ]
