"""``requires_grad`` changed between steps after ``fully_shard`` (issue 41, item 2): parameters
frozen and thawed in a seeded random pattern over ``STEPS`` steps, under torch's
``fully_shard`` or fullshard's, beside one process running the same schedule in float64.

``freeze_program(rank, world, impl)`` runs every configuration of ``configs(world)`` in one
launch (a strategy, with or without a root unit, and plain float64, ``CPUOffloadPolicy``, bf16
compute, activation checkpointing or ``fullshard.deterministic``) and returns, per
configuration, the largest difference from one process (``diff``), rank 0's final full weights
(``weights``: the test holds the two imports against each other), and facts that must be
true; a configuration that raises reports it (``raised``) and does not hide the others.

The schedule (``schedule``) freezes, per step and per unit, all of the unit, none of it, or a
coin per parameter; step 0 freezes ``embed`` and ``blocks.0`` whole: a unit frozen at its
first forward (where FSDP2 fixes a unit's reduce dtype: pytorch#186998), and, without a root,
a unit no backward reaches, left gathered into the next step by a ``reshard_after_forward``
of False (each unit is its own root then). The flags are set alternately on what the modules
show at that moment (``model.named_parameters()``: the gathered parameters of a unit left
gathered) and on the sharded parameters the optimizer holds.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from fsdp2_gaps import run_all
from fsdp2_programs import Net, api_of, fully_shard_of, max_diff
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint
from toy import batches, loss_of

STEPS = 10
SEED = 41
UNITS = ("embed", "blocks.0", "blocks.1", "norm", "head")
NAMES = [n for n, _ in Net().named_parameters()]
# pytorch#186998 (torch 2.13): a unit whose first forward ran frozen reduces in the compute
# dtype when it thaws, and assigning that bf16 gradient to the float64 parameter raises
TORCH_186998 = "attempting to assign a gradient with dtype"


def unit_of(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "blocks" else parts[0]


def schedule(steps: int = STEPS, seed: int = SEED) -> list[frozenset[str]]:
    """The parameters frozen at each step (the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        frozen: set[str] = set()
        for u in UNITS:
            mine = [n for n in NAMES if unit_of(n) == u]
            r = float(torch.rand((), generator=g, dtype=torch.float64))
            if (step == 0 and u in ("embed", "blocks.0")) or r < 0.35:
                frozen |= set(mine)
            elif r >= 0.7:
                coins = (torch.rand(len(mine), generator=g, dtype=torch.float64) < 0.5).tolist()
                frozen |= {n for n, c in zip(mine, coins, strict=True) if c}
        out.append(frozenset(frozen))
    return out


def coverage(pattern: list[frozenset[str]]) -> dict[str, bool]:
    """What the schedule exercises (the test asserts each)."""

    def whole(u: str, frozen: frozenset[str]) -> bool:
        return all(n in frozen for n in NAMES if unit_of(n) == u)

    def part(u: str, frozen: frozenset[str]) -> bool:
        return any(n in frozen for n in NAMES if unit_of(n) == u) and not whole(u, frozen)

    pairs = list(zip(pattern, pattern[1:], strict=False))
    return {
        # frozen at the first forward, trained later (pytorch#186998's case)
        "first_forward_frozen_then_thawed": any(
            whole(u, pattern[0]) and any(not whole(u, f) for f in pattern[1:]) for u in UNITS
        ),
        # a unit and everything before it frozen (without a root no backward reaches it, and
        # a reshard_after_forward of False leaves it gathered), thawed at the next step
        "left_gathered_then_thawed": any(
            all(whole(v, a) for v in UNITS[: i + 1]) and not whole(u, b)
            for a, b in pairs
            for i, u in enumerate(UNITS)
        ),
        "part_of_a_unit_frozen": any(part(u, f) for f in pattern for u in UNITS),
        "trained_then_frozen": any(n not in a and n in b for a, b in pairs for n in NAMES),
        "frozen_then_thawed": any(n in a and n not in b for a, b in pairs for n in NAMES),
    }


@dataclass(frozen=True)
class Config:
    """One configuration: ``strategy`` (full_shard, shard_grad_op, no_shard, hybrid), a root
    unit above the others or not, a ``variant`` (fp64, offload, bf16, checkpoint,
    deterministic), and ``via``: the flags set alternately on what the modules show and on
    the optimizer's parameters (``both``), or on what the modules show only (``module``: what
    FSDP2 follows)."""

    strategy: str
    root: bool
    variant: str = "fp64"
    via: str = "both"

    @property
    def name(self) -> str:
        shown = "/flags on what modules show" if self.via == "module" else ""
        return f"{self.strategy}/{'root' if self.root else 'no root'}/{self.variant}{shown}"

    @property
    def torch_too(self) -> bool:
        return self.variant != "deterministic"  # fullshard's own

    @property
    def torch_right(self) -> bool:
        """Where FSDP2 (2.13) trains as one process: flags set on what the modules show (a
        flag set on a sharded parameter while its unit is left gathered is not followed) and
        no bf16 compute (pytorch#186998)."""
        return self.via == "module" and self.variant != "bf16"


def configs(world: int) -> list[Config]:
    """Every configuration run at ``world`` ranks: hybrid on a 2 x 2 mesh at 4, the rest at 2
    and 3. Each strategy with and without a root; the variants on full_shard with a root and
    on shard_grad_op without (where units are left gathered between steps)."""
    pairs = [("full_shard", True), ("shard_grad_op", False)]
    if world == 4:
        return [
            Config("hybrid", True),
            Config("hybrid", False),
            Config("hybrid", False, via="module"),
            Config("hybrid", True, "offload", via="module"),
            Config("hybrid", False, "bf16"),
        ]
    return (
        [Config(s, r) for s in ("full_shard", "shard_grad_op", "no_shard") for r in (True, False)]
        + [Config(s, r, via="module") for s, r in pairs]
        + [Config(s, r, v, via="module") for v in ("offload", "checkpoint") for s, r in pairs]
        + [Config(s, r, "bf16") for s, r in pairs]
        # fixed-order sums need a power-of-two group
        + [Config(s, r, "deterministic") for s, r in pairs if world & (world - 1) == 0]
    )


class CheckpointedNet(Net):
    """``Net`` with each block under (non-reentrant) activation checkpointing."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False)
        return self.head(self.norm(x))


def _mesh(cfg: Config, world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    shape = {"no_shard": (world, 1), "hybrid": (2, world // 2)}.get(cfg.strategy)
    if shape is None:
        return init_device_mesh("cpu", (world,))
    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def _shard(model: Net, impl: str, cfg: Config, world: int) -> None:
    api = api_of(impl)
    # full_shard frees after forward, shard_grad_op keeps; no_shard and hybrid take FSDP2's
    # default (a unit with no parent is a root, and keeps)
    reshard = {"full_shard": True, "shard_grad_op": False}.get(cfg.strategy)
    kw: dict[str, Any] = {"mesh": _mesh(cfg, world)}
    if cfg.variant == "bf16":
        kw["mp_policy"] = api.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float64
        )
    if cfg.variant == "offload":
        kw["offload_policy"] = api.CPUOffloadPolicy(pin_memory=False)
    fully_shard = fully_shard_of(impl)
    if cfg.root:
        for b in model.blocks:
            fully_shard(b, reshard_after_forward=reshard, **kw)
        fully_shard(model, **kw)
    else:
        for m in (model.embed, *model.blocks, model.norm, model.head):
            fully_shard(m, reshard_after_forward=reshard, **kw)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _freeze(params: dict[str, torch.Tensor], frozen: frozenset[str]) -> None:
    for n, p in params.items():
        p.requires_grad_(n not in frozen)


def _ref_step(ref: nn.Module, data: list[torch.Tensor], bf16: bool) -> None:
    """One process's gradients: the mean over ``data`` of each batch's. Under ``bf16`` the
    float64 weights are cast to bf16 (as each rank's gather casts them), each batch runs through
    that copy, and its bf16 gradients are summed in float64 (``reduce_dtype=float64``): sums of
    bf16 values are exact in float64, so this is the sharded run's gradient in any order."""
    model = copy.deepcopy(ref).to(torch.bfloat16) if bf16 else ref
    total: dict[str, torch.Tensor] = {}
    for batch in data:
        loss = loss_of(model, batch)
        if not loss.requires_grad:
            return  # nothing trains this step
        loss.backward()
        for n, q in model.named_parameters():
            if q.grad is not None:
                total[n] = total[n] + q.grad.double() if n in total else q.grad.double()
                q.grad = None
    for n, p in ref.named_parameters():
        if n in total:
            p.grad = total[n] / len(data)


def run_schedule(rank: int, world: int, impl: str, cfg: Config) -> dict[str, Any]:
    """``cfg`` trained ``STEPS`` Adam steps under ``schedule()``, beside one process."""
    torch.manual_seed(0)
    ref = Net()
    model = CheckpointedNet() if cfg.variant == "checkpoint" else Net()
    model.load_state_dict(ref.state_dict())
    _shard(model, impl, cfg, world)
    held = dict(model.named_parameters())  # the sharded parameters, as the optimizer holds them
    opt = torch.optim.Adam(held.values(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    pattern = schedule()
    fixed = cfg.variant == "deterministic"
    micro = 2 if fixed and world == 2 else 1  # two micro-steps through GradientTree at 2 ranks
    data = batches(STEPS * micro, world)
    tree, took_all, follow, unchanged = None, [], [], []
    if fixed:
        from fullshard import deterministic

        deterministic.enable(model)
    for step, frozen in enumerate(pattern):
        _freeze(dict(ref.named_parameters()), frozen)
        shown = cfg.via == "module" or step % 2  # else the optimizer's parameters
        _freeze(dict(model.named_parameters()) if shown else held, frozen)
        if fixed and micro > 1 and tree is None:
            # built once the first pattern froze some: what thaws later must pass through it
            plan = deterministic.MicroBatches(global_batch=micro * world, micro_batch=1)
            tree = deterministic.GradientTree(held.values(), plan, world)
        kept = {n: held[n].to_local().clone() for n in frozen}  # this rank's rows
        for k in range(micro):
            loss = loss_of(model, data[step * micro + k][rank])
            if loss.requires_grad:
                (loss / (micro * world) if fixed else loss).backward()
            # the optimizer's parameters show the flags, whichever object was set
            follow.append(all(p.requires_grad is (n not in frozen) for n, p in held.items()))
            if tree is not None:
                tree.push()
                took_all.append(all(p.grad is None for p in held.values()))
        if tree is not None:
            tree.finish()
        step_data = [data[step * micro + k][r] for k in range(micro) for r in range(world)]
        _ref_step(ref, step_data, cfg.variant == "bf16")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        unchanged.append(all(torch.equal(held[n].to_local(), v) for n, v in kept.items()))
    with torch.no_grad():
        weights = {n: _full(p).detach().clone() for n, p in held.items()}
    return {
        "diff": max_diff(weights, {n: p.detach() for n, p in ref.named_parameters()}),
        "weights": weights if rank == 0 else {},
        "frozen_bitwise_unchanged": all(unchanged),
        "sharded_flags_follow": all(follow),
        "tree_took_every_gradient": all(took_all),
    }


def freeze_program(rank: int, world: int, impl: str) -> dict[str, dict]:
    cases = {
        c.name: (lambda r, w, i, c=c: run_schedule(r, w, i, c))
        for c in configs(world)
        if impl == "fullshard" or c.torch_too
    }
    return run_all(cases, rank, world, impl)
