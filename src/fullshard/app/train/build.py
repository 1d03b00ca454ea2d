"""What one rank trains with, built from scratch: the sharded model, its AdamW and schedule,
and the fixed-order steps with their validation batches (``fullshard train``; ``--elastic``
builds them again for each new membership)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fullshard import ShardedGradScaler
from fullshard.app.config import TrainConfig, reshard_after_forward_arg
from fullshard.app.dims import ParallelDims
from fullshard.app.errors import ConfigError
from fullshard.app.models.gpt import build_model, count_params, output_vocab_size, unit_types_of
from fullshard.app.train.verdict import (
    DeviceSchedule,
    StepVerdicts,
    cosine_multiplier,
    fused_adamw_available,
)
from fullshard.comm.device import cuda_semantics

__all__ = ["RankBuild", "build_rank", "lr_lambda", "param_groups", "to_device"]


# Parameter-name fragments that get no weight decay: decaying biases, norm gains or embedding
# rows toward zero only fights the model (they are not "capacity" in the way weight matrices are).
NO_DECAY_MARKERS = ("bias", "norm", "ln_", "embed", "wte", "wpe")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups by parameter name: decay for weight matrices, none for biases/norms/embeddings."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if any(m in name.lower() for m in NO_DECAY_MARKERS) else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def lr_lambda(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the peak LR: linear warmup over ``warmup`` steps, then cosine to ``min_ratio``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` without waiting for the device: a pageable host-to-GPU copy blocks
    the host until the GPU has finished everything queued before it, so batches go through
    pinned memory, asynchronously (the caching host allocator keeps the pinned buffer alive
    until the copy has run)."""
    if not cuda_semantics(device):
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class RankBuild:
    """What one rank trains with, built from scratch (at the start, and by ``--elastic`` for
    each new membership)."""

    model: nn.Module
    plan: Any
    fixed: Any
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    dsched: DeviceSchedule | None
    verdicts: StepVerdicts
    scaler: ShardedGradScaler | None
    n_params: int
    val: list
    val_count: int


def build_rank(
    cfg: TrainConfig,
    dims: ParallelDims,
    tokenizer: Any,
    rank: int,
    world: int,
    device: torch.device,
    val_tokens: Any,
) -> RankBuild:
    """The sharded model, its optimizer and schedule, and the fixed-order steps (with their
    validation batches) of ``rank`` among ``world`` ranks."""
    micro = cfg.micro_batch(dims.dp)
    val: list = []
    # lazy_weights: a safetensors checkpoint is built on meta and loaded by shard_model, each
    # rank reading only its rows; so the vocabulary is read off the output layer, not a forward
    model = build_model(
        cfg.model, tokenizer.vocab_size, seed=cfg.seed, device=device, lazy_weights=True
    )
    n_params = count_params(model)
    vocab = output_vocab_size(model)
    if vocab < tokenizer.vocab_size:
        raise ConfigError(f"model vocabulary {vocab} < tokenizer vocabulary {tokenizer.vocab_size}")

    from fullshard.app.models.wrap import shard_model

    plan = shard_model(
        model,
        cfg.strategy,
        unit_types_of(model),
        mixed_precision=cfg.mixed_precision,
        dims=dims,
        activation_checkpointing=cfg.activation_checkpointing,
        float8=cfg.float8,
        reshard_after_forward=reshard_after_forward_arg(cfg.reshard_after_forward),
        cpu_offload=cfg.cpu_offload,
    )
    fixed, val_count = None, 0
    if cfg.global_sampler:
        from fullshard.app.train.fixed_order import FixedOrderSteps

        fixed = FixedOrderSteps(
            model, global_batch=cfg.batch_size, micro_batch=micro, seed=cfg.seed, rank=rank,
            world=world, device=device, to_device=to_device, exact=cfg.deterministic,
        )  # fmt: skip
        val, val_count = fixed.val_batches(val_tokens, cfg.seq_len, cfg.eval_batches)
    # NOTE [The step's verdict on the device]: on the CUDA path the device skips non-finite
    # steps (fused AdamW's found_inf, a device schedule) and the host reads verdicts a step late.
    # Not with --cpu-offload: the optimizer's parameters live on the host, whose kernel would
    # read a device lr and found_inf before their copies land (NOTE [Kernel contracts]); the
    # host waits for the gradients there anyway, and decides the step itself
    on_device = cuda_semantics(device) and fused_adamw_available(device) and not cfg.cpu_offload
    opt = torch.optim.AdamW(
        param_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        **({"fused": True} if on_device else {}),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_lambda(s, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)
    )
    multiplier = cosine_multiplier(cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)
    dsched = DeviceSchedule(opt, sched, multiplier, device) if on_device else None
    verdicts = StepVerdicts(lag=1 if on_device else 0)
    # fp16 needs loss scaling; the sharded scaler makes the skip decision on every rank alike
    scaler = ShardedGradScaler(device.type) if cfg.mixed_precision == "fp16" else None
    return RankBuild(
        model, plan, fixed, opt, sched, dsched, verdicts, scaler, n_params, val, val_count
    )
