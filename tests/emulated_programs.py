"""The engine's CUDA code path run on CPU under ``fullshard.testing.cuda_emulation`` (issue 17).

``run_config(name, rank, world)`` trains ``Net`` for a few AdamW steps in one configuration
(strategy, precision, offload, int reshard, HSDP, accumulation, TP, a checkpoint) twice: once plainly and once
under the emulation, where the engine takes its CUDA path (virtual gather / reduce / all-reduce
streams, stream-ordered collective waits, pinned offload copies, deferred desync verdicts).
It returns whether the two runs are the same bits (the emulation only observes), the
``StreamOrderError`` the checker raised (or ``None``) and the host synchronisations counted in
each quiet step (every step after the first, where lazy init may read). ``MUTATIONS`` put back
each defect issue 17 found, for the tests that show the checker catches it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from freeze_programs import schedule
from fsdp2_programs import Net
from toy import Block, batches, loss_of

from fullshard import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from fullshard.testing import emulation

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)  # reduce in bf16: defect 1's case


def _mesh(world: int, hsdp: bool) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    if hsdp:
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world,))


# name -> (fully_shard keyword arguments for the blocks, micro-batches per step)
CONFIGS: dict[str, tuple[dict[str, Any], int]] = {
    "full_shard": ({}, 1),
    "shard_grad_op": ({"reshard_after_forward": False}, 1),
    "reshard_int": ({"reshard_after_forward": 2}, 1),
    "hybrid_shard": ({"hsdp": True}, 1),
    "bf16": ({"mp_policy": BF16}, 1),
    "cpu_offload_bf16": ({"mp_policy": BF16, "offload_policy": CPUOffloadPolicy()}, 1),
    "accumulation": ({}, 3),
    "hsdp_accumulation": ({"hsdp": True}, 3),
    # every micro-batch reduced: the shards add into .grad (the reduce outputs are freed early)
    "hsdp_grad_accumulation": ({"hsdp": True, "sync_each": True}, 2),
    "tensor_parallel": ({"tp": True}, 1),  # FSDP over 2 x TP over 2, the blocks' fc1/fc2
    "checkpoint": ({"checkpoint": True}, 1),  # DCP save, then load into a fresh model and step
    # fullshard.deterministic over HSDP: fixed-order reduce-scatter (all-to-all and a sum on the
    # reduce stream) and all-reduce (all-gather and a sum on the all-reduce stream), every
    # micro-batch reduced into the tree of gradients, the fixed-order norm
    "fixed_order_hsdp": ({"hsdp": True, "fixed_order": True, "sync_each": True}, 2),
    # NOTE [Freezing after fully_shard]: freeze_programs.schedule's seeded freezes and thaws,
    # so units' reduce layouts change between quiet steps; without a root, every unit is its own
    # root and keeps its parameters (reshard_after_forward=False), so units no backward reached
    # are left gathered when they thaw
    "freeze_unfreeze": ({"freeze": True}, 1),
    "freeze_schedule_no_root": ({"freeze": True, "no_root": True}, 1),
    # FSDP2's knobs on the CUDA path: every micro-batch reduced but only the last is the last
    # backward (the waits move to the next), two reduce-scatters in flight, the all-reduce hook
    # under force-sum (divided after the hook, on the reduce stream), the gathered storage kept
    "api_knobs": ({"knobs": True, "sync_each": True, "flow": "not_last"}, 3),
    # torch 2.15's manual finalization: micro-batches without sync, one finalize_backward
    "manual_finalization": ({"knobs": True, "flow": "manual"}, 3),
}


def _build(world: int, kw: dict[str, Any]) -> Net:
    torch.manual_seed(0)
    model = Net()
    kw = dict(kw)
    kw.pop("checkpoint", None)
    kw.pop("sync_each", None)
    kw.pop("freeze", None)
    kw.pop("flow", None)
    knobs = kw.pop("knobs", False)
    fixed = kw.pop("fixed_order", False)
    if kw.pop("no_root", False):
        for m in (model.embed, *model.blocks, model.norm, model.head):
            fully_shard(m, mesh=_mesh(world, False), reshard_after_forward=False, **kw)
        return model
    if kw.pop("tp", False):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        model.blocks = torch.nn.ModuleList([Block(hidden=14) for _ in model.blocks])  # even
        mesh2 = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
        for b in model.blocks:
            parallelize_module(b, mesh2["tp"], plan)
        mesh = mesh2["dp"]
    else:
        mesh = _mesh(world, kw.pop("hsdp", False))
    for b in model.blocks:
        fully_shard(b, mesh=mesh, **kw)
    kw.pop("reshard_after_forward", None)
    fully_shard(model, mesh=mesh, **kw)
    if knobs:
        model.set_reduce_scatter_max_input_buffers(2)
        model.set_keep_unsharded_storage(True)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
                m.set_all_reduce_hook(lambda t: t.mul_(0.5))
    if fixed:
        from fullshard import deterministic

        deterministic.enable(model)
    return model


class AllReduceProbe:
    """Counts the moments compute is ordered after a replica all-reduce before the end of the
    backward that issued it (FSDP2 waits for it once, at the end: defect 3)."""

    def __init__(self, emu: Any) -> None:
        self.emu, self.works, self.early = emu, [], 0

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        from fullshard.comm.collectives import Comm

        issue = Comm.all_reduce_replicas

        def all_reduce_replicas(comm: Any, tensor: torch.Tensor) -> Any:
            pending = issue(comm, tensor)
            self.works.append(pending._work)
            return pending

        with _patched(Comm, "all_reduce_replicas", all_reduce_replicas):
            yield

    def __call__(self, point: Any, unit: Any) -> None:
        from fullshard.engine.schedule import Point

        if point is Point.BACKWARD_DONE:
            self.works = []
        elif point is Point.BACKWARD_END:
            compute = self.emu.clocks[self.emu.compute.tid]
            done = [w._done for w in self.works]
            self.early += sum(all(compute.get(t, 0) >= n for t, n in d.items()) for d in done)


def _train(
    model: Net,
    rank: int,
    world: int,
    micro: int,
    steps: int,
    emu: Any,
    tp: bool = False,
    sync_each: bool = False,
    freeze: bool = False,
    flow: str = "",
) -> list[int]:
    """``steps`` steps; the host synchronisations counted in each (under ``emu``)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = batches(steps * micro, world)
    tree = None
    if any(u.comm.fixed_order for u in _units(model)):  # fullshard.deterministic's loop
        from fullshard import deterministic

        plan = deterministic.MicroBatches(global_batch=micro * world, micro_batch=1)
        tree = deterministic.GradientTree(model.parameters(), plan, world)
    if tp:  # the two ranks of a TP group read the same batch
        rank = rank // 2 * 2
    counts = []
    held = dict(model.named_parameters())  # the sharded parameters the optimizer holds
    pattern = schedule(steps) if freeze else []
    for step in range(steps):
        if step == 1 and emu is not None and isinstance(model, FSDPModule):
            from fullshard.engine.sharding import subscribe

            emu.owned["probe"].works = []  # the first step's, waited for at its end
            subscribe(model, emu.owned["probe"])
        if emu is not None:
            emulation.reset_sync_counts()
        if freeze:  # on what the modules show, and on the optimizer's parameters
            for n, p in (dict(model.named_parameters()) if step % 2 else held).items():
                p.requires_grad_(n not in pattern[step])
        if flow == "manual":
            model.set_manual_backward_finalization(True)
        for k in range(micro):
            last = k == micro - 1
            for m in _fsdp_modules(model):
                m.set_requires_gradient_sync(
                    flow != "manual" and (last or sync_each), recurse=False
                )
            if flow == "not_last":
                model.set_is_last_backward(last)
            loss = loss_of(model, data[step * micro + k][rank])
            if not loss.requires_grad:
                continue  # the schedule froze everything this step
            if tree is None:
                loss.backward()
            else:
                (loss / (micro * world)).backward()
                tree.push()
        if flow == "manual":
            model.set_requires_gradient_sync(True)
            model.finalize_backward(async_op=True).wait()
        if tree is not None:
            from fullshard import deterministic

            tree.finish()
            deterministic.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        counts.append(sum(emulation.sync_counts().values()) if emu is not None else 0)
    return counts


def _local_weights(model: Net) -> dict[str, torch.Tensor]:
    """This rank's shards (a unit without a root may be left gathered: reshard it first)."""
    for m in _fsdp_modules(model):
        m.reshard()
    return {k: v.to_local().detach().clone() for k, v in model.named_parameters()}


def _fsdp_modules(model: Net) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _units(model: Net) -> list[Any]:
    return [m._fullshard_state.unit for m in _fsdp_modules(model)]


def run_config(
    rank: int, world: int, name: str, mutation: str | None = None, steps: int = 2
) -> dict[str, Any]:
    """``name`` of ``CONFIGS`` plainly and under the emulation (with ``mutation`` applied)."""
    kw, micro = CONFIGS[name]
    tp, ckpt, each = kw.get("tp", False), kw.get("checkpoint", False), kw.get("sync_each", False)
    freeze, flow = kw.get("freeze", False), kw.get("flow", "")
    steps = 6 if freeze else steps
    plain = _build(world, kw)
    _train(plain, rank, world, micro, steps, None, tp, each, freeze, flow)
    if ckpt:
        plain = _reloaded(plain, world, kw, rank, "plain")
        _train(plain, rank, world, micro, 1, None, tp)
    expected = _local_weights(plain)
    error, counts, sites, early = None, [], {}, 0
    with MUTATIONS[mutation]() if mutation else contextlib.nullcontext():
        try:
            with emulation.cuda_emulation(all_device=True) as emu:
                probe = emu.owned["probe"] = AllReduceProbe(emu)
                model = _build(world, kw)
                with probe.watching():
                    counts = _train(model, rank, world, micro, steps, emu, tp, each, freeze, flow)
                    if ckpt:
                        model = _reloaded(model, world, kw, rank, "emulated")
                        _train(model, rank, world, micro, 1, None, tp)
                early = probe.early
                sites = {f"{k} at {s}": n for (k, s), n in emulation.sync_counts().items()}
                got = _local_weights(model)
        except emulation.StreamOrderError as exc:
            error = str(exc)
    same = error is None and all(torch.equal(expected[k], got[k]) for k in expected)
    return {
        "error": error,
        "same_bits": same,
        "quiet_syncs": counts[1:],
        "last_sites": sites,
        "early_all_reduce_waits": early,
    }


def _reloaded(model: Net, world: int, kw: dict[str, Any], rank: int, tag: str) -> Net:
    """``model``'s weights through a DCP checkpoint, loaded into a freshly sharded model."""
    import shutil
    import tempfile

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    folder = [tempfile.mkdtemp(prefix=f"emulated-{tag}-") if rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=folder[0])
    fresh = _build(world, kw)
    state = {"model": get_model_state_dict(fresh)}
    dcp.load(state, checkpoint_id=folder[0])
    set_model_state_dict(fresh, state["model"])
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder[0])
    return fresh


def run_configs(rank: int, world: int, runs: list[tuple[str, str | None]]) -> dict[str, Any]:
    """Several ``(config, mutation)`` runs in one launch."""
    return {f"{n}/{m}": run_config(rank, world, n, m) for n, m in runs}


# -- the defects, put back ---------------------------------------------------------------------
@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    old = owner.__dict__[name]
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def _defect1() -> contextlib.AbstractContextManager[None]:
    """Offloaded gradients cast on the host from the pinned buffer the GPU is still writing."""
    from fullshard.engine.unit import CommUnit

    def set_grads(self: Any, shard: torch.Tensor, present: list[bool], divided: float) -> None:
        factor = (self.divide_factor or self.mesh.data_parallel_size) / divided
        if factor != 1:
            shard.div_(factor)
        if self.offload:
            shard = self._to_host(shard)
        for j, p in enumerate(self.trainable):
            if present[j]:
                g = self.grad_layout.shard_view(shard, j, self.mesh.rank)
                p.add_grad(g.to(p.sharded.dtype) if g.dtype != p.sharded.dtype else g)

    return _patched(CommUnit, "_set_grads", set_grads)


def _defect2_sync() -> contextlib.AbstractContextManager[None]:
    """The static tag copied from a pageable host tensor, per unit per forward."""
    from fullshard.engine import unit

    def write_static_tag(tail: torch.Tensor, index: int) -> None:
        values = [0xA5, index >> 8 & 0xFF, index & 0xFF]
        tail[:3].copy_(torch.tensor(values, dtype=tail.dtype))

    return _patched(unit, "write_static_tag", write_static_tag)


def _defect2_event() -> contextlib.AbstractContextManager[None]:
    """No event between compute's post-forward pack and the backward gather that sends it."""
    from fullshard.engine.streams import Streams

    return _patched(Streams, "gather_waits", lambda self, event: None)


def _defect3() -> contextlib.AbstractContextManager[None]:
    """HSDP: the replica all-reduce issued at the next unit's post-backward, compute waiting
    for it there (the host-wait path's order, taken on CUDA)."""
    from fullshard.engine.unit import CommUnit

    original = CommUnit.reduce_grads

    def reduce_grads(self: Any) -> None:
        cuda = self.streams.cuda
        self.streams.cuda = False  # the deferred (host-path) order, on the CUDA streams
        try:
            original(self)
        finally:
            self.streams.cuda = cuda

    def finish_reduce(self: Any) -> None:
        cuda = self.streams.cuda
        self.streams.cuda = False
        try:
            finish(self)
        finally:
            self.streams.cuda = cuda

    finish = CommUnit.finish_reduce
    stack = contextlib.ExitStack()
    stack.enter_context(_patched(CommUnit, "reduce_grads", reduce_grads))
    stack.enter_context(_patched(CommUnit, "finish_reduce", finish_reduce))
    return stack


def _defect6() -> contextlib.AbstractContextManager[None]:
    """Verdicts read with event.synchronize() whenever more than one is pending."""
    from fullshard.comm import desync

    def poll(self: Any, block: bool = False) -> None:
        while self._pending:
            event, host, items = self._pending[0]
            if event is not None:
                if not (block or len(self._pending) > 1 or event.query()):
                    return
                event.synchronize()
            self._pending.pop(0)
            for flag, item in zip(host.tolist(), items, strict=True):
                if flag:
                    self._raise_if_bad(item, late=True)

    return _patched(desync.Verdict, "poll", poll)


MUTATIONS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "defect1": _defect1,
    "defect2_sync": _defect2_sync,
    "defect2_event": _defect2_event,
    "defect3": _defect3,
    "defect6": _defect6,
}
