"""Sharding arithmetic (no processes): chunks, padding, and the two layouts' round trips."""

from __future__ import annotations

import pytest
import torch

from fullshard.shard.layout import FlatLayout, chunk_of, chunk_rows, local_rows

pytestmark = pytest.mark.fast  # pure arithmetic, no process group


@pytest.mark.parametrize("dim0,world", [(1, 4), (5, 4), (13, 2), (37, 3), (4 * 7 + 1, 4), (8, 8)])
def test_chunks_match_torch_chunk_and_cover_every_row(dim0: int, world: int) -> None:
    rows = [local_rows(dim0, world, r) for r in range(world)]
    assert sum(rows) == dim0
    expected = [c.shape[0] for c in torch.arange(dim0).chunk(world)]
    assert rows[: len(expected)] == expected and all(r == 0 for r in rows[len(expected) :])
    assert max(rows) == chunk_rows(dim0, world)
    full = torch.arange(dim0)
    assert torch.equal(torch.cat([chunk_of(full, world, r) for r in range(world)]), full)


def _shapes() -> list[torch.Size]:
    return [torch.Size(s) for s in [(37, 12), (12,), (1,), (13, 12), (5, 3, 2)]]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_pack_gather_copy_out_round_trip(world: int) -> None:
    shapes = _shapes()
    fulls = [torch.randn(s, dtype=torch.float64) for s in shapes]
    layout = FlatLayout(shapes, world)
    shards = []
    for r in range(world):
        flat = torch.full((layout.shard_numel,), float("nan"), dtype=torch.float64)
        layout.pack_shard(fulls, r, flat)
        for i, full in enumerate(fulls):
            assert torch.equal(layout.shard_view(flat, i, r), chunk_of(full, world, r))
        shards.append(flat)
    gathered = torch.cat(shards)  # what all_gather_into_tensor produces: rank-major
    assert not gathered.isnan().any()  # padding is zeroed, never garbage
    storage = torch.empty(layout.total_numel, dtype=torch.float64)
    layout.copy_out(gathered, storage)
    for i, full in enumerate(fulls):
        assert torch.equal(layout.gathered_view(storage, i), full)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_pack_for_reduce_puts_each_ranks_rows_in_its_block(world: int) -> None:
    shapes = _shapes()
    grads = [torch.randn(s, dtype=torch.float64) for s in shapes]
    grads[2] = None  # a parameter without gradient is sent as zeros
    layout = FlatLayout(shapes, world)
    extra = torch.ones(world, 2, dtype=torch.float64)
    packed = layout.pack_for_reduce(
        grads, dtype=torch.float64, device=torch.device("cpu"), extra=extra
    )
    assert packed.shape == (world, layout.shard_numel + 2)
    for r in range(world):
        block = packed[r]
        for i, g in enumerate(grads):
            got = layout.shard_view(block[: layout.shard_numel], i, r)
            want = torch.zeros_like(got) if g is None else chunk_of(g, world, r)
            assert torch.equal(got, want)
        assert torch.equal(block[layout.shard_numel :], extra[r])


@pytest.mark.parametrize("world", [3, 8])
def test_pack_for_reduce_casts_gradients_the_same_in_the_kernel_or_after(world: int) -> None:
    """bf16 gradients packed for an fp32 reduce-scatter (mixed precision): the CUDA way (one
    casting kernel) and the CPU way (interleave, then one cast) give the same bits, padding
    included."""
    shapes = _shapes()
    grads = [torch.randn(s).to(torch.bfloat16) for s in shapes]
    grads[1] = None  # zeros, in either way
    layout = FlatLayout(shapes, world)
    extra = torch.ones(world, 3, dtype=torch.bfloat16)
    packed = {}
    for cast_in_kernel in (True, False):
        packed[cast_in_kernel] = layout.pack_for_reduce(
            grads,
            dtype=torch.float32,
            device=torch.device("cpu"),
            extra=extra,
            cast_in_kernel=cast_in_kernel,
        )
    assert torch.equal(packed[True], packed[False])
    block = packed[False]
    assert block.dtype == torch.float32 and block.shape == (world, layout.shard_numel + 3)
    for r in range(world):
        for i, g in enumerate(grads):
            got = layout.shard_view(block[r, : layout.shard_numel], i, r)
            want = torch.zeros_like(got) if g is None else chunk_of(g, world, r).float()
            assert torch.equal(got, want)
        assert torch.equal(block[r, layout.shard_numel :], extra[r].float())
