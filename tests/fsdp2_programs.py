"""FSDP2-style programs, each run under torch's ``fully_shard`` or fullshard's (``impl``), beside a
one-process reference on the same data in float64. Each returns the largest difference from
the reference (and whatever else its test checks). Used by ``tests/test_fsdp2_compat.py``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from toy import Block, batches, loss_of

VOCAB, DIM = 37, 12


class Net(nn.Module):
    """Embedding, two blocks, a head; ``generate`` calls the parts without ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, n: int) -> torch.Tensor:
        for _ in range(n):
            x = self.embed(idx)  # the root's parameters, used outside forward
            for b in self.blocks:
                x = b(x)
            nxt = self.head(self.norm(x))[:, -1].argmax(-1, keepdim=True)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


def fully_shard_of(impl: str) -> Any:
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from fullshard import fully_shard
    return fully_shard


def api_of(impl: str) -> Any:
    if impl == "torch":
        import torch.distributed.fsdp as api
    else:
        import fullshard as api
    return api


def shard(model: Net, impl: str, **kw: Any) -> Net:
    fully_shard = fully_shard_of(impl)
    for b in model.blocks:
        fully_shard(b, **kw)
    fully_shard(model, **{k: v for k, v in kw.items() if k != "reshard_after_forward"})
    return model


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((full(a[k]).double() - full(b[k]).double()).abs().max()) for k in a)


def _setup(seed: int = 0) -> tuple[Net, Net]:
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(seed)
    ref = Net()
    return ref, copy.deepcopy(ref)


def _ref_step(ref: nn.Module, data: list[torch.Tensor], world: int) -> None:
    for r in range(world):
        loss_of(ref, data[r]).backward()
    for p in ref.parameters():
        if p.grad is not None:
            p.grad.div_(world)


def _train_against(
    model: nn.Module, ref: nn.Module, rank: int, world: int, steps: int = 2
) -> float:
    """``steps`` AdamW steps of the sharded model and of one process; the largest difference."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    data = batches(steps, world)
    for step in range(steps):
        loss_of(model, data[step][rank]).backward()
        _ref_step(ref, data[step], world)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    return max_diff(dict(model.named_parameters()), dict(ref.named_parameters()))


def clip_program(rank: int, world: int, impl: str) -> dict:
    """torch's clip_grad_norm_ over sharded gradients: the global norm, every step."""
    ref, model = _setup()
    shard(model, impl)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    data = batches(3, world)
    norm_diff = 0.0
    for step in range(3):
        loss_of(model, data[step][rank]).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        _ref_step(ref, data[step], world)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        norm_diff = max(norm_diff, abs(float(full(norm)) - float(ref_norm)))
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    params = max_diff(dict(model.named_parameters()), dict(ref.named_parameters()))
    return {"diff": max(norm_diff, params), "norm_diff": norm_diff}


def dcp_program(rank: int, world: int, impl: str) -> dict:
    """torch DCP state dicts with StateDictOptions, and fullshard's own, against one process."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    ref, model = _setup()
    model.blocks[1].proj.weight.requires_grad_(False)  # frozen, for ignore_frozen_params
    ref.blocks[1].proj.weight.requires_grad_(False)
    shard(model, impl)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    data = batches(2, world)
    for step in range(2):
        loss_of(model, data[step][rank]).backward()
        _ref_step(ref, data[step], world)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0 gets it all
    msd, osd = get_state_dict(model, opt, options=opts)
    rmsd, rosd = get_state_dict(ref, ref_opt, options=StateDictOptions(full_state_dict=True))
    out: dict[str, Any] = {"model": 0.0, "optim": 0.0, "on_cpu": True, "optim_full_shape": True}
    if rank == 0:
        out["model"] = max_diff(msd, rmsd)
        out["on_cpu"] = all(v.device.type == "cpu" for v in msd.values())
        out["optim"] = max(max_diff(osd["state"][k], v) for k, v in rosd["state"].items())
        out["optim_full_shape"] = all(
            osd["state"][k]["exp_avg"].shape == v["exp_avg"].shape for k, v in rosd["state"].items()
        )
    else:
        out["on_cpu"] = msd == {}  # cpu_offload with full state dicts: rank 0 only
    frozen = get_state_dict(model, opt, options=StateDictOptions(ignore_frozen_params=True))[0]
    out["frozen_skipped"] = "blocks.1.proj.weight" not in frozen and "embed.weight" in frozen
    # broadcast_from_rank0 into a freshly initialised sharded model and optimizer
    fresh_ref, fresh = _setup(seed=3)
    fresh.blocks[1].proj.weight.requires_grad_(False)
    shard(fresh, impl)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    bopts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    # (separately: set_state_dict would take an empty model dict on rank > 0 as "optimizer only")
    set_model_state_dict(fresh, rmsd if rank == 0 else {}, options=bopts)
    set_optimizer_state_dict(fresh, fresh_opt, rosd if rank == 0 else {}, options=bopts)
    out["broadcast"] = max_diff(dict(fresh.named_parameters()), dict(ref.named_parameters()))
    fresh_osd = get_state_dict(fresh, fresh_opt, options=StateDictOptions(full_state_dict=True))[1]
    out["broadcast_optim"] = max(
        max_diff(fresh_osd["state"][k], v) for k, v in rosd["state"].items()
    )
    # sharded state dicts: strict=False tolerates a missing key, strict=True names it
    partial = {k: v for k, v in get_state_dict(fresh, [])[0].items() if k != "head.weight"}
    set_model_state_dict(fresh, partial, options=StateDictOptions(strict=False))
    try:
        set_model_state_dict(fresh, partial, options=StateDictOptions(strict=True))
        out["strict_raises"] = False
    except RuntimeError as exc:
        out["strict_raises"] = "head.weight" in str(exc)
    # fullshard's get/set_state_dict agree with torch's sharded ones
    if impl == "fullshard":
        import fullshard

        ours_m, ours_o = fullshard.get_state_dict(model, opt)
        torch_m, torch_o = get_state_dict(model, opt)
        out["agree_model"] = max_diff(ours_m, torch_m)
        out["agree_optim"] = max(
            max_diff(
                {kk: vv for kk, vv in v.items() if kk != "step"},
                {kk: vv for kk, vv in torch_o["state"][k].items() if kk != "step"},
            )
            for k, v in ours_o["state"].items()
        )
    out["diff"] = max(out["model"], out["optim"], out["broadcast"], out["broadcast_optim"])
    return out


def ema_program(rank: int, world: int, impl: str) -> dict:
    """An EMA of model.parameters() with foreach ops, and redistribute / full_tensor."""
    ref, model = _setup()
    shard(model, impl)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ema = [p.detach().clone() for p in model.parameters()]
    ref_ema = [p.detach().clone() for p in ref.parameters()]
    data = batches(3, world)
    for step in range(3):
        loss_of(model, data[step][rank]).backward()
        _ref_step(ref, data[step], world)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        with torch.no_grad():
            torch._foreach_lerp_(ema, [p.detach() for p in model.parameters()], 0.1)
            torch._foreach_lerp_(ref_ema, [p.detach() for p in ref.parameters()], 0.1)
    diff = max(float((full(a) - b).abs().max()) for a, b in zip(ema, ref_ema, strict=True))
    w = model.embed.weight
    replicated = w.redistribute(placements=[Replicate()] * w.device_mesh.ndim).to_local()
    diff = max(diff, float((replicated - ref.embed.weight).abs().max()))
    return {"diff": diff, "ema_dtensor": all(isinstance(e, DTensor) for e in ema)}


def generate_program(rank: int, world: int, impl: str) -> dict:
    """``model.generate`` registered as a forward method runs on the sharded model."""
    ref, model = _setup()
    shard(model, impl)
    api_of(impl).register_fsdp_forward_method(model, "generate")
    prompt = batches(1, 1)[0][0][:, :3]
    out = model.generate(prompt, 4)
    want = ref.generate(prompt, 4)
    return {"diff": float((out - want).abs().max()), "tokens": out.tolist()}


def hsdp_accumulation_program(rank: int, world: int, impl: str) -> dict:
    """HSDP 2 x 2: three micro-batches, reduce-scatter without all-reduce on the first two
    (set_requires_all_reduce), the last all-reduces; is_last_backward on the last only."""
    from torch.distributed.device_mesh import init_device_mesh

    ref, model = _setup()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    shard(model, impl, mesh=mesh)
    micro = 3
    data = batches(micro, world)
    for i in range(micro):
        last = i == micro - 1
        model.set_requires_all_reduce(last)
        model.set_is_last_backward(last)
        loss_of(model, data[i][rank]).backward()
        for r in range(world):
            loss_of(ref, data[i][r]).backward()
    for p in ref.parameters():
        p.grad.div_(world)
    grads = {k: p.grad for k, p in model.named_parameters()}
    return {"diff": max_diff(grads, {k: p.grad for k, p in ref.named_parameters()})}


class LoraLinear(nn.Module):
    """A frozen base weight (float32) and trainable low-rank adapters (float64)."""

    def __init__(self, d: int, r: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(d, d, dtype=torch.float32)
        self.base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(r, d, dtype=torch.float64) * 0.1)
        self.b = nn.Parameter(torch.randn(d, r, dtype=torch.float64) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x.float()).double() + x @ self.a.t() @ self.b.t()


def lora_program(rank: int, world: int, impl: str) -> dict:
    """A unit mixing a frozen float32 base with float64 adapters; only adapters train."""
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    ref = nn.Sequential(LoraLinear(12), nn.GELU(), LoraLinear(12))
    model = copy.deepcopy(ref)
    fully_shard = fully_shard_of(impl)
    for m in (model[0], model[2]):
        fully_shard(m)
    fully_shard(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(5)
    xs = [[torch.randn(4, 12, generator=g) for _ in range(world)] for _ in range(3)]
    for step in range(3):
        model(xs[step][rank]).square().mean().backward()
        for r in range(world):
            (ref(xs[step][r]).square().mean() / world).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    diff = max_diff(dict(model.named_parameters()), dict(ref.named_parameters()))
    return {"diff": diff, "base_grad_none": model[0].base.weight.grad is None}


def meta_init_program(rank: int, world: int, impl: str) -> dict:
    """Build on meta, shard, to_empty, initialise: each rank's shard of the weights."""
    torch.set_default_dtype(torch.float64)
    with torch.device("meta"):
        model = Net()
    shard(model, impl)
    model.to_empty(device="cpu")
    torch.manual_seed(7)
    # the first initialised weight has 12 rows, 6 per rank (uneven shards would make the ranks'
    # generators consume different amounts, and later draws differ for that reason alone)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    proj = model.blocks[0].proj
    for m in [proj] + [m for m in linears if m is not proj]:
        nn.init.normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    nn.init.normal_(model.embed.weight)
    for m in model.modules():
        if isinstance(m, nn.LayerNorm):
            m.reset_parameters()
        if isinstance(m, Block):
            nn.init.constant_(m.gate, 0.5)
    w = proj.weight.full_tensor()
    rows = w.shape[0] // world
    same = torch.equal(w[:rows], w[rows : 2 * rows])  # do rank 1's rows repeat rank 0's?
    std = float(
        torch.cat(
            [m.weight.full_tensor().flatten() for m in model.modules() if isinstance(m, nn.Linear)]
        ).std()
    )
    loss = float(loss_of(model, batches(1, world)[0][rank]))  # it trains from here
    return {"identical_shards": same, "std": std, "loss_finite": loss == loss}


def reshard_int_program(rank: int, world: int, impl: str) -> dict:
    """reshard_after_forward=2 at 4 ranks: backward gathers within pairs; training is exact."""
    ref, model = _setup()
    shard(model, impl, reshard_after_forward=2)
    return {"diff": _train_against(model, ref, rank, world)}


def mixed_precision_program(rank: int, world: int, impl: str) -> dict:
    """MixedPrecisionPolicy as FSDP2: bf16 compute, reduce_dtype None (= bf16), output_dtype
    float32, and unsynchronised micro-batches. Compared between the two imports, bit for bit."""
    ref, model = _setup()
    model.float()
    policy = api_of(impl).MixedPrecisionPolicy
    fully_shard = fully_shard_of(impl)
    for b in model.blocks:
        fully_shard(b, mp_policy=policy(param_dtype=torch.bfloat16, reduce_dtype=None))
    root = policy(param_dtype=torch.bfloat16, reduce_dtype=None, output_dtype=torch.float32)
    fully_shard(model, mp_policy=root)
    data = batches(2, world)
    model.set_requires_gradient_sync(False)
    out = model(data[0][rank][:, :-1])
    F.cross_entropy(out.reshape(-1, VOCAB), data[0][rank][:, 1:].reshape(-1)).backward()
    model.set_requires_gradient_sync(True)
    loss_of(model, data[1][rank]).backward()
    grads = {k: full(p.grad).double() for k, p in model.named_parameters()}
    return {
        "out_dtype": str(out.dtype),
        "grads": grads,
        "grad_dtype": str(model.head.weight.grad.dtype),
    }


def list_program(rank: int, world: int, impl: str) -> dict:
    """fully_shard([norm, head]): two modules, one unit (FSDP2's grouping)."""
    ref, model = _setup()
    fully_shard = fully_shard_of(impl)
    for b in model.blocks:
        fully_shard(b)
    fully_shard([model.norm, model.head])
    fully_shard(model)
    return {"diff": _train_against(model, ref, rank, world)}


def shard_placement_program(rank: int, world: int, impl: str) -> dict:
    """``shard_placement_fn``: Shard(1) for the 2-D weights whose dim 1 divides by the world
    size, Shard(0) for the rest (uneven dim-0 rows included); AdamW against one process."""
    from torch.distributed.tensor import Shard

    def fn(p: nn.Parameter) -> Shard | None:
        return Shard(1) if p.dim() == 2 and p.shape[1] % world == 0 else None

    ref, model = _setup()
    shard(model, impl, shard_placement_fn=fn)
    placements = {k: str(tuple(p.placements)) for k, p in model.named_parameters()}
    return {"diff": _train_against(model, ref, rank, world, steps=3), "placements": placements}
