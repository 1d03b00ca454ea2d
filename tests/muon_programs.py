"""The rank programs of ``tests/test_optim_muon.py``: every case runs in one launch per world
size (``muon_program``), each against one process (torch's own ``torch.optim.Muon`` and
``AdamW`` on the whole tensors).

The model has the awkward shapes: first dims 37, 5, 70 and 64 are not divisible by 2, 3 or 4
(uneven shards; at 4 ranks the 5-row matrix leaves a rank without rows), an embedding, a
norm, biases and a head (AdamW groups).
"""

from __future__ import annotations

import copy
import os
import warnings
from typing import Any

import torch
from torch import nn
from toy import VOCAB, ToyLM, full_params, loss_of, shard_toy

# (nesterov, weight_decay, adjust_lr_fn): every option torch.optim.Muon's arithmetic has
CONFIGS = [
    (True, 0.1, None),
    (False, 0.0, "original"),
    (True, 0.05, "match_rms_adamw"),
    (False, 0.1, "match_rms_adamw"),
]
LR = 0.02
STEPS = 3


class Net(nn.Module):
    def __init__(self, vocab: int = 11) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 7)
        self.layers = nn.ModuleList(
            [nn.Linear(7, 37), nn.Linear(37, 5, bias=False), nn.Linear(5, 70), nn.Linear(70, 64)]
        )
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(self.norm(h))


def _sharded(model: nn.Module, **kwargs: Any) -> nn.Module:
    from fullshard import fully_shard

    for layer in model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _optimizers(
    model: nn.Module, ref: nn.Module, config: tuple[bool, float, str | None]
) -> tuple[torch.optim.Optimizer, list[torch.optim.Optimizer]]:
    """fullshard's Muon over ``model`` and torch's Muon + AdamW over ``ref``, alike."""
    from fullshard.optim import Muon, matrix_groups

    nesterov, wd, adjust = config
    kw = {"lr": LR, "weight_decay": wd}
    opt = Muon(matrix_groups(model), nesterov=nesterov, adjust_lr_fn=adjust, **kw)
    matrices, others = (g["params"] for g in matrix_groups(ref))
    return opt, [
        torch.optim.Muon(matrices, nesterov=nesterov, adjust_lr_fn=adjust, **kw),
        torch.optim.AdamW(others, **kw),
    ]


def _inject(model: nn.Module, ref: nn.Module, g: torch.Generator, skip: set[str]) -> None:
    """The same seeded gradient on both: the whole on ``ref``, each rank's piece on ``model``
    (DTensor's own split, no communication); none for the parameters in ``skip``."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        grad = torch.randn(q.shape, generator=g, dtype=q.dtype)
        if name in skip or not p.requires_grad:
            p.grad = q.grad = None
            continue
        q.grad = grad
        p.grad = (
            distribute_tensor(grad, p.device_mesh, p.placements, src_data_rank=None)
            if isinstance(p, DTensor)
            else grad.clone()
        )


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _differing(model: nn.Module, ref: nn.Module) -> list[str]:
    return [
        n
        for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True)
        if not torch.equal(_bits(_full(p)), _bits(q.detach()))
    ]


def _injected(
    rank: int, world: int, config: tuple, how: str = "", skip_step: int = -1
) -> dict[str, Any]:
    """Bitwise against one process, torch's bf16 Newton–Schulz, gradients injected."""
    from fullshard import CPUOffloadPolicy, MixedPrecisionPolicy

    torch.manual_seed(0)
    ref = Net()
    if how == "frozen":
        ref.layers[1].weight.requires_grad_(False)
    kwargs: dict[str, Any] = {}
    if how == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    if how == "offload":
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    if how == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh

        kwargs["mesh"] = init_device_mesh("cpu", (2, world // 2))
    model = _sharded(copy.deepcopy(ref), **kwargs)
    opt, refs = _optimizers(model, ref, config)
    g = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        # a step where no rank used layers.2 (NOTE [Which gradients exist]): skipped alike
        _inject(model, ref, g, {"layers.2.weight"} if step == skip_step else set())
        opt.step()
        for o in refs:
            o.step()
    return {"differing": _differing(model, ref)}


def _emulated(rank: int, world: int) -> dict[str, Any]:
    """The CUDA path on CPU (``fullshard.testing.emulation``, every tensor device memory,
    collectives as NCCL's on streams): no ordering error, the same bits as one process, and no
    host synchronisation in a step once the plan is built (the first step's all-gather of
    objects is one)."""
    from fullshard.testing import emulation

    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)  # (a deep copy does not run under the emulation)
    try:
        with emulation.cuda_emulation(all_device=True):
            model = _sharded(model)
            opt, refs = _optimizers(model, ref, CONFIGS[0])
            g = torch.Generator().manual_seed(1)
            syncs = []
            for _ in range(STEPS):
                _inject(model, ref, g, set())
                emulation.reset_sync_counts()
                opt.step()
                syncs.append({f"{k} at {w}": n for (k, w), n in emulation.sync_counts().items()})
                for o in refs:
                    o.step()
            return {"error": None, "differing": _differing(model, ref), "syncs": syncs}
    except emulation.StreamOrderError as exc:
        return {"error": str(exc)}


def _ns_fp64(
    grad: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """Newton–Schulz's quintic (Keller Jordan's), in the input's own precision (float64 here):
    the issue's "Newton–Schulz in fp64 on both sides", so sums in another order show as
    rounding of fp64, not of bf16."""
    a, b, c = coefficients
    x = grad.T if grad.size(0) > grad.size(1) else grad
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if grad.size(0) > grad.size(1) else x


def _fp64_training(rank: int, world: int, config: tuple, which: str) -> dict[str, Any]:
    """A real training loop (each rank its rows, one process the union), fp64 Newton–Schulz:
    the sums differ in order only. ``which``: fullshard's Muon, or torch's over fullshard's
    parameters (which must warn once, and still be right)."""
    from torch.optim import _muon

    torch.set_default_dtype(torch.float64)
    saved = _muon._zeropower_via_newtonschulz
    _muon._zeropower_via_newtonschulz = _ns_fp64  # type: ignore[assignment]
    try:
        torch.manual_seed(0)
        ref = Net()
        model = _sharded(copy.deepcopy(ref))
        opt, refs = _optimizers(model, ref, config)
        caught: list[str] = []
        if which == "torch":
            from fullshard.optim import matrix_groups

            nesterov, wd, adjust = config
            matrices, others = (g["params"] for g in matrix_groups(model))
            kw = {"lr": LR, "weight_decay": wd}
            opts = [
                torch.optim.Muon(matrices, nesterov=nesterov, adjust_lr_fn=adjust, **kw),
                torch.optim.AdamW(others, **kw),
            ]
        else:
            opts = [opt]
        data = torch.randint(11, (STEPS, world, 4, 6), generator=torch.Generator().manual_seed(2))
        for step in range(STEPS):
            for m, x in ((model, data[step][rank]), (ref, data[step].reshape(-1, 6))):
                m(x).square().mean().backward()
            with warnings.catch_warnings(record=True) as got:
                warnings.simplefilter("always")
                for o in opts:
                    o.step()
                    o.zero_grad()
            caught += [str(w.message) for w in got if "fullshard.optim.Muon" in str(w.message)]
            for o in refs:
                o.step()
                o.zero_grad()
        diff = max(
            (_full(p) - q).abs().max().item()
            for p, q in zip(model.parameters(), ref.parameters(), strict=True)
        )
        return {"diff": diff, "warnings": caught}
    finally:
        _muon._zeropower_via_newtonschulz = saved  # type: ignore[assignment]


def _comm_and_balance(rank: int, world: int) -> dict[str, Any]:
    """c10d-level counts of one optimizer step (and of one forward/backward, for the
    reduce-scatters and all-gathers of the same parameters), each rank's owned Newton–Schulz
    work and its optimizer state."""
    from commcount import C10dCounter

    from fullshard.optim import Muon
    from fullshard.optim.exchange import ns_flops

    torch.manual_seed(0)
    model = _sharded(_Square(8, 24))
    opt = Muon(model.parameters(), lr=LR)
    x = torch.randn(5, 24)
    model(x).square().mean().backward()
    opt.step()  # the first step builds the plan (one all-gather of objects)
    with C10dCounter(known_only=True) as fb:
        model(x).square().mean().backward()
    with C10dCounter(known_only=True) as step:
        opt.step()
    (plan,) = opt._plans.values()
    shapes = [tuple(p.shape) for p in model.parameters()]
    state = sum(s["momentum_buffer"]._local_tensor.numel() * 4 for s in opt.state.values())
    return {
        "step_calls": dict(step.calls),
        "step_log": step.log,
        "fb_bytes": dict(fb.bytes),
        "sent": plan.sent(),
        "owned": plan.owned,
        "owned_elements": sum(shapes[i][0] * shapes[i][1] for i in plan.owned),
        "flops": sum(ns_flops(shapes[i], 5) for i in plan.owned),
        "total_flops": sum(ns_flops(s, 5) for s in shapes),
        "state_bytes": state,
        "total_state_bytes": sum(p.numel() * 4 for p in model.parameters()),
        "local_elements": sum(p._local_tensor.numel() for p in model.parameters()),
    }


class _Square(nn.Module):
    """``n`` bias-free ``d x d`` units: the benchmark's shape, small."""

    def __init__(self, n: int, d: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d, d, bias=False) for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _deterministic(rank: int, world: int) -> dict[str, Any]:
    """fullshard.deterministic's library loop with Muon (torch's bf16 Newton–Schulz) on the
    toy: the weights' bits, to compare across world sizes; in fp32 and with bf16 compute."""
    from fullshard import MixedPrecisionPolicy, deterministic
    from fullshard.optim import Muon, matrix_groups

    data = torch.randint(VOCAB, (3, 16, 9), generator=torch.Generator().manual_seed(1))
    out: dict[str, Any] = {}
    for bf16 in (False, True):
        torch.manual_seed(0)
        mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else None
        model = shard_toy(ToyLM(), **({"mp_policy": mp} if mp else {}))
        deterministic.enable(model)
        plan = deterministic.MicroBatches(global_batch=16, micro_batch=2)
        tree = deterministic.GradientTree(model.parameters(), plan, world)
        opt = Muon(matrix_groups(model), lr=0.02, adjust_lr_fn="match_rms_adamw")
        for step in range(3):
            for i in plan.indices(rank, world):
                (loss_of(model, data[step][plan.rows(i)]) / plan.count).backward()
                tree.push()
            tree.finish()
            deterministic.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
            opt.zero_grad()
        out["bf16" if bf16 else "fp32"] = full_params(model)
    return out


def _tensor_parallel(rank: int, world: int) -> dict[str, Any]:
    """(dp 2, tp 2): column-parallel weights (``_StridedShard`` over dp: pieces that are not
    blocks), row-parallel ones (column blocks), the rest on each TP rank's dp mesh; gradients
    injected, bitwise against one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from fullshard import fully_shard

    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(
        model, mesh["tp"], {"layers.2": ColwiseParallel(), "layers.3": RowwiseParallel()}
    )
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt, refs = _optimizers(model, ref, CONFIGS[0])
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        _inject(model, ref, g, set())
        opt.step()
        for o in refs:
            o.step()
    placements = {n: str(p.placements) for n, p in model.named_parameters() if p.ndim == 2}
    return {"differing": _differing(model, ref), "placements": placements}


def _dcp(rank: int, world: int, folder: str, save: bool) -> dict[str, Any]:
    """Save after two steps (``save``), or load what was saved at another world size; then one
    more step with the same gradient. Returns the weights and the momentum after it."""
    import torch.distributed.checkpoint as dcp

    from fullshard import get_state_dict, set_state_dict

    torch.manual_seed(0)
    ref = Net()
    model = _sharded(copy.deepcopy(ref))
    opt, _ = _optimizers(model, ref, CONFIGS[2])
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        _inject(model, ref, g, set())  # the same draws at every world size
        if save:
            opt.step()
    if save:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder)
    else:
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=folder)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    _inject(model, ref, g, set())
    opt.step()
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        "weights": {n: _full(p) for n, p in model.named_parameters()},
        "state": {
            f"{names[id(p)]}.{k}": _full(v) for p, s in opt.state.items() for k, v in s.items()
        },
    }


def muon_program(rank: int, world: int, folder: str) -> dict:
    """Every case of this world size, in one launch (``harness.run_cases``)."""
    from harness import run_cases

    cases: dict[Any, tuple[Any, tuple]] = {}
    if world > 1:
        for k, config in enumerate(CONFIGS):
            cases[("injected", k)] = (_injected, (config,))
            cases[("fp64", k)] = (_fp64_training, (config, "fullshard"))
        for how in ("bf16", "offload", "frozen"):
            cases[("injected", how)] = (_injected, (CONFIGS[0], how))
        cases[("injected", "skipped")] = (_injected, (CONFIGS[0], "", 1))
        cases["torch_muon"] = (_fp64_training, (CONFIGS[0], "torch"))
        cases["comm"] = (_comm_and_balance, ())
        cases["emulated"] = (_emulated, ())
    if world == 4:
        cases[("injected", "hsdp")] = (_injected, (CONFIGS[0], "hsdp"))
        cases["tp"] = (_tensor_parallel, ())
    if world in (2, 3):
        cases["dcp"] = (_dcp, (os.path.join(folder, "dcp"), world == 2))
    if world in (1, 2, 4):
        cases["deterministic"] = (_deterministic, ())
    return run_cases(rank, world, cases)
