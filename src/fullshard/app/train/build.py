"""What one rank trains with, built from scratch: its data (once per process), the sharded
model, its optimizer (AdamW, or Muon with AdamW groups) and schedule in the train state, and
the step's batches and decider (``fullshard train``; ``--elastic`` builds the model and what
follows again for each new membership)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fullshard import ShardedGradScaler
from fullshard.app.config import OptimizerConfig, TrainConfig
from fullshard.app.data.corpus import RankBatches, eval_batches, split_for_rank
from fullshard.app.dims import ParallelDims
from fullshard.app.errors import ConfigError
from fullshard.app.models.gpt import build_model, count_params, output_vocab_size, unit_types_of
from fullshard.app.models.wrap import shard_model
from fullshard.app.train.fixed_order import GlobalBatches
from fullshard.app.train.state import TrainState
from fullshard.app.train.steps import Accumulate, Batches, Decider, DeviceStep, HostStep
from fullshard.app.train.verdict import DeviceSchedule, fused_adamw_available
from fullshard.comm.device import cuda_semantics, in_host_memory
from fullshard.engine.param import local_of

__all__ = [
    "Built",
    "RankData",
    "adamw_implementation",
    "build_optimizer",
    "build_rank",
    "device_decides",
    "lr_lambda",
    "param_groups",
    "rank_data",
]


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


def build_optimizer(
    model: nn.Module, opt: OptimizerConfig, on_device: bool
) -> torch.optim.Optimizer:
    """``--optimizer``: AdamW over :func:`param_groups`, or ``fullshard.optim.Muon`` for the
    hidden weight matrices (``adjust_lr_fn="match_rms_adamw"``: Moonlight's scaling, under
    which AdamW's ``--lr`` and ``--weight-decay`` carry over) with AdamW groups, the same
    ``--optimizer-impl``, for the rest (embeddings, head, norms, biases)."""
    impl = adamw_implementation(opt.impl, on_device)
    betas = (opt.beta1, opt.beta2)
    if opt.name == "adamw":
        groups = param_groups(model, opt.weight_decay)
        return torch.optim.AdamW(groups, lr=opt.lr, betas=betas, **impl)
    from fullshard.optim import Muon, matrix_groups

    matrices = {id(p) for g in matrix_groups(model) if g["use_muon"] for p in g["params"]}
    groups = [{"params": [p for p in model.parameters() if id(p) in matrices], "use_muon": True}]
    groups = [g for g in groups if g["params"]]
    for g in param_groups(model, opt.weight_decay):
        rest = [p for p in g["params"] if id(p) not in matrices]
        if rest:
            groups.append({**g, "params": rest, "use_muon": False, "betas": betas, **impl})
    return Muon(groups, lr=opt.lr, weight_decay=opt.weight_decay, adjust_lr_fn="match_rms_adamw")


def lr_lambda(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the peak LR: linear warmup over ``warmup`` steps, then cosine to ``min_ratio``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def adamw_implementation(impl: str, on_device: bool) -> dict[str, bool]:
    """AdamW's keyword arguments for ``--optimizer-impl impl``; ``auto``: fused where the device
    decides the step (``on_device``), else torch's own default (the per-parameter loop for host
    tensors, foreach for CUDA ones)."""
    if impl == "auto":
        return {"fused": True} if on_device else {}
    return {"fused": impl == "fused", "foreach": impl == "foreach"}


@dataclass
class RankData:
    """A rank's data, read once per process (a membership change keeps it): the sampler whose
    position the train state holds, and the validation text or batches."""

    tokenizer: Any
    tokens: int  # the corpus' tokens
    sampler: RankBatches
    val_tokens: Any
    val: list  # the default step's validation batches (this rank's)
    words: str  # the run line's words for the training text


def rank_data(
    cfg: TrainConfig, dims: ParallelDims, tokenizer: Any, tokens: Any, rank: int
) -> RankData:
    """The global sampler over the unsplit stream (``--deterministic``, ``--elastic``), or the
    slice of the text of ``rank``'s data-parallel rank (the ``--tp`` ranks of one group read
    the same)."""
    seq_len, seed = cfg.data.seq_len, cfg.training.seed
    if cfg.global_sampler:  # (fullshard.app.train.fixed_order)
        train_tokens, val_tokens = split_for_rank(tokens, 0, 1, cfg.data.val_fraction)
        batch = cfg.training.batch_size
        sampler = RankBatches(
            train_tokens, seq_len, batch, seed=seed, rank=0, world_independent=True
        )
        words = f"{len(train_tokens):,} train, one global sampler"
        return RankData(tokenizer, len(tokens), sampler, val_tokens, [], words)
    dp_rank, micro = dims.dp_rank(rank), cfg.micro_batch(dims.dp)
    train_tokens, val_tokens = split_for_rank(tokens, dp_rank, dims.dp, cfg.data.val_fraction)
    sampler = RankBatches(train_tokens, seq_len, micro, seed=seed, rank=dp_rank)
    val = eval_batches(val_tokens, seq_len, micro, cfg.output.eval_batches)
    words = f"{len(train_tokens):,} train per rank"
    return RankData(tokenizer, len(tokens), sampler, val_tokens, val, words)


@dataclass
class Built:
    """What one rank trains with, built from scratch (at the start, and by ``--elastic`` for
    each new membership): the train state, and the step's two choices (``steps.py``)."""

    state: TrainState
    batches: Batches
    decider: Decider
    scaler: ShardedGradScaler | None
    plan: Any  # the sharding plan applied (fullshard.engine.sharding.ShardingPlan)
    n_params: int


def build_rank(
    cfg: TrainConfig,
    dims: ParallelDims,
    data: RankData,
    rank: int,
    world: int,
    device: torch.device,
) -> Built:
    """The sharded model, its optimizer and schedule, and the step's batches and decider, of
    ``rank`` among ``world`` ranks (``dims`` at that world)."""
    # lazy_weights: a safetensors checkpoint is built on meta and loaded by shard_model, each
    # rank reading only its rows; so the vocabulary is read off the output layer, not a forward
    vocab_size = data.tokenizer.vocab_size
    seed = cfg.training.seed
    model = build_model(cfg.model.name, vocab_size, seed=seed, device=device, lazy_weights=True)
    n_params = count_params(model)
    vocab = output_vocab_size(model)
    if vocab < vocab_size:
        raise ConfigError(f"model vocabulary {vocab} < tokenizer vocabulary {vocab_size}")
    plan = shard_model(model, cfg.parallelism, unit_types_of(model), dims=dims)
    on_device = device_decides(
        cfg.optimizer, (p for p in model.parameters() if p.requires_grad), device
    )
    opt = build_optimizer(model, cfg.optimizer, on_device)
    o, max_steps = cfg.optimizer, cfg.training.max_steps

    def multiplier(step: int) -> float:
        return lr_lambda(step, o.warmup_steps, max_steps, o.min_lr_ratio)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, multiplier)
    schedule = DeviceSchedule(opt, sched, multiplier, max_steps, device) if on_device else None
    state = TrainState(model, opt, sched, data.sampler, schedule)
    # fp16 needs loss scaling; the sharded scaler makes the skip decision on every rank alike
    fp16 = cfg.parallelism.mixed_precision == "fp16"
    scaler = ShardedGradScaler(device.type) if fp16 else None
    batches = _batches(cfg, dims, data, model, scaler, rank, world, device)
    clip = cfg.training.clip
    decider: Decider = (
        HostStep(state, scaler, clip)
        if schedule is None
        else DeviceStep(state, schedule, scaler, clip)
    )
    return Built(state, batches, decider, scaler, plan, n_params)


def device_decides(
    opt: OptimizerConfig, params: Iterable[torch.Tensor], device: torch.device
) -> bool:
    """Whether the device decides each optimizer step (NOTE [The step's verdict on the
    device]) over ``params``, the parameters the optimizer steps (sharded): on the CUDA path
    the device skips non-finite steps (fused AdamW's found_inf, a device schedule) and the host
    reads verdicts a step late.

    Not when any of them lives in host memory (``--cpu-offload``, or a model offloaded some
    other way): the host's kernel would read a device lr and found_inf before their copies land
    (NOTE [Kernel contracts]); the host waits for the gradients there anyway, and decides the
    step itself. Only fused AdamW takes found_inf, so a GPU run with ``--optimizer-impl``
    for-loop or foreach has the host decide (and Muon's steps are the host's: its
    Newton-Schulz takes no found_inf)."""
    return (
        cuda_semantics(device)
        and opt.name == "adamw"
        and opt.impl in ("auto", "fused")
        and fused_adamw_available(device)
        # a sharded parameter is a DTensor: its memory is its local tensor's
        and not any(in_host_memory(local_of(p)) for p in params)
    )


def _batches(
    cfg: TrainConfig,
    dims: ParallelDims,
    data: RankData,
    model: nn.Module,
    scaler: ShardedGradScaler | None,
    rank: int,
    world: int,
    device: torch.device,
) -> Batches:
    """The step's micro-batches: the global sampler's (``--deterministic``, ``--elastic``), or
    this rank's slice accumulated ``--grad-accum`` times."""
    micro, seq_len = cfg.micro_batch(dims.dp), cfg.data.seq_len
    if cfg.global_sampler:
        return GlobalBatches(
            model,
            data.sampler,
            global_batch=cfg.training.batch_size,
            micro_batch=micro,
            seed=cfg.training.seed,
            rank=rank,
            world=world,
            device=device,
            fixed_order=cfg.training.deterministic,
            val_tokens=data.val_tokens,
            seq_len=seq_len,
            eval_batches=cfg.output.eval_batches,
        )
    accum = cfg.training.grad_accum
    words = f"micro-batch {micro} x {seq_len}, grad-accum {accum}"
    return Accumulate(data.sampler, accum, device, scaler, data.val, words)
