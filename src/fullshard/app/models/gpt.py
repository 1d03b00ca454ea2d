"""A GPT-style decoder-only transformer with named sizes, and a sampler.

Each transformer block is one FSDP unit (``model.blocks`` is a ``ModuleList`` of :class:`Block`);
the embeddings, final norm and LM head stay in the root unit. The LM head is untied by default:
a tied head would share one parameter between the first and last layers, which is only legal when
both live in the same unit (the root), and untied keeps every unit's parameters disjoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GPT",
    "GPTConfig",
    "MODEL_SIZES",
    "Block",
    "build_model",
    "count_params",
    "generate",
    "lm_loss",
    "logits_of",
    "model_context_length",
    "output_vocab_size",
    "resolve_model_spec",
    "unit_types_of",
]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a :class:`GPT`. ``vocab_size`` is usually overridden by the tokenizer's."""

    n_layer: int
    n_head: int
    d_model: int
    max_seq_len: int
    vocab_size: int = 256
    mlp_ratio: int = 4
    tie_embeddings: bool = False
    bias: bool = True


# Named sizes. Parameter counts below are with the byte-level vocabulary (256); a larger vocabulary
# adds 2 * vocab * d_model (embedding + untied head).
MODEL_SIZES: dict[str, GPTConfig] = {
    # ~0.2M: unit tests, a few seconds per run.
    "tiny": GPTConfig(n_layer=3, n_head=4, d_model=64, max_seq_len=128),
    # ~1.3M: the CPU demo, learns readable byte-level English in a few minutes on 2 cores.
    "demo": GPTConfig(n_layer=6, n_head=4, d_model=128, max_seq_len=256),
    # ~10M: the bench model (sequence length 128).
    "small": GPTConfig(n_layer=8, n_head=5, d_model=320, max_seq_len=256),
    # GPT-2 small shape: 124M with GPT-2's 50257-token vocabulary and tied head (163M untied).
    "gpt2-124m": GPTConfig(n_layer=12, n_head=12, d_model=768, max_seq_len=1024),
    # ~1B and ~6.5B: GPU configurations (build them on GPUs; they do not fit a CPU demo).
    "1b": GPTConfig(n_layer=20, n_head=16, d_model=2048, max_seq_len=2048),
    "7b": GPTConfig(n_layer=32, n_head=32, d_model=4096, max_seq_len=2048),
}


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``scaled_dot_product_attention``.

    q, k and v are separate matrices (not one fused ``qkv``) so that tensor parallel can split
    them by heads (``fullshard train --tp``): the head count is read off the tensors, so a rank
    holding some of the heads runs the same code.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_head != 0:
            raise ValueError(f"d_model={cfg.d_model} is not divisible by n_head={cfg.n_head}")
        self.n_head = cfg.n_head
        self.head_dim = cfg.d_model // cfg.n_head
        self.q = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.k = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.v = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # (b, t, heads * head_dim) -> (b, heads, t, head_dim); heads: this rank's, under TP
        q, k, v = (
            z(x).view(b, t, -1, self.head_dim).transpose(1, 2) for z in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """Position-wise feed-forward: Linear -> GELU -> Linear."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: the unit of sharding."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer: token + learned position embeddings, blocks, final norm, head.

    ``forward(idx)`` maps token ids ``(batch, seq)`` to logits ``(batch, seq, vocab)``.
    """

    def __init__(self, cfg: GPTConfig, *, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_embed = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_embed.weight
        self.reset_parameters(seed)

    @property
    def unit_types(self) -> tuple[type[nn.Module], ...]:
        """Module classes that become one FSDP unit each."""
        return (Block,)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Deterministic GPT-2 style init from ``seed``, independent of the global RNG.

        A private generator makes every rank build bit-identical weights before sharding, whatever
        else touched the global RNG. Residual output projections are scaled by 1/sqrt(2 * n_layer)
        so the residual stream's variance does not grow with depth.
        """
        device = self.tok_embed.weight.device
        gen = torch.Generator(device=device if device.type != "meta" else "cpu").manual_seed(seed)
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, p in self.named_parameters():
            if p.device.type == "meta":
                continue
            if name.endswith("bias"):
                p.zero_()
            elif ".ln_" in name or name.startswith("ln_"):
                p.fill_(1.0)
            else:
                std = resid_std if name.endswith("proj.weight") else 0.02
                p.normal_(0.0, std, generator=gen)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's {self.cfg.max_seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok_embed(idx) + self.pos_embed(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def unit_types_of(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The module classes of ``model`` that become one FSDP unit each (its ``unit_types``)."""
    types = getattr(model, "unit_types", None)
    if not isinstance(types, tuple) or not types:
        raise TypeError(f"{type(model).__name__} does not say which modules are its units")
    return types


def count_params(model: nn.Module) -> int:
    """Number of distinct parameter elements (tied parameters counted once)."""
    return sum(p.numel() for p in model.parameters())


def resolve_model_spec(spec: str) -> tuple[str, str]:
    """Classify a ``--model`` value as ``("gpt", name)`` or ``("hf", name_or_dir)``.

    ``hf:NAME`` selects a built-in Hugging Face config, ``hf:DIR`` or a directory holding a
    ``config.json`` a local Hugging Face config or checkpoint. Raises ``ValueError`` listing the
    known names for anything else.
    """
    if spec.startswith("hf:"):
        return "hf", spec[3:]
    if spec in MODEL_SIZES:
        return "gpt", spec
    if (Path(spec) / "config.json").is_file():
        return "hf", spec
    from fullshard.app.models.hf import HF_CONFIGS  # light: no transformers import at module level

    known = ", ".join(MODEL_SIZES)
    hf_known = ", ".join(f"hf:{n}" for n in HF_CONFIGS)
    raise ValueError(
        f"unknown model {spec!r}. Built-in models: {known}. Hugging Face configs (need "
        f"`pip install fullshard[hf]`): {hf_known}, or hf:/path/to/dir (a local directory with a "
        "config.json, optionally with weights)."
    )


def build_model(
    name_or_path: str,
    vocab_size: int,
    *,
    seed: int = 0,
    device: torch.device | str | None = None,
    lazy_weights: bool = False,
) -> nn.Module:
    """Build a model by size name (see :data:`MODEL_SIZES`) or Hugging Face spec.

    The returned module has a ``unit_types`` attribute or property naming the classes that become
    one FSDP unit each. Weights are initialised deterministically from ``seed``.
    ``lazy_weights``: a local Hugging Face directory with safetensors weights comes back with its
    parameters on the meta device, its weights loaded only when ``fullshard.app.models.wrap.shard_model``
    shards it (each rank reads its own rows); for callers that shard what they build.
    """
    kind, name = resolve_model_spec(name_or_path)
    if kind == "hf":
        from fullshard.app.models.hf import build_hf_model

        return build_hf_model(name, vocab_size, seed=seed, device=device, lazy_weights=lazy_weights)
    cfg = replace(MODEL_SIZES[name], vocab_size=vocab_size)
    with torch.device(device or "cpu"):
        return GPT(cfg, seed=seed)


def model_context_length(model: nn.Module) -> int | None:
    """The longest sequence ``model`` accepts, when it says so."""
    if isinstance(model, GPT):
        return model.cfg.max_seq_len
    config = getattr(model, "config", None)
    for attr in ("max_position_embeddings", "n_positions"):
        value = getattr(config, attr, None)
        if isinstance(value, int):
            return value
    return None


def output_vocab_size(model: nn.Module) -> int:
    """The number of logits ``model`` produces per token, read off its output layer (no forward:
    the model may still be on the meta device)."""
    if isinstance(model, GPT):
        return model.cfg.vocab_size
    get = getattr(model, "get_output_embeddings", None)
    weight = getattr(get() if callable(get) else None, "weight", None)
    if isinstance(weight, torch.Tensor):
        return int(weight.shape[0])
    raise TypeError(f"cannot tell the output vocabulary of {type(model).__name__}")


def logits_of(output: object) -> torch.Tensor:
    """Logits from a model's output: a tensor, or a Hugging Face output with ``.logits``."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"model returned {type(output).__name__}, expected logits")
    return logits


def lm_loss(
    model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor | None = None
) -> torch.Tensor:
    """The language-model loss of every command: cross entropy of the next token.

    ``targets`` default to the inputs shifted by one (then the model sees all but the last
    token). bf16/fp16 logits are upcast to fp32: a 16-bit softmax over a large vocabulary loses
    the small probabilities the gradient needs (fp64 stays fp64, for exact tests).
    """
    if targets is None:
        inputs, targets = inputs[:, :-1], inputs[:, 1:]
    logits = logits_of(model(inputs))
    if logits.element_size() < 4:
        logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    n: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    *,
    generator: torch.Generator | None = None,
    context: int | None = None,
) -> torch.Tensor:
    """Sample ``n`` tokens after ``prompt_ids`` (shape ``(seq,)`` or ``(batch, seq)``).

    Recomputes the whole (cropped) context each step: no KV cache, which keeps this correct for
    any model, sharded or not. Under FSDP every rank must call it with the same shapes and ``n``
    (each forward gathers parameters); pass the same seeded ``generator`` on every rank to get
    the same text everywhere. ``temperature <= 0`` means greedy decoding. ``context``: read at
    most that many tokens back (default: the model's positions); a model trained on shorter
    sequences than its positions has never learned to read past them.
    """
    was_training = model.training
    model.eval()
    ids = prompt_ids.unsqueeze(0) if prompt_ids.dim() == 1 else prompt_ids
    ctx = model_context_length(model)
    if context is not None:
        ctx = context if ctx is None else min(ctx, context)
    try:
        for _ in range(n):
            window = ids if ctx is None else ids[:, -ctx:]
            logits = logits_of(model(window))[:, -1, :].float()
            if temperature <= 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None and top_k < logits.shape[-1]:
                    kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = torch.softmax(logits, dim=-1)
                nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(ids.device)
            ids = torch.cat([ids, nxt], dim=1)
    finally:
        model.train(was_training)
    return ids[0] if prompt_ids.dim() == 1 else ids
