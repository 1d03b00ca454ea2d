"""A small language model for ``shard_placement_fn`` tests, and the placement functions.

Every dim other than 0 that a function below shards divides by 2 and 4; dim 0 stays uneven
(37 rows). ``mix`` is 3-D, so a Shard(1) chunk has elements both before and after its dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard

VOCAB, DIM, HIDDEN = 37, 8, 16  # the vocabulary is toy.py's (its batches)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)
        self.mix = nn.Parameter(torch.randn(2, DIM, 3) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc2(F.gelu(self.fc1(self.norm(x))))
        m = (x.unsqueeze(-1) * self.mix.sum(0)).sum(-1)
        return x + h + 0.1 * m


class Net(nn.Module):
    def __init__(self, n_blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block() for _ in range(n_blocks)])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def dim1(param: nn.Parameter) -> Shard | None:
    """Shard(1) for every parameter of two or more dims, Shard(0) (None) for the others."""
    return Shard(1) if param.dim() >= 2 else None


def largest_dim(param: nn.Parameter) -> Shard:
    """FSDP2's test function: shard on the largest dim (the first of equal ones)."""
    sizes = list(param.shape)
    return Shard(sizes.index(max(sizes)))


def shard_net(model: Net, fn: object = dim1, **kwargs: object) -> Net:
    from fullshard import fully_shard

    for b in model.blocks:
        fully_shard(b, shard_placement_fn=fn, **kwargs)  # type: ignore[arg-type]
    root = {k: v for k, v in kwargs.items() if k != "reshard_after_forward"}
    fully_shard(model, shard_placement_fn=fn, **root)  # type: ignore[arg-type]
    return model
