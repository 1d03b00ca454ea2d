"""Pipeline parallelism x FSDP (issue 41 item 3), torchtitan's recipe on 4 gloo ranks: a 2-D
mesh (pp 2 x dp 2), every block and every stage root ``fully_shard``-ed over the dp sub-mesh,
``torch.distributed.pipelining``'s GPipe, 1F1B, Interleaved1F1B and LoopedBFS, fp64.

``pipeline_program(rank, world, orders)`` runs, in one launch, every schedule under each import
order of ``orders`` and returns per (order, schedule) the full weights of this rank's stages and
the collectives counted at the c10d level in each step. The import order is a property of the
process (pipelining binds ``FSDPModule`` and ``fully_shard`` when it is imported), so each
order asserts, inside the rank, that it is what it claims:

- ``"install_before"``: ``fullshard.install()`` and then the first import of pipelining, whose
  modules therefore hold fullshard's names. Only in a process that has not imported pipelining
  (asserted), so it runs in a launch of its own;
- ``"torch"``: torch's own ``fully_shard``, the control; pipelining is imported here first, so
  it holds torch's names (asserted);
- ``"install_after"``: ``install()`` once pipelining holds torch's names (asserted), sharding
  through the routed ``torch.distributed.fsdp.fully_shard``; uninstalled afterwards;
- ``"direct"``: ``from fullshard import fully_shard`` with nothing installed (asserted).

``reference_weights`` trains the same model in one process on the whole batch.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F
from commcount import C10dCounter
from torch import nn

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS")
MULTI = ("Interleaved1F1B", "LoopedBFS")  # two stages per rank
PP, DP = 2, 2
N_MICRO, STEPS, DIM, BLOCKS, ROWS = 4, 3, 8, 4, 8  # ROWS: per dp rank and step
LR = 1e-2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.gate = nn.Parameter(torch.full((DIM,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gate * torch.tanh(self.fc(x))


class Stage(nn.Module):
    """A stage: its own projection (the stage root's parameters) and its blocks."""

    def __init__(self, n_blocks: int) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM, bias=False)
        self.blocks = nn.ModuleList([Block() for _ in range(n_blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        for b in self.blocks:
            x = b(x)
        return x


def n_stages(schedule: str) -> int:
    return 2 * PP if schedule in MULTI else PP


def build_stages(schedule: str) -> list[Stage]:
    """Every stage of the model, the same on every rank and in the reference (fp64)."""
    torch.manual_seed(0)
    n = n_stages(schedule)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # drawn in fp64 (a cast would draw in fp32)
    try:
        return [Stage(BLOCKS // n) for _ in range(n)]
    finally:
        torch.set_default_dtype(before)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of a step, every dp rank's rows (dp rank d takes rows d*ROWS...)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(DP * ROWS, DIM, generator=g, dtype=torch.float64)
    y = torch.randn(DP * ROWS, DIM, generator=g, dtype=torch.float64)
    return x, y


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def reference_weights(schedule: str) -> dict[str, torch.Tensor]:
    """One process, the whole batch: the mean over microbatches and dp ranks of equal-sized
    means is the mean over the batch."""
    stages = build_stages(schedule)
    model = nn.Sequential(*stages)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = batch(step)
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {
        f"stage{s}.{k}": v.detach() for s, m in enumerate(stages) for k, v in m.named_parameters()
    }


def _schedule(name: str, stages: list[Any], pipelining: Any) -> Any:
    cls = {
        "GPipe": pipelining.ScheduleGPipe,
        "1F1B": pipelining.Schedule1F1B,
        "Interleaved1F1B": pipelining.ScheduleInterleaved1F1B,
        "LoopedBFS": pipelining.ScheduleLoopedBFS,
    }[name]
    first = stages if name in MULTI else stages[0]
    return cls(first, n_microbatches=N_MICRO, loss_fn=loss_fn)


def _run(name: str, fully_shard: Any, mesh: Any) -> dict[str, Any]:
    """One schedule: shard, train ``STEPS`` steps counting collectives, return full weights."""
    import torch.distributed.pipelining as pipelining
    from torch.distributed.tensor import DTensor

    pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    dp_mesh = mesh["dp"]
    all_stages = build_stages(name)
    n = len(all_stages)
    mine = [pp_rank, pp_rank + PP] if name in MULTI else [pp_rank]
    units = 0
    stages = []
    for s in mine:
        m = all_stages[s]
        for b in m.blocks:
            fully_shard(b, mesh=dp_mesh)
        fully_shard(m, mesh=dp_mesh)
        units += 1 + len(m.blocks)
        stages.append(
            pipelining.PipelineStage(m, s, n, torch.device("cpu"), group=mesh.get_group("pp"))
        )
    sched = _schedule(name, stages, pipelining)
    params = [p for s in mine for p in all_stages[s].parameters()]
    opt = torch.optim.Adam(params, lr=LR)
    rows = slice(dp_rank * ROWS, (dp_rank + 1) * ROWS)
    counts: list[dict[str, int]] = []
    for step in range(STEPS):
        x, y = batch(step)
        with C10dCounter() as counter:
            if pp_rank == 0:
                sched.step(x[rows])
            else:
                sched.step(target=y[rows], losses=[])
        counts.append(dict(counter.calls))
        opt.step()
        opt.zero_grad()
    weights = {}
    for s in mine:
        for k, v in all_stages[s].named_parameters():
            full = v.full_tensor() if isinstance(v, DTensor) else v
            weights[f"stage{s}.{k}"] = full.detach().clone()
    return {"weights": weights, "counts": counts, "units": units}


def _stage_names() -> tuple[Any, Any]:
    """What pipelining's modules hold under ``FSDPModule`` (stage.py and schedules.py)."""
    stage = sys.modules["torch.distributed.pipelining.stage"]
    schedules = sys.modules["torch.distributed.pipelining.schedules"]
    assert stage.FSDPModule is schedules.FSDPModule
    return stage.FSDPModule, stage.fully_shard


def _order(order: str) -> tuple[Any, Any]:
    """Bring the process into ``order`` (asserting that it is what it claims); returns the
    ``fully_shard`` to call and the handle to uninstall (or None)."""
    import torch.distributed.fsdp as tfsdp
    from torch.distributed.fsdp._fully_shard import _fully_shard as torch_impl

    import fullshard

    if order == "install_before":
        assert "torch.distributed.pipelining" not in sys.modules, "pipelining imported already"
        handle = fullshard.install()
        import torch.distributed.pipelining  # noqa: F401  (the first import: after install)

        holds = _stage_names()
        assert holds == (fullshard.FSDPModule, fullshard.fully_shard), holds
        assert tfsdp.fully_shard is fullshard.fully_shard
        return tfsdp.fully_shard, handle
    import torch.distributed.pipelining  # noqa: F401

    holds = _stage_names()
    assert holds == (torch_impl.FSDPModule, torch_impl.fully_shard), holds  # torch's names
    if order == "torch":
        assert tfsdp.fully_shard is torch_impl.fully_shard
        return torch_impl.fully_shard, None
    if order == "install_after":
        handle = fullshard.install()
        assert tfsdp.fully_shard is fullshard.fully_shard
        assert _stage_names() == holds  # torch's modules keep torch's names
        return tfsdp.fully_shard, handle
    assert order == "direct"
    assert tfsdp.fully_shard is torch_impl.fully_shard  # nothing installed
    from fullshard import fully_shard

    return fully_shard, None


def pipeline_program(rank: int, world: int, orders: list[str]) -> dict:
    """Every schedule under each order of ``orders`` (in that order), in this launch."""
    from torch.distributed.device_mesh import init_device_mesh

    assert world == PP * DP
    torch.set_default_dtype(torch.float64)
    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    out: dict[Any, Any] = {}
    for order in orders:
        fully_shard, handle = _order(order)
        for name in SCHEDULES:
            # a failure raises at once: a schedule that stops half-way leaves its peers
            # waiting on this rank's sends, and the rank's exit is what releases them
            out[order, name] = _run(name, fully_shard, mesh)
        if handle is not None:
            handle.uninstall()
    return out
