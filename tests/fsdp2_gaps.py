"""FSDP2 programs for what torch's own FSDP2 tests exercise beyond ``fsdp2_programs.py``: tied
weights, casting after init, post-accumulate-grad hooks, 1F1B's early unshard, the chunked
loss, ``reset_iter_state``, custom collectives, the all-reduce hook, ``share_comm_ctx``.

``gaps_program`` runs every case in one launch (each launch costs seconds, the cases
milliseconds) and returns, per case, the largest difference from one process in float64 (and
what else its test checks). Each case runs under torch's ``fully_shard`` or fullshard's.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from fsdp2_programs import VOCAB, Net, _ref_step, _setup, _train_against, api_of, max_diff, shard
from torch import nn
from torch.distributed.tensor import DTensor
from toy import DIM, Block, batches, loss_of


class TiedNet(Net):
    def __init__(self) -> None:
        super().__init__()
        self.head.weight = self.embed.weight


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        raise RuntimeError("boom in backward")


class ChunkNet(nn.Module):
    """Embedding, a body, and a head that a chunked loss runs on its own, per chunk."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.body = Block()
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.armed = ""  # "forward" / "backward": raise there (reset_iter_state)

    def forward(self, idx: torch.Tensor, skip_head: bool = False) -> torch.Tensor:
        h = self.embed(idx)
        if self.armed == "forward":
            raise RuntimeError("boom")
        h = self.body(h)
        if self.armed == "backward":  # after [norm, head]'s backward has reduced
            h = _RaiseInBackward.apply(h)
        h = self.norm(h)
        return h if skip_head else self.head(h)


def _tied(rank: int, world: int, impl: str) -> dict:
    """fully_shard([embed, head]) whose weights are tied: one parameter of one unit."""
    torch.manual_seed(0)
    ref = TiedNet()
    model = copy.deepcopy(ref)
    fs = api_of(impl).fully_shard
    for b in model.blocks:
        fs(b)
    fs([model.embed, model.head])
    fs(model)
    tied = model.embed.weight is model.head.weight
    return {"diff": _train_against(model, ref, rank, world), "tied": tied}


def _tied_across_units(rank: int, world: int, impl: str) -> dict:
    """A weight tied between two sibling units is refused at the first forward (ValueError)."""
    model = TiedNet()
    fs = api_of(impl).fully_shard
    fs(model.embed)
    fs(model.head)
    fs(model)
    try:
        model(batches(1, world)[0][rank])
    except ValueError as exc:
        return {"diff": 0.0, "raised": "already managed by another" in str(exc)}
    return {"diff": 0.0, "raised": False}


def _cast_after_init(rank: int, world: int, impl: str) -> dict:
    """model.to(torch.float64) after fully_shard: shards, gradients and training in float64."""
    _, model = _setup()
    model.float()
    ref = copy.deepcopy(model).double()
    shard(model, impl)
    model.to(torch.float64)
    dtypes = {(p.dtype, p.to_local().dtype, p._spec.tensor_meta.dtype) for p in model.parameters()}
    diff = _train_against(model, ref, rank, world)
    grads = {p.grad.to_local().dtype for p in model.parameters() if p.grad is not None}
    return {"diff": diff, "float64": dtypes == {(torch.float64,) * 3} and grads <= {torch.float64}}


def _optimizer_in_backward(rank: int, world: int, impl: str) -> dict:
    """Each sharded parameter steps its own optimizer in its post-accumulate-grad hook."""
    ref, model = _setup()
    shard(model, impl)
    opts = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}
    calls = [0]

    def step(p: torch.Tensor) -> None:
        calls[0] += 1
        opts[p].step()
        opts[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    steps, data = 2, batches(2, world)
    for s in range(steps):
        loss_of(model, data[s][rank]).backward()
        _ref_step(ref, data[s], world)
        ref_opt.step()
        ref_opt.zero_grad()
    diff = max_diff(dict(model.named_parameters()), dict(ref.named_parameters()))
    return {"diff": diff, "calls": calls[0] == steps * len(opts)}


def _one_f_one_b(rank: int, world: int, impl: str) -> dict:
    """Every unit unsharded (async) before the first forward; 3 micro-batches, sync on the last."""
    ref, model = _setup()
    shard(model, impl, reshard_after_forward=False)
    api = api_of(impl)
    for m in model.modules():
        if isinstance(m, api.FSDPModule):
            m.unshard(async_op=True)
    data = batches(3, world)
    for i in range(3):
        last = i == 2
        model.set_requires_gradient_sync(last)
        model.set_is_last_backward(last)
        loss_of(model, data[i][rank]).backward()
        for r in range(world):
            loss_of(ref, data[i][r]).backward()
    for p in ref.parameters():
        p.grad.div_(world)
    for m in (model, ref):
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    return {"diff": max_diff(dict(model.named_parameters()), dict(ref.named_parameters()))}


def _shard_chunk_net(model: ChunkNet, impl: str) -> None:
    fs = api_of(impl).fully_shard
    fs(model.embed)
    fs(model.body)
    fs([model.norm, model.head])
    fs(model)


def _chunked_step(model: ChunkNet, idx: torch.Tensor, chunks: int = 3) -> None:
    """The chunked loss: a forward that skips the head, then the head per chunk of positions."""
    inp, tgt = idx[:, :-1], idx[:, 1:]
    h = model(inp, skip_head=True)
    grads = []
    for c, t in zip(h.detach().chunk(chunks, dim=1), tgt.chunk(chunks, dim=1), strict=True):
        c = c.contiguous().requires_grad_(True)
        logits = model.head(c)
        F.cross_entropy(logits.reshape(-1, VOCAB), t.reshape(-1), reduction="sum").div(
            tgt.numel()
        ).backward()
        grads.append(c.grad)
    h.backward(torch.cat(grads, dim=1))


def _train_chunked(
    model: ChunkNet, ref: ChunkNet, rank: int, world: int, step_fn: Callable[..., None]
) -> float:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    data = batches(2, world)
    for s in range(2):
        step_fn(model, data[s][rank])
        for r in range(world):
            step_fn(ref, data[s][r])
        for p in ref.parameters():
            p.grad.div_(world)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    return max_diff(dict(model.named_parameters()), dict(ref.named_parameters()))


def _chunked_loss(rank: int, world: int, impl: str) -> dict:
    """fully_shard([norm, head]); the root's forward skips head, which runs per chunk. Also:
    after such a partial forward the unit is resharded (its forward was finished by the root),
    and two partial forwards then one backward give one process's gradients."""
    torch.manual_seed(0)
    ref = ChunkNet()
    model, twice = copy.deepcopy(ref), copy.deepcopy(ref)
    _shard_chunk_net(model, impl)
    _shard_chunk_net(twice, impl)
    data = batches(1, world, seed=5)[0]
    h1 = twice(data[rank], skip_head=True)
    resharded = isinstance(twice.norm.weight, DTensor)
    h2 = twice(data[rank].flip(1), skip_head=True)
    (h1.square().mean() + h2.square().mean()).backward()
    ref2 = copy.deepcopy(ref)
    for r in range(world):
        (
            ref2(data[r], skip_head=True).square().mean()
            + ref2(data[r].flip(1), skip_head=True).square().mean()
        ).backward()
    grads = {k: p.grad / world for k, p in ref2.named_parameters() if p.grad is not None}
    two = max_diff({k: p.grad for k, p in twice.named_parameters() if p.grad is not None}, grads)
    diff = max(_train_chunked(model, ref, rank, world, _chunked_step), two)
    return {"diff": diff, "resharded": resharded, "head_unused": twice.head.weight.grad is None}


def _reset_iter_state(rank: int, world: int, impl: str) -> dict:
    """An exception inside forward, then one inside backward (after a unit's reduce-scatter
    was issued), each followed by reset_iter_state() on the root and zero_grad(); then exact
    training: a reduction still in flight is dropped, not added to the next step's gradients."""
    torch.manual_seed(0)
    ref = ChunkNet()
    model = copy.deepcopy(ref)
    _shard_chunk_net(model, impl)
    idx = batches(1, world, seed=7)[0][rank]
    for where in ("forward", "backward"):
        model.armed = where
        with contextlib.suppress(RuntimeError):
            loss_of(model, idx).backward()
        model.armed = ""
        model.reset_iter_state()
        model.zero_grad(set_to_none=True)  # FSDP2 may have set some .grad before the raise
    return {"diff": _train_chunked(model, ref, rank, world, lambda m, x: loss_of(m, x).backward())}


class _AllGather:
    """FSDP2's custom all-gather interface, over torch's own collective; counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: Any, input_tensor: Any, group: Any, async_op: bool = False):
        self.calls += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group, async_op=async_op)


class _ReduceScatter(_AllGather):
    def __call__(  # type: ignore[override]
        self, output_tensor: Any, input_tensor: Any, group: Any, op: Any, async_op: bool = False
    ):
        self.calls += 1
        return dist.reduce_scatter_tensor(
            output_tensor, input_tensor, op=op, group=group, async_op=async_op
        )


def _custom_comms(rank: int, world: int, impl: str) -> dict:
    """set_custom_all_gather / set_custom_reduce_scatter on every unit, and the all-reduce hook."""
    ref, model = _setup()
    shard(model, impl)
    ag, rs, hooked = _AllGather(), _ReduceScatter(), [0]

    def hook(reduce_output: torch.Tensor) -> None:
        hooked[0] += 1

    units = [m for m in model.modules() if isinstance(m, api_of(impl).FSDPModule)]
    for m in units:
        m.set_custom_all_gather(ag)
        m.set_custom_reduce_scatter(rs)
        m.set_all_reduce_hook(hook)
    diff = _train_against(model, ref, rank, world)
    used = ag.calls > 0 and rs.calls > 0 and hooked[0] == rs.calls
    return {"diff": diff, "used": used}


def _share_comm_ctx(rank: int, world: int, impl: str) -> dict:
    """Two roots (pipeline chunks) sharing one communication context."""
    torch.manual_seed(0)
    ref = nn.Sequential(Block(), Block())
    model = copy.deepcopy(ref)
    api = api_of(impl)
    for stage in model:
        api.fully_shard(stage)
    share = getattr(api, "share_comm_ctx", None)
    if share is None:  # torch before share_comm_ctx
        from torch.distributed.fsdp import share_comm_ctx as share
    share(list(model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        xs = [torch.randn(2, 5, DIM, generator=g) for _ in range(world)]
        model(xs[rank]).square().mean().backward()
        for x in xs:
            ref(x).square().mean().backward()
        for p in ref.parameters():
            p.grad.div_(world)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    return {"diff": max_diff(dict(model.named_parameters()), dict(ref.named_parameters()))}


CASES: dict[str, Callable[[int, int, str], dict]] = {
    "fully_shard([embed, head]) tied": _tied,
    "tie across units refused": _tied_across_units,
    "model.to(float64) after fully_shard": _cast_after_init,
    "post-accumulate-grad hooks (optimizer in backward)": _optimizer_in_backward,
    "unshard(async_op=True) before the first forward (1F1B)": _one_f_one_b,
    "chunked loss through fully_shard([norm, head])": _chunked_loss,
    "reset_iter_state after an exception in forward, in backward": _reset_iter_state,
    "custom all-gather / reduce-scatter, all-reduce hook": _custom_comms,
    "share_comm_ctx (two roots)": _share_comm_ctx,
}


def run_all(
    cases: dict[str, Callable[[int, int, str], dict]], rank: int, world: int, impl: str
) -> dict[str, dict]:
    """Every case in turn, each in float64; one that raises reports it (``raised``) and does
    not hide the others."""
    out: dict[str, dict] = {}
    for name, case in cases.items():
        torch.set_default_dtype(torch.float64)
        try:
            out[name] = case(rank, world, impl)
        except Exception as exc:
            out[name] = {"diff": float("inf"), "raised": f"{type(exc).__name__}: {exc}"}
    return out


def gaps_program(rank: int, world: int, impl: str) -> dict[str, dict]:
    return run_all(CASES, rank, world, impl)
