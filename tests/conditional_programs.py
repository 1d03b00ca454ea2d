"""Programs whose ranks run different parts of the model (issue 34), and one process on the
union of their data to compare with.

- ``MoELM``: a mixture-of-experts language model written as research code and older
  checkpoints write it: one module per expert (``nn.ModuleList``), top-2 routing, and a
  Switch-style load-balancing loss. With few tokens per rank, each rank's tokens reach only some
  experts: parameters that some ranks (or none) used in a step.
- ``tiny_llava()``: Hugging Face's LLaVA (a CLIP vision tower, a projector, a Llama decoder)
  built from a local config; only some ranks' batches carry an image, so the vision tower runs
  on those ranks only.

``train(...)`` trains a sharded copy and a one-process reference on the same batches (the
reference's loss is the mean of the ranks' losses, as data parallelism defines it) and returns
the largest difference of the parameters after each step, with what each rank ran.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fullshard import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

VOCAB, DIM, TOKENS = 32, 8, 2


class Expert(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class MoELayer(nn.Module):
    """Top-2 routing over per-expert modules; ``aux`` is the load-balancing loss (Switch
    Transformer's: experts x sum of fraction routed x mean router probability)."""

    def __init__(self, dim: int, experts: int = 8, top_k: int = 2) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim) for _ in range(experts))
        self.top_k = top_k
        self.aux = torch.zeros(())
        self.used: set[int] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        probs = self.router(h).softmax(-1)
        top_p, top_i = probs.topk(self.top_k, dim=-1)
        top_p = top_p / top_p.sum(-1, keepdim=True)
        out = torch.zeros_like(h)
        self.used = set()
        for e, expert in enumerate(self.experts):
            rows, slot = (top_i == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue  # no token of this rank reaches expert e: it gets no gradient here
            self.used.add(e)
            out = out.index_add(0, rows, top_p[rows, slot, None] * expert(h[rows]))
        n = len(self.experts)
        frac = F.one_hot(top_i, n).sum(1).to(h.dtype).mean(0)
        self.aux = n * (frac * probs.mean(0)).sum() / self.top_k
        return x + out


class MoELM(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(MoELayer(DIM) for _ in range(layers))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def moe_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["idx"])
    aux = sum(layer.aux for layer in _inner(model).layers)
    return F.cross_entropy(logits, batch["target"]) + 0.01 * aux


def moe_batches(steps: int, micro: int, world: int) -> list[list[list[dict[str, Any]]]]:
    """``[step][micro-batch][rank]``: ``TOKENS`` tokens per rank, the same on every rank."""
    g = torch.Generator().manual_seed(1234)

    def one() -> dict[str, Any]:
        idx = torch.randint(0, VOCAB, (TOKENS,), generator=g)
        return {"idx": idx, "target": torch.randint(0, VOCAB, (TOKENS,), generator=g)}

    return [[[one() for _ in range(world)] for _ in range(micro)] for _ in range(steps)]


def _inner(model: nn.Module) -> Any:
    return getattr(model, "_orig_mod", model)


def shard_moe(model: MoELM, how: str, world: int) -> MoELM:
    """Shard per ``how``: each MoE layer one unit (router and every expert), with a variant's
    policy; ``experts_optional``: each expert its own unit, declared optional."""
    kw: dict[str, Any] = {}
    if how == "mixed":  # compute in float32, reduce in float64
        kw["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.float32, reduce_dtype=torch.float64
        )
    if how == "offload":
        kw["offload_policy"] = CPUOffloadPolicy()
    if how == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh

        kw["mesh"] = init_device_mesh("cpu", (2, world // 2))
    for layer in model.layers:
        if how == "experts_optional":
            for expert in layer.experts:
                fully_shard(expert, **kw)
                expert.set_optional()  # type: ignore[operator]
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    if how == "deterministic":
        for m in model.modules():
            if hasattr(m, "set_fixed_order_reduction"):
                m.set_fixed_order_reduction()
    return model


def tiny_llava() -> nn.Module:
    """LLaVA at a tiny size from a local config (nothing downloaded), in float64."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig
    from transformers import LlavaForConditionalGeneration as Llava

    vision = CLIPVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=8,
        patch_size=4,
        projection_dim=16,
    )
    text = LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
        max_position_embeddings=64,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=63,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
    )
    return Llava(config).double()


IMAGE_TOKEN, PATCHES = 63, 4  # (8 / 4) ** 2 patches per image


def vlm_batches(images: list[list[bool]]) -> list[list[list[dict[str, Any]]]]:
    """``images[step][rank]``: whether that rank's batch carries an image."""
    g = torch.Generator().manual_seed(99)
    out = []
    for row in images:
        step = []
        for has in row:
            ids = torch.randint(0, 60, (1, 10), generator=g)
            batch: dict[str, Any] = {"input_ids": ids, "labels": ids.clone()}
            if has:
                ids[:, 1 : 1 + PATCHES] = IMAGE_TOKEN
                batch["labels"][:, 1 : 1 + PATCHES] = -100
                batch["pixel_values"] = torch.randn(1, 3, 8, 8, generator=g, dtype=torch.float64)
            step.append(batch)
        out.append([step])
    return out


def vlm_loss(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    return model(**batch).loss  # type: ignore[no-any-return]


def shard_vlm(model: nn.Module, optional: bool) -> nn.Module:
    """Each decoder layer a unit, the vision tower and projector one unit ('vision_tower.encoder':
    optional, unless ``optional`` is False, the undeclared skip), the rest the root."""
    inner = model.model  # type: ignore[union-attr]
    for layer in inner.language_model.layers:
        fully_shard(layer)
    # the tower's encoder (its patch embedding stays in the root: parameters some ranks did not
    # use): transformers 5 finds the hidden states to record by the tower's class name, which
    # fully_shard's class swap (FSDP2's too) would change
    tower = inner.vision_tower.encoder
    fully_shard([tower, inner.multi_modal_projector])
    if optional:
        tower.set_optional()
    fully_shard(model)
    return model


def train(
    rank: int,
    world: int,
    build: Callable[[], nn.Module],
    shard: Callable[[nn.Module], nn.Module],
    loss_of: Callable[[nn.Module, Any], torch.Tensor],
    data: list[list[list[Any]]],
    ref_dtype: torch.dtype | None = None,
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
    syncs: list[int] | None = None,
) -> dict[str, Any]:
    """Train ``shard(build())`` and one process on ``data`` ([step][micro][rank]) with AdamW
    (weight decay on, so a zero gradient where one process has None would show); returns the
    largest parameter difference after each step. ``ref_dtype``: the reference computes each
    rank's gradient in this dtype and sums in float64 (mixed precision's reference).
    ``syncs`` (under the CUDA emulation): gets the host synchronisations fullshard made in each
    step of the sharded model (the model's own, e.g. the router's ``nonzero``, left out)."""
    torch.manual_seed(0)
    ref = build()
    torch.manual_seed(0)
    model = shard(build())  # the same weights (no deepcopy: the CUDA emulation refuses it)
    optimizer = optimizer or (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1))
    opt, ref_opt = optimizer(model.parameters()), optimizer(ref.parameters())
    names = [n for n, _ in ref.named_parameters()]
    diffs, used = [], []
    for step in data:
        if syncs is not None:
            from fullshard.testing import emulation

            emulation.reset_sync_counts()
        micro = len(step)
        for m, batches in enumerate(step):
            if micro > 1:
                model.set_requires_gradient_sync(m == micro - 1)  # type: ignore[operator]
            (loss_of(model, batches[rank]) / micro).backward()
        opt.step()
        opt.zero_grad()
        if syncs is not None:
            counts = emulation.sync_counts().items()
            syncs.append(sum(n for (_, site), n in counts if "fullshard" in site))
        step_used = []
        for batches in step:
            for batch in batches:
                _reference_backward(ref, loss_of, batch, world * micro, ref_dtype)
                step_used.append([sorted(x.used) for x in ref.modules() if hasattr(x, "used")])
        used.append(step_used)
        ref_opt.step()
        ref_opt.zero_grad()
        mine = dict(model.named_parameters())
        diffs.append(
            max(
                float((mine[n].full_tensor() - p).detach().abs().max()) if p.numel() else 0.0
                for n, p in zip(names, ref.parameters(), strict=True)
            )
        )
    return {"diffs": diffs, "used": used}


def _reference_backward(
    ref: nn.Module,
    loss_of: Callable[[nn.Module, Any], torch.Tensor],
    batch: Any,
    n: int,
    dtype: torch.dtype | None,
) -> None:
    """One rank's share of the one-process step: its loss / ``n``, backward into ``ref``."""
    if dtype is None:
        (loss_of(ref, batch) / n).backward()
        return
    low = copy.deepcopy(ref).to(dtype)
    low.zero_grad(set_to_none=True)
    loss_of(low, batch).backward()
    for p, q in zip(ref.parameters(), low.parameters(), strict=True):
        if q.grad is not None:
            g = q.grad.to(p.dtype) / n
            p.grad = g if p.grad is None else p.grad + g
    for a, b in zip(ref.modules(), low.modules(), strict=True):
        if hasattr(b, "used"):
            a.used = b.used


def emulated(rank: int, world: int, case: str) -> dict[str, Any]:
    """``case`` (``moe``: an MoE layer per unit; ``experts``: each expert an optional unit;
    ``vlm``: the optional vision tower) on the CUDA code path under the emulation, against one
    process (SGD: on the CUDA path a parameter no rank used gets an exact zero, NOTE [Which
    gradients exist], which plain SGD leaves as None does). Returns the differences, the
    checker's ordering error (or None) and fullshard's host synchronisations per step."""
    from fullshard.testing import emulation

    syncs: list[int] = []
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    try:
        with emulation.cuda_emulation(all_device=True):
            if case == "vlm":
                some = [r == 0 for r in range(world)]
                out = train(
                    rank,
                    world,
                    tiny_llava,
                    lambda m: shard_vlm(m, True),
                    vlm_loss,
                    vlm_batches([some, [False] * world, some]),
                    optimizer=sgd,
                    syncs=syncs,
                )
            else:
                how = "experts_optional" if case == "experts" else "plain"
                out = train(
                    rank,
                    world,
                    lambda: MoELM().double(),
                    lambda m: shard_moe(m, how, world),  # type: ignore[arg-type]
                    moe_loss,
                    moe_batches(3, 1, world),
                    optimizer=sgd,
                    syncs=syncs,
                )
    except emulation.StreamOrderError as exc:
        return {"error": str(exc)}
    return {"error": None, "diffs": out["diffs"], "syncs": syncs}
