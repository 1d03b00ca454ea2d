"""A small language model with the awkward shapes the engine must handle, and its reference.

Odd widths (12, 13, 37) leave uneven and empty shards at 2-4 ranks; ``gate`` has one element
(smaller than any world size); block 1 holds a frozen weight beside trainable ones; the root's
embedding and head are tied (inside one unit).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from fullshard.app.models.gpt import lm_loss

VOCAB, DIM, HIDDEN = 37, 12, 13


class Block(nn.Module):
    def __init__(self, d: int = DIM, hidden: int = HIDDEN, frozen: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)
        self.gate = nn.Parameter(torch.full((1,), 0.5))
        self.proj = nn.Linear(d, d, bias=False)
        self.proj.weight.requires_grad_(not frozen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc2(F.gelu(self.fc1(self.norm(x))))
        return x + self.gate * h + 0.1 * self.proj(x)


class ToyLM(nn.Module):
    def __init__(self, n_blocks: int = 3, tie: bool = True, checkpoint: str = "") -> None:
        super().__init__()
        self.checkpoint = checkpoint
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(frozen=(i == 1)) for i in range(n_blocks)])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            if self.checkpoint:
                reentrant = self.checkpoint == "reentrant"
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=reentrant)
            else:
                x = block(x)
        return self.head(self.norm(x))


def loss_of(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """Next-token loss on ``idx`` (batch, seq): the application's loss step."""
    return lm_loss(model, idx)


def batches(
    steps: int, world: int, batch: int = 2, seq: int = 7, seed: int = 1
) -> list[list[torch.Tensor]]:
    """``[step][rank]`` micro-batches, identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    return [
        [torch.randint(VOCAB, (batch, seq), generator=g) for _ in range(world)]
        for _ in range(steps)
    ]


def shard_toy(
    model: ToyLM,
    reshard_root: bool | None = None,
    reshard_blocks: bool | None = None,
    **kwargs: object,
) -> ToyLM:
    from fullshard import fully_shard

    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard_blocks, **kwargs)  # type: ignore[arg-type]
    fully_shard(model, reshard_after_forward=reshard_root, **kwargs)  # type: ignore[arg-type]
    return model


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of a sharded model, gathered to full tensors (collective)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in model.state_dict().items():
        out[k] = v.full_tensor() if isinstance(v, DTensor) else v
    return out


def reference_step(
    ref: nn.Module, opt: torch.optim.Optimizer, rank_batches: list[torch.Tensor]
) -> list[float]:
    """One optimizer step of the one-process reference fed every rank's batch, its gradients
    averaged as the sharded model's are; returns each rank's loss."""
    losses = []
    for batch in rank_batches:
        loss = loss_of(ref, batch)
        loss.backward()
        losses.append(loss.item())
    for p in ref.parameters():
        if p.grad is not None:
            p.grad.div_(len(rank_batches))
    opt.step()
    opt.zero_grad()
    return losses
