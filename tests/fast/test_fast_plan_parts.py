"""The step-time and memory model's parts against counts made without the planner.

- FLOPs of a known block: a hand count of its matmuls and attention, and torch's own
  ``FlopCounterMode`` over its forward and backward (the backward's 2x matmuls, 2.5x attention);
- the bytes each checkpointing policy keeps (NOTE [Saved bytes per policy]) against what torch
  keeps on fake tensors: the tensors autograd saves (``saved_tensors_hooks``) without
  checkpointing, and the outputs selective checkpointing's caching mode stores (torchtitan's
  per-op policy) plus the block's input;
- the loss's transient (NOTE [The loss's transient]) against the peak of live tensor storage of a
  real cross-entropy on CPU (the profiler's allocator events).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from fullshard.observe.memory import profiler_live_peak
from fullshard.plan.transformer import TransformerShape

pytestmark = pytest.mark.fast

# a small Llama block: grouped-query attention (2 key/value heads for 4), SwiGLU
SHAPE = TransformerShape(hidden=64, layers=1, heads=4, kv_heads=2, head_dim=16, ffn=176, vocab=96)
BATCH, SEQ = 2, 24  # 48 tokens: no activation the size of a weight


class Block(nn.Module):
    """A Llama block written the way torchtitan's is (RMSNorm upcast to fp32, rotary positions
    as complex fp32 products, k/v repeated to every head, SDPA, SwiGLU), for this test only."""

    def __init__(self, s: TransformerShape, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.s = s

        def linear(i: int, o: int) -> nn.Linear:
            return nn.Linear(i, o, bias=False, dtype=dtype)

        self.wq, self.wk, self.wv = (
            linear(s.hidden, s.q_dim),
            *(linear(s.hidden, s.kv_dim) for _ in range(2)),
        )
        self.wo = linear(s.q_dim, s.hidden)
        self.w1, self.w2, self.w3 = (
            linear(s.hidden, s.ffn),
            linear(s.ffn, s.hidden),
            linear(s.hidden, s.ffn),
        )
        self.n1 = nn.Parameter(torch.ones(s.hidden, dtype=dtype))
        self.n2 = nn.Parameter(torch.ones(s.hidden, dtype=dtype))
        angles = torch.outer(torch.arange(SEQ).float(), torch.rand(s.head_dim // 2))
        self.register_buffer("freqs", torch.polar(torch.ones_like(angles), angles))

    @staticmethod
    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * w

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        out = torch.view_as_real(xc * self.freqs.view(1, SEQ, 1, -1)).flatten(3)
        return out.type_as(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, (b, t, _) = self.s, x.shape
        h = self.norm(x, self.n1)
        q = self.rotate(self.wq(h).view(b, t, s.heads, s.head_dim))
        k = self.rotate(self.wk(h).view(b, t, s.kv_heads, s.head_dim))
        v = self.wv(h).view(b, t, s.kv_heads, s.head_dim)
        rep = s.heads // s.kv_heads
        k, v = (
            z.unsqueeze(3)
            .expand(b, t, s.kv_heads, rep, s.head_dim)
            .reshape(b, t, s.heads, s.head_dim)
            for z in (k, v)
        )
        y = F.scaled_dot_product_attention(*(z.transpose(1, 2) for z in (q, k, v)), is_causal=True)
        x = x + self.wo(y.transpose(1, 2).contiguous().view(b, t, -1))
        h = self.norm(x, self.n2)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def _fake_block(dtype: torch.dtype) -> tuple[FakeTensorMode, Block, torch.Tensor]:
    """The block and its input in ``dtype`` as fake tensors: a storage size, no memory."""
    mode = FakeTensorMode()
    with mode:
        block = Block(SHAPE, dtype)
        x = torch.randn(BATCH, SEQ, SHAPE.hidden, dtype=dtype, requires_grad=True)
    return mode, block, x


def _storages(tensors: Any) -> dict[int, int]:
    out: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        out[st._cdata] = st.nbytes()
    return out


# -- FLOPs ---------------------------------------------------------------------------------
def test_block_flops_match_a_hand_count_and_torchs_counter() -> None:
    h, q, kv, f = 64, 64, 32, 176
    # by hand: 2 FLOPs per multiply-add, per token: q, k, v, o, then w1, w3, w2
    assert SHAPE.block_matmul_flops() == 2 * (h * q + h * kv + h * kv + q * h + 3 * h * f)
    # causal attention: QK^T and PV, 2 * seq * head_dim each per head and token, halved
    assert SHAPE.attention_flops(SEQ) == 2 * 2 * SEQ * q / 2
    assert SHAPE.head_flops() == 2 * h * 96
    block = Block(SHAPE)
    x = torch.randn(BATCH, SEQ, h, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        out = block(x)
    fwd = counter.get_flop_counts()["Global"]
    with FlopCounterMode(display=False) as counter:
        out.sum().backward()
    bwd = counter.get_flop_counts()["Global"]
    tokens = BATCH * SEQ
    mm = torch.ops.aten.mm
    assert fwd[mm] == tokens * SHAPE.block_matmul_flops()
    assert bwd[mm] == 2 * fwd[mm]  # backward: two GEMMs per forward GEMM
    # attention: torch's counts for the flash kernels (its CPU kernel is not counted, so the
    # formulas directly), which ignore the causal mask the planner's count halves
    q = (BATCH, SHAPE.heads, SEQ, SHAPE.head_dim)
    attn = sdpa_flop_count(q, q, q)
    assert attn == 2 * tokens * SHAPE.attention_flops(SEQ)
    assert sdpa_backward_flop_count(q, q, q, q) == 2.5 * attn  # the planner's backward ratio


# -- saved bytes per policy -------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_saved_bytes_without_checkpointing_are_what_autograd_saves(dtype: torch.dtype) -> None:
    mode, block, x = _fake_block(dtype)
    # (the block's input counts when saved: in fp32 the first norm saves it, as its "upcast")
    skip = _storages([*block.parameters(), *block.buffers()])
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    kept = {k: v for k, v in _storages(saved).items() if k not in skip}
    act = torch.finfo(dtype).bits // 8
    assert sum(kept.values()) == BATCH * SEQ * SHAPE.saved_bytes("none", act)


def _titan_policy(save: set[Any]) -> Any:
    """torchtitan's per-op policy: keep ``save``'s outputs, but every second matmul's."""
    meta: dict[str, int] = defaultdict(int)

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == torch.ops.aten.mm.default:
            meta[mode] += 1
        keep = func in save and not (func == torch.ops.aten.mm.default and meta[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _cached(caching_mode: Any) -> list[torch.Tensor]:
    """The tensors selective checkpointing's caching mode stored: per op, per call, the
    output (a wrapped tensor or a tuple of them) or a placeholder for recomputed ops."""
    found: list[torch.Tensor] = []
    for calls in caching_mode.storage.values():
        for out in calls.values():
            flat, _ = torch.utils._pytree.tree_flatten(out)
            vals = [getattr(w, "val", w) for w in flat]
            found += [v for v in vals if isinstance(v, torch.Tensor)]
    return found


def test_selective_checkpointing_keeps_what_the_policy_caches() -> None:
    mode, block, x = _fake_block(torch.bfloat16)
    # on a CPU, SDPA is its flash kernel for CPU: the policy's "attention" op here
    save = {
        torch.ops.aten.mm.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    }
    contexts = create_selective_checkpoint_contexts(_titan_policy(save))
    outer: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        outer.append(t)
        return t

    with mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        checkpoint(block, x, use_reentrant=False, context_fn=lambda: contexts)
    skip = _storages([*block.parameters(), *block.buffers()])
    kept = {k: v for k, v in _storages(_cached(contexts[0])).items() if k not in skip}
    # what checkpointing keeps: the block's input (saved for the recomputation: the one tensor
    # saved the usual way) and the outputs the policy cached
    assert _storages(outer) == _storages([x])
    kept.update(_storages(outer))
    assert sum(kept.values()) == BATCH * SEQ * SHAPE.saved_bytes("selective", 2)
    # full checkpointing keeps the input alone; compiled selective drops the last matmul's
    assert SHAPE.saved_bytes("full", 2) == 2 * SHAPE.hidden
    assert (
        SHAPE.saved_bytes("selective", 2) - SHAPE.saved_bytes("selective", 2, compiled=True)
        == 2 * SHAPE.hidden
    )


# -- the loss's transient ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_loss_peaks_match_a_measured_cross_entropy(dtype: torch.dtype) -> None:
    tokens, vocab = 512, 4096
    logits = torch.randn(tokens, vocab, dtype=dtype, requires_grad=True)
    targets = torch.randint(vocab, (tokens,))
    act = torch.finfo(dtype).bits // 8
    model = TransformerShape.loss_bytes(act)
    n = tokens * vocab

    def peak(backward: bool) -> float:
        """Peak bytes per logit above the logits (allocated before the profiler started)."""
        cpu = [torch.profiler.ProfilerActivity.CPU]
        with (
            torch.profiler.profile(activities=cpu, profile_memory=True) as prof,
            torch.profiler.record_function("loss"),
        ):
            loss = F.cross_entropy(logits.float() if act < 4 else logits, targets)
            if backward:
                loss.backward()
        found = profiler_live_peak(prof, "loss")
        assert found is not None
        logits.grad = None
        return found / n

    # the logits existed before (here a leaf; in a step the head's output, freed after the
    # loss's forward): the planner's forward peak counts them
    assert peak(backward=False) + act == pytest.approx(model.forward_peak, rel=0.01)
    # backward's peak (the logits' gradient, 16-bit, comes once the fp32 tensors are freed)
    assert peak(backward=True) == pytest.approx(model.backward_peak, rel=0.01)
