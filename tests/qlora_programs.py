"""QLoRA as torchtune and FSDP-QLoRA run it (issue 41): frozen base weights quantized to a tensor
subclass, trainable LoRA adapters, ``fully_shard`` on every block and on the root, under torch's
``fully_shard`` or fullshard's (``impl``).

Two quantized weights: torchao's ``NF4Tensor`` (``to_nf4``; ``kind="nf4"``) and the suite's
``split_only_toy.RowQuant`` (``kind="rowquant"``), each implementing only FSDP2's contract for a
subclass parameter (``split``, ``new_zeros``, ``copy_``, the all-gather hooks; no slice that
starts past row 0), each saving the gathered weight for its backward; and plain frozen weights
(``kind="plain"``: LoRA without quantization, whose root unit's frozen head is read by a
backward node after the head's adapters have their gradients). Five configurations (``CONFIGS``): fp32, activation checkpointing,
``CPUOffloadPolicy``, bf16 parameters (``MixedPrecisionPolicy(param_dtype=bfloat16)``), and a DCP
save after two steps with ``StateDictOptions(ignore_frozen_params=True)`` resumed into a fresh
model (other adapters) for the last two.

``qlora_program`` runs every (kind, configuration) in one launch and returns, per case, the
trained adapters whole (the test compares them across the two imports bit for bit) and the
largest difference from an unsharded replica trained on the same data (each rank's micro-batch
backward in turn, the gradients summed and halved: FSDP's ``(g0 + g1) / 2`` at 2 ranks). In bf16
the replica computes in bf16 as FSDP does (adapters cast to bf16, inputs cast, gradients summed
and halved in bf16, then made float32 for the float32 AdamW); see ``tests/test_qlora.py`` for
the tolerance each configuration is held to.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import split_only_toy
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from fsdp2_programs import api_of
from harness import run_cases
from torch import nn
from torch.distributed.tensor import DTensor

DIM, HIDDEN, LORA_RANK, SCALE = 128, 256, 4, 2.0  # 256 x 128: NF4's blocks split in halves
STEPS, BATCH, SEQ = 4, 2, 8
SAVE_AT = 2  # the DCP configuration saves after this many steps and resumes for the rest


def nf4() -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[..., torch.Tensor], type]:
    """torchao's ``to_nf4``, ``linear_nf4`` and ``NF4Tensor`` (where 0.18 keeps them, or where
    older releases did)."""
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import (
            NF4Tensor,
            linear_nf4,
            to_nf4,
        )
    except ImportError:
        from torchao.dtypes.nf4tensor import NF4Tensor, linear_nf4, to_nf4  # type: ignore
    return to_nf4, linear_nf4, NF4Tensor


def quantize(kind: str, w: torch.Tensor) -> torch.Tensor:
    if kind == "plain":
        return w
    return nf4()[0](w) if kind == "nf4" else split_only_toy.quantize(w)


def base_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` with the (quantized) base weight dequantized to ``x``'s dtype."""
    if isinstance(w, split_only_toy.RowQuant):
        return split_only_toy.linear(x, w)
    if type(w) in (torch.Tensor, nn.Parameter):
        return F.linear(x, w.to(x.dtype))
    return nf4()[1](x, w)


class QLoRALinear(nn.Module):
    """torchtune's ``LoRALinear`` with a quantized base: ``base(x) + SCALE * b(a(x))``."""

    def __init__(
        self, din: int, dout: int, kind: str, base: torch.Generator, lora: torch.Generator
    ):
        super().__init__()
        w = torch.randn(dout, din, generator=base) / math.sqrt(din)
        self.weight = nn.Parameter(quantize(kind, w), requires_grad=False)
        self.lora_a = nn.Linear(din, LORA_RANK, bias=False)
        self.lora_b = nn.Linear(LORA_RANK, dout, bias=False)
        with torch.no_grad():  # b is not zero (torchtune's init) so every adapter moves at once
            self.lora_a.weight.copy_(torch.randn(LORA_RANK, din, generator=lora) * 0.1)
            self.lora_b.weight.copy_(torch.randn(dout, LORA_RANK, generator=lora) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return base_linear(x, self.weight) + SCALE * self.lora_b(self.lora_a(x))


class Block(nn.Module):
    def __init__(self, kind: str, base: torch.Generator, lora: torch.Generator) -> None:
        super().__init__()
        self.w1 = QLoRALinear(DIM, HIDDEN, kind, base, lora)
        self.w2 = QLoRALinear(HIDDEN, DIM, kind, base, lora)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(F.silu(self.w1(x)))


class QLoRAModel(nn.Module):
    """Two blocks and a quantized head (the root unit's own parameters)."""

    def __init__(self, kind: str, checkpoint: bool = False, lora_seed: int = 1) -> None:
        super().__init__()
        base, lora = torch.Generator().manual_seed(0), torch.Generator().manual_seed(lora_seed)
        self.checkpoint = checkpoint
        self.blocks = nn.ModuleList([Block(kind, base, lora) for _ in range(2)])
        self.head = QLoRALinear(DIM, HIDDEN, kind, base, lora)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            if self.checkpoint:
                x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False)
            else:
                x = b(x)
        return self.head(x)


def data(world: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``[step][rank]`` (input, target) micro-batches, the same on every rank."""
    g = torch.Generator().manual_seed(7)
    return [
        [
            (
                torch.randn(BATCH, SEQ, DIM, generator=g),
                torch.randint(HIDDEN, (BATCH, SEQ), generator=g),
            )
            for _ in range(world)
        ]
        for _ in range(STEPS)
    ]


def loss_of(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())


def adapters(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters, whole (``full_tensor`` is a collective: every rank calls it)."""
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            t = p.detach()
            out[name] = (t.full_tensor() if isinstance(t, DTensor) else t).clone()
    return out


class Replica:
    """The unsharded model trained on the union of the ranks' micro-batches; in bf16 it computes
    as FSDP's mixed precision does (the module docstring)."""

    def __init__(self, kind: str, checkpoint: bool, bf16: bool) -> None:
        self.model = QLoRAModel(kind, checkpoint)
        self.bf16 = bf16
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=1e-2)

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        world = len(batches)
        if not self.bf16:
            for b in batches:
                loss_of(self.model, b).backward()
            for p in self.params:
                p.grad.div_(world)  # type: ignore[union-attr]
        else:
            masters = [p.detach().clone() for p in self.params]
            total: list[torch.Tensor | None] = [None] * len(self.params)
            for x, y in batches:
                with torch.no_grad():
                    for p, m in zip(self.params, masters, strict=True):
                        p.data = m.to(torch.bfloat16)
                loss_of(self.model, (x.to(torch.bfloat16), y)).backward()
                for i, p in enumerate(self.params):
                    total[i] = p.grad if total[i] is None else total[i] + p.grad  # type: ignore[operator]
                    p.grad = None
            for p, m, g in zip(self.params, masters, total, strict=True):
                p.data = m
                p.grad = (g / world).float()  # type: ignore[operator]
        self.opt.step()
        self.opt.zero_grad()


def _shard(model: QLoRAModel, impl: str, kw: dict[str, Any]) -> QLoRAModel:
    fully_shard = api_of(impl).fully_shard
    for b in model.blocks:
        fully_shard(b, **kw)
    fully_shard(model, **kw)
    return model


def _shared_dir(rank: int) -> str:
    path = [tempfile.mkdtemp(prefix="qlora_dcp_") if rank == 0 else ""]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def _resume(
    model: QLoRAModel,
    opt: torch.optim.Optimizer,
    rank: int,
    impl: str,
    kind: str,
    kw: dict[str, Any],
) -> tuple[QLoRAModel, torch.optim.Optimizer]:
    """Save adapters and optimizer with DCP (frozen parameters left out), load them into a fresh
    model whose adapters differ, return it and its optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    opts = StateDictOptions(ignore_frozen_params=True)
    path = _shared_dir(rank)
    try:
        msd, osd = get_state_dict(model, opt, options=opts)
        assert not any(".weight" in k and "lora" not in k for k in msd), sorted(msd)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        fresh = _shard(QLoRAModel(kind, lora_seed=11), impl, kw)
        fresh_opt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-2)
        fmsd, fosd = get_state_dict(fresh, fresh_opt, options=opts)
        state = {"model": fmsd, "optim": fosd}
        dcp.load(state, checkpoint_id=path)
        # the frozen weights are not in it: strict=False (as torchtune loads adapters)
        load = StateDictOptions(ignore_frozen_params=True, strict=False)
        set_state_dict(
            fresh,
            fresh_opt,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=load,
        )
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
    return fresh, fresh_opt


CONFIGS = ("fp32", "activation checkpointing", "CPUOffloadPolicy", "bf16", "DCP resume")


def qlora_case(rank: int, world: int, impl: str, kind: str, config: str) -> dict[str, Any]:
    """One (kind, configuration): ``STEPS`` AdamW steps of the adapters, sharded and replicated."""
    api = api_of(impl)
    kw: dict[str, Any] = {}
    if config == "CPUOffloadPolicy":
        kw["offload_policy"] = api.CPUOffloadPolicy(pin_memory=False)  # no accelerator here
    if config == "bf16":
        kw["mp_policy"] = api.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    ac = config == "activation checkpointing"
    split_only_toy.OPS_SEEN.clear()
    model = _shard(QLoRAModel(kind, checkpoint=ac), impl, kw)
    local = model.blocks[0].w1.weight.to_local()
    replica = Replica(kind, ac, bf16=config == "bf16")
    # this rank's shard of the base weight is still the subclass, holding exactly its rows
    full = replica.model.blocks[0].w1.weight.detach()
    rows = HIDDEN // world
    deq = base_linear(torch.eye(DIM), local).t()
    kept = torch.equal(deq, base_linear(torch.eye(DIM), full).t()[rank * rows : (rank + 1) * rows])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batches = data(world)
    for step in range(STEPS):
        if config == "DCP resume" and step == SAVE_AT:
            model, opt = _resume(model, opt, rank, impl, kind, kw)
        loss_of(model, batches[step][rank]).backward()
        opt.step()
        opt.zero_grad()
        replica.step(batches[step])
    got = adapters(model)
    want = adapters(replica.model)
    diff = max(float((got[k].double() - want[k].double()).abs().max()) for k in want)
    return {
        "adapters": got,
        "replica_diff": diff,
        "shard_type": type(local).__name__,
        "shard_rows_kept": kept,
        "base_frozen": all(
            p.grad is None for n, p in model.named_parameters() if not p.requires_grad
        ),
        "ops": sorted(split_only_toy.OPS_SEEN) if kind == "rowquant" else [],
    }


def qlora_program(rank: int, world: int, impl: str, kinds: tuple[str, ...]) -> dict:
    """Every (kind, configuration) in one launch (``harness.run_cases``)."""
    cases = {(k, c): (qlora_case, (impl, k, c)) for k in kinds for c in CONFIGS}
    return run_cases(rank, world, cases)


def _train_fullshard(
    kind: str, kw: dict[str, Any], rank: int, world: int
) -> tuple[nn.Module, list[int]]:
    """fullshard's run of a configuration; the host synchronisations of each step (counted
    under the CUDA emulation, zero outside it)."""
    from fullshard.testing import emulation

    model = _shard(QLoRAModel(kind), "fullshard", kw)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batches, syncs = data(world), []
    for step in range(STEPS):
        emulation.reset_sync_counts()
        loss_of(model, batches[step][rank]).backward()
        opt.step()
        opt.zero_grad()
        syncs.append(sum(emulation.sync_counts().values()))
    return model, syncs


def emulated_case(rank: int, world: int, kind: str, offload: bool) -> dict[str, Any]:
    """The QLoRA model on fullshard's CUDA path (``fullshard.testing.cuda_emulation``): the
    quantized shards gathered on the gather stream through their hooks, and under
    ``CPUOffloadPolicy`` pinned (the subclass's own ``pin_memory``) and copied to the device
    there. The same bits as without the emulation, no ordering error, the host synchronisations
    of each step after the first."""
    from fullshard import CPUOffloadPolicy
    from fullshard.testing import emulation

    kw: dict[str, Any] = {"offload_policy": CPUOffloadPolicy()} if offload else {}
    plain = adapters(_train_fullshard(kind, kw, rank, world)[0])
    error, syncs, got = None, [], {}
    try:
        with emulation.cuda_emulation(all_device=True):
            model, syncs = _train_fullshard(kind, kw, rank, world)
            got = adapters(model)
            pinned = all(p.to_local().is_pinned() for p in model.parameters()) if offload else None
    except emulation.StreamOrderError as exc:
        error, pinned = str(exc), None
    same = error is None and all(torch.equal(plain[k], got[k]) for k in plain)
    sites = {f"{k} at {s}": n for (k, s), n in emulation.sync_counts().items()}
    return {
        "error": error,
        "same_bits": same,
        "quiet_syncs": syncs[1:],
        "last_sites": sites,
        "pinned": pinned,
    }
