"""A decoder-only transformer as the planner counts it (layer 10): FLOPs, saved bytes, traffic.

:class:`TransformerShape` holds the numbers of a model's config (hidden size, layers, heads,
key/value heads, MLP width, vocabulary) and the block's family: a Llama block (RMSNorm, rotary
positions, grouped-query attention, SwiGLU MLP, no biases; torchtitan's and Hugging Face's) or a
GPT block (LayerNorm, learned positions, GELU MLP, biases; ``fullshard.app.models.gpt``). Every
figure is *per token* and per device under tensor parallel degree ``tp`` (sequence parallel
on); the step-time model and the memory walk multiply by the tokens a device holds.

NOTE [Saved bytes per policy]
What one block keeps for backward, per token (``act`` = bytes of the compute dtype):
- ``none``: every tensor autograd saves in eager PyTorch, counted op by op in
  :meth:`TransformerShape.saved_bytes` (the norms keep their fp32 upcast and rstd, SDPA its
  q, the repeated k and v, its output and the fp32 log-sum-exp, the MLP its four
  activations; rotary embeddings multiply by constants and keep nothing);
- ``full``: the block's input only (``torch.utils.checkpoint``), recomputed in backward;
- ``selective``: torchtitan's per-op policy: the outputs of every other matmul of the block
  (the 1st, 3rd, 5th, 7th: q, v, w1, w2 in a Llama block) and of attention are kept, the rest
  recomputed; plus the block's input. Under ``torch.compile`` the partitioner drops a kept
  output nothing in backward reads (the last matmul's, which only feeds the residual sum).
tests/fast/test_fast_plan_parts.py counts the same with torch's own checkpoint on fake tensors.

NOTE [The loss's transient]
Cross-entropy over a large vocabulary is the largest single transient of a language model's
step. With 16-bit logits upcast to fp32 (``lm_loss``, torchtitan's loss), forward briefly holds
the 16-bit logits, their fp32 copy and the fp32 log-probabilities (``act + 8`` B per logit) and
keeps the log-probabilities (4 B); backward holds them, the gradient of the log-probabilities
and that of the logits (12 B). Under loss parallel (DTensor's ``loss_parallel``, logits split by
vocabulary) forward also holds ``x - max`` and its ``exp`` (``act + 12``), and the fused backward
``(onehot + exp(x)) * grad`` holds four fp32 tensors (16 B). Measured on CPU in
tests/fast/test_fast_plan_parts.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["POLICIES", "LossBytes", "TransformerShape", "shape_of"]

POLICIES = ("none", "selective", "full")
FP32 = 4  # the norms' and rotary embeddings' internal upcast, softmax statistics


@dataclass(frozen=True)
class LossBytes:
    """Cross-entropy's memory per logit (NOTE [The loss's transient]): what it keeps from
    forward to backward, and its peaks in forward and in backward (the kept bytes included)."""

    saved: float
    forward_peak: float
    backward_peak: float


@dataclass(frozen=True)
class TransformerShape:
    """The numbers of a decoder-only transformer that time and memory depend on.

    ``family``: ``llama`` (RMSNorm, rotary, SwiGLU, no biases) or ``gpt`` (LayerNorm, learned
    positions, GELU MLP, biases). ``ffn``: the MLP's inner width. ``positions``: rows of a
    learned position table (0 for rotary).
    """

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    family: str = "llama"
    positions: int = 0
    tied: bool = False

    def __post_init__(self) -> None:
        if self.family not in ("llama", "gpt"):
            raise ValueError(f"transformer family {self.family!r}: llama or gpt")
        dims = (self.hidden, self.layers, self.heads, self.kv_heads, self.head_dim, self.ffn)
        if min(*dims, self.vocab) < 1 or self.heads % self.kv_heads:
            raise ValueError(f"not a transformer shape: {self}")

    # -- sizes ------------------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def gated(self) -> bool:
        return self.family == "llama"

    def matmuls(self) -> list[tuple[int, int, bool]]:
        """The block's linear layers in the order forward runs them: ``(in, out, row_parallel)``
        (row-parallel: split by input under tensor parallel, its output summed)."""
        h, q, kv, f = self.hidden, self.q_dim, self.kv_dim, self.ffn
        attn = [(h, q, False), (h, kv, False), (h, kv, False), (q, h, True)]
        mlp = (
            [(h, f, False), (h, f, False), (f, h, True)]
            if self.gated
            else [(h, f, False), (f, h, True)]
        )
        return attn + mlp

    def block_params(self) -> int:
        """Parameters of one block (weights, norms, biases)."""
        mm = sum(i * o for i, o, _ in self.matmuls())
        if self.gated:
            return mm + 2 * self.hidden  # two RMSNorm weights
        biases = sum(o for _, o, _ in self.matmuls())
        return mm + biases + 4 * self.hidden  # two LayerNorms with bias

    def root_params(self) -> int:
        """Parameters outside the blocks: embeddings, the final norm, the output head."""
        norm = self.hidden * (1 if self.gated else 2)
        head = 0 if self.tied else self.vocab * self.hidden
        return (self.vocab + self.positions) * self.hidden + norm + head

    def params(self) -> int:
        return self.layers * self.block_params() + self.root_params()

    def matmul_params(self) -> int:
        """Parameters that multiply activations: every block's linear weights and the head
        (the embedding is a lookup). ``6 x`` this per token is a step's matmul FLOPs."""
        return self.layers * sum(i * o for i, o, _ in self.matmuls()) + self.vocab * self.hidden

    # -- FLOPs per token (forward; backward is twice the matmuls, 2.5x attention) -------------
    def block_matmul_flops(self, tp: int = 1) -> float:
        """Forward FLOPs of one block's linear layers per token on one device."""
        return 2.0 * sum(i * o for i, o, _ in self.matmuls()) / tp

    def recompute_matmul_flops(self, policy: str, tp: int = 1) -> float:
        """Forward matmul FLOPs per token that ``policy`` runs again in backward."""
        if policy == "full":
            return self.block_matmul_flops(tp)
        if policy == "selective":  # the even-numbered matmuls (2nd, 4th, ...) are recomputed
            return 2.0 * sum(i * o for i, o, _ in self.matmuls()[1::2]) / tp
        return 0.0

    def attention_flops(self, seq: int, tp: int = 1) -> float:
        """Forward FLOPs of causal attention per token of a ``seq``-token sequence: QK^T and PV,
        ``2 * 2 * seq * q_dim`` each token, halved by the causal mask (flash attention skips the
        masked blocks). Context parallel splits a sequence's tokens, not this per-token cost."""
        return 2.0 * seq * self.q_dim / tp

    def head_flops(self, tp: int = 1) -> float:
        """Forward FLOPs of the output head per token."""
        return 2.0 * self.hidden * self.vocab / tp

    # -- memory ------------------------------------------------------------------------------
    def saved_bytes(self, policy: str, act: int, tp: int = 1, *, compiled: bool = False) -> float:
        """Bytes one block keeps for backward per token (NOTE [Saved bytes per policy]).

        ``tp`` > 1 is tensor parallel with sequence parallel: norms and the block's input are
        split by sequence, the linears' inputs are the gathered (whole) sequence, the rest split
        by heads or MLP columns."""
        if policy not in POLICIES:
            raise ValueError(f"activation checkpointing {policy!r}: one of {', '.join(POLICIES)}")
        h, q, kv, f = self.hidden, self.q_dim, self.kv_dim, self.ffn
        block_input = act * h / tp
        if policy == "full":
            return block_input
        lse = FP32 * self.heads / tp
        if policy == "selective":
            kept = self.matmuls()[0::2]
            if compiled and len(self.matmuls()) % 2:  # the last matmul's output is kept: dropped
                kept = kept[:-1]
            outs = sum(act * (o if not row or tp == 1 else o * tp) / tp for _, o, row in kept)
            # under TP a row-parallel output is reduce-scattered; that output is kept too
            scattered = sum(act * o / tp for _, o, row in kept if row and tp > 1)
            return block_input + outs + scattered + act * q / tp + lse
        gathered = act * h  # what the linears save: the norm's output, whole under SP
        if self.gated:
            # per RMSNorm: the fp32 upcast, its rstd, the normalized input of the weight's
            # product (the rotation multiplies by constants: it keeps nothing)
            norms = 2 * (FP32 * h + FP32 + act * h) / tp
            # SDPA: rotated q, k and v repeated to every head, output, log-sum-exp
            attention = act * 4 * q / tp + lse
            mlp = 4 * act * f / tp  # w1 out (silu's input), silu out, w3 out, their product
            return norms + 2 * gathered + attention + mlp
        norms = 2 * (act * h + 2 * FP32) / tp  # LayerNorm keeps its input, mean and rstd
        attention = act * (2 * q + 2 * kv) / tp + lse  # SDPA: q, k, v and its output
        mlp = 2 * act * f / tp  # GELU's input and output
        return norms + 2 * gathered + attention + mlp

    def memory_traffic(self, act: int, tp: int = 1, *, compiled: bool = False) -> float:
        """HBM bytes one block's forward moves per token outside matmuls and attention
        (norms, rotary embeddings, the k/v repeat, activation functions, residual sums): each
        eager op reads its inputs and writes its output; compiled, each fused region reads and
        writes once. Backward moves about twice as much."""
        h, q, kv, f = self.hidden, self.q_dim, self.kv_dim, self.ffn
        if compiled:
            norms = 2 * 4 * act * h  # residual sum + norm, fused: 2 reads, 2 writes
            if self.gated:  # rotary + repeat fused; silu(w1) * w3 fused
                return (norms + act * (4 * q + 2 * kv) + 3 * act * f) / tp
            return (norms + 2 * act * f + 2 * act * q) / tp
        residual = 2 * 3 * act * h
        if self.gated:
            cast = 0 if act == FP32 else 2 * act  # x.float() and .type_as(x)
            norms = 2 * (6 * FP32 + cast + 2 * act) * h
            rotary = (2 * FP32 + cast) * (q + kv)
            repeat = 2 * act * (kv + q) if self.kv_heads != self.heads else 0
            return (norms + rotary + repeat + residual + 5 * act * f) / tp
        # LayerNorm (one kernel each), GELU, the attention output's transpose copy
        return (2 * 2 * act * h + 2 * act * f + 2 * act * q + residual) / tp

    def eager_ops(self) -> int:
        """Kernels one block's forward launches in eager PyTorch (its host cost)."""
        return 40 if self.gated else 24

    @staticmethod
    def loss_bytes(act: int, *, parallel: bool = False, compiled: bool = False) -> LossBytes:
        """Cross-entropy's bytes per logit (NOTE [The loss's transient]); ``act``: the logits'
        dtype bytes (upcast to fp32 when smaller), ``parallel``: loss parallel, ``compiled``:
        a torch.compile'd loss (upcast, log-softmax and its backward fused: it keeps the logits
        and a log-sum-exp per token, and backward writes their gradient in one pass)."""
        # the logits themselves (the head's output, freed once the loss has read them) and,
        # when 16-bit, their fp32 copy
        inputs = act + (FP32 if act < FP32 else 0)
        if compiled:
            return LossBytes(act, act, 2 * act)
        if parallel:  # x - max and its exp beside them; backward: onehot, exp(x), their sum
            return LossBytes(FP32, inputs + 2 * FP32, 4 * FP32)
        return LossBytes(FP32, inputs + FP32, 3 * FP32)

    @staticmethod
    def loss_traffic(act: int, *, compiled: bool = False) -> float:
        """HBM bytes cross-entropy moves per logit, forward and backward (eager: the upcast,
        the log-softmax's two passes, its backward, the cast back; compiled: two reads forward,
        a read and a write backward)."""
        if compiled:
            return 4.0 * act
        cast = 0 if act == FP32 else FP32 + act
        return 2 * cast + 3 * FP32 + 4 * FP32

    def label(self) -> dict[str, int]:
        return {
            "hidden": self.hidden,
            "layers": self.layers,
            "heads": self.heads,
            "kv_heads": self.kv_heads,
            "ffn": self.ffn,
            "vocab": self.vocab,
        }


def _from_hf(config: Any, vocab: int | None) -> TransformerShape | None:
    hidden = getattr(config, "hidden_size", None)
    heads = getattr(config, "num_attention_heads", None)
    layers = getattr(config, "num_hidden_layers", None)
    ffn = getattr(config, "intermediate_size", None)
    if not all(isinstance(v, int) for v in (hidden, heads, layers, ffn)):
        return None
    assert isinstance(hidden, int) and isinstance(heads, int)
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    act = str(getattr(config, "hidden_act", "silu"))
    return TransformerShape(
        hidden=hidden,
        layers=int(layers),  # type: ignore[arg-type]
        heads=heads,
        kv_heads=int(kv),
        head_dim=int(head_dim),
        ffn=int(ffn),  # type: ignore[arg-type]
        vocab=int(vocab or getattr(config, "vocab_size", None) or 0),
        family="llama" if act in ("silu", "swish") else "gpt",
        tied=bool(getattr(config, "tie_word_embeddings", False)),
    )


def shape_of(model: nn.Module, vocab: int | None = None) -> TransformerShape | None:
    """The shape of a built model: ``fullshard.app.models.gpt.GPT`` (its ``cfg``) or a Hugging
    Face decoder (its ``config``); ``None`` for anything else (the planner then has no step
    time). ``vocab``: the logits per token, when the model's own differ (``--vocab``)."""
    cfg = getattr(model, "cfg", None)
    if cfg is not None and hasattr(cfg, "d_model") and hasattr(cfg, "n_head"):
        d = int(cfg.d_model)
        return TransformerShape(
            hidden=d,
            layers=int(cfg.n_layer),
            heads=int(cfg.n_head),
            kv_heads=int(cfg.n_head),
            head_dim=d // int(cfg.n_head),
            ffn=int(cfg.mlp_ratio) * d,
            vocab=int(vocab or cfg.vocab_size),
            family="gpt",
            positions=int(cfg.max_seq_len),
            tied=bool(cfg.tie_embeddings),
        )
    config = getattr(model, "config", None)
    return None if config is None else _from_hf(config, vocab)
