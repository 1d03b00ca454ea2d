"""Every public item of torch FSDP2's API (torch 2.13, and what 2.15 adds), each as a case that
records what a user can observe: which units are sharded after forward and after backward, the
gradients, dtypes, return values, exception and warning types, and the order of all-gathers
(and reduce-scatters) at the c10d level between the units' forwards and backwards.

``api_program`` runs every case in one launch under torch's ``fully_shard`` or fullshard's;
``tests/test_fsdp2_api.py`` holds the two imports' records equal (tensors to 1e-12 in fp64).
A case that needs an item this torch lacks (2.15's, under torch 2.13) records ``absent`` under
torch and checks fullshard against what 2.15 documents (one process, or fullshard without it).
"""

from __future__ import annotations

import copy
import traceback
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from commcount import C10dCounter
from fsdp2_programs import Net
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

D, V = 8, 16
# extra elements per block: every unit's size (73, 473, 873; the root's 272) is 199 elements or
# more from every other's, so a collective's bytes name its unit under either import (fullshard
# adds a few tag and presence elements per rank: NOTE [Collective positions])
EXTRA = (0, 400, 800)


class Blk(nn.Module):
    def __init__(self, extra: int) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.extra = nn.Parameter(torch.randn(extra + 1) * 0.1)
        self.seen: list[str] = []  # dtypes the forward saw (mixed precision cases)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = [str(x.dtype), str(self.lin.weight.dtype), str(self.extra.dtype)]
        return torch.tanh(self.lin(x)) * (1 + self.extra.mean())


class Model(Net):
    """``fsdp2_programs.Net``'s shape (its forward) with three blocks of distinct sizes."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([Blk(e) for e in EXTRA])
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)

    @torch.no_grad()
    def score(self, idx: torch.Tensor) -> torch.Tensor:
        """Runs the parts without ``forward`` (``register_fsdp_forward_method``)."""
        x = self.embed(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x)).sum(-1)


def api_of(impl: str) -> Any:
    if impl == "torch":
        import torch.distributed.fsdp as api
    else:
        import fullshard as api
    return api


def make(seed: int = 0) -> tuple[Model, Model]:
    """The model to shard and its one-process reference (float64)."""
    torch.manual_seed(seed)
    ref = Model()
    return copy.deepcopy(ref), ref


def shard(api: Any, model: Model, **kw: Any) -> Model:
    for b in model.blocks:
        api.fully_shard(b, **kw)
    api.fully_shard(model, **{k: v for k, v in kw.items() if k != "reshard_after_forward"})
    return model


def data(world: int, step: int = 0) -> list[torch.Tensor]:
    """Every rank's batch of ``step`` (each rank builds all, for the one-process reference)."""
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randint(V, (2, 5), generator=g) for _ in range(world)]


def loss_of(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    logits = model(idx)
    return F.cross_entropy(logits.flatten(0, 1).float(), idx.roll(1, 1).flatten())


def ref_grads(ref: Model, world: int, steps: tuple[int, ...] = (0,)) -> dict[str, torch.Tensor]:
    """One process over every rank's data: the average of the ranks' gradients, summed over
    ``steps`` (micro-batches)."""
    ref.zero_grad(set_to_none=True)
    for step in steps:
        for idx in data(world, step):
            loss_of(ref, idx).backward()
    return {k: p.grad / world for k, p in ref.named_parameters() if p.grad is not None}


# -- what a user can observe ------------------------------------------------------------------
UNITS = ("root", "b0", "b1", "b2")


def unit_modules(model: Model) -> dict[str, nn.Module]:
    return {"root": model, "b0": model.blocks[0], "b1": model.blocks[1], "b2": model.blocks[2]}


def sharded(model: Model) -> dict[str, bool]:
    """Which units show their sharded parameters (DTensors) to their modules."""
    rep = {
        "root": model.head.weight,
        "b0": model.blocks[0].lin.weight,
        "b1": model.blocks[1].lin.weight,
        "b2": model.blocks[2].lin.weight,
    }
    return {k: isinstance(v, DTensor) for k, v in rep.items()}


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Every parameter's gradient, whole (None where it has none)."""
    return {
        k: None if p.grad is None else full(p.grad).detach().clone()
        for k, p in model.named_parameters()
    }


def max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    keys = [k for k in b if b[k] is not None]
    assert all(a.get(k) is not None for k in keys), sorted(k for k in keys if a.get(k) is None)
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in keys)


def kind(exc: BaseException | None) -> str:
    """An exception's FSDP2-facing type: the first builtin it is an instance of."""
    if exc is None:
        return "none"
    for cls in (ValueError, TypeError, AssertionError, NotImplementedError, RuntimeError):
        if isinstance(exc, cls):
            return cls.__name__
    return type(exc).__name__


def raises(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except Exception as exc:
        return kind(exc)
    return "none"


class Trace:
    """The c10d collectives of a block, in order, named by unit from their bytes, between
    markers: ``F b0`` when b0's forward computes (after its gather and prefetches), ``B b0``
    when b0's backward computes."""

    def __init__(self, model: Model | dict[str, nn.Module]) -> None:
        self.counter = C10dCounter()
        self.marks: list[tuple[int, str]] = []
        self.sizes: dict[str, int] = {}
        units = unit_modules(model) if isinstance(model, Model) else model
        for name, m in units.items():
            others = [u for u in units.values() if u is not m and u is not units["root"]]
            inner = {id(p) for u in others for p in u.parameters()}
            own = [p for p in m.parameters() if m is not units["root"] or id(p) not in inner]
            self.sizes[name] = sum(p.numel() for p in own)  # global (DTensor)
            if name == "root":
                continue
            m.register_forward_pre_hook(lambda mod, a, n=name: self._mark(f"F {n}"))
            m.register_forward_hook(lambda mod, a, out, n=name: self._on_output(out, n))
        self.elsize = 8

    def _mark(self, what: str) -> None:
        self.marks.append((len(self.counter.log), what))

    def _on_output(self, out: torch.Tensor, name: str) -> None:
        if out.requires_grad:
            out.register_hook(lambda g: self._mark(f"B {name}"))

    def __enter__(self) -> Trace:
        self.counter.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.counter.__exit__(*exc)

    def _unit(self, nbytes: int) -> str:
        fits = [
            (nbytes - n * self.elsize, u)
            for u, n in self.sizes.items()
            if n * self.elsize <= nbytes
        ]
        assert fits, (nbytes, self.sizes)
        return min(fits)[1]

    def events(self) -> list[str]:
        """The all-gathers and the markers, in order."""
        out, marks = [], list(self.marks)
        for i, (k, nbytes) in enumerate(self.counter.log):
            while marks and marks[0][0] <= i:
                out.append(marks.pop(0)[1])
            if k == "all_gather":
                out.append(f"AG {self._unit(nbytes)}")
        out += [m for _, m in marks]
        return out

    def reduces(self) -> list[str]:
        """The reduce-scatters (and HSDP all-reduces), as a sorted list: when a unit's gradients
        are reduced in backward is each implementation's own choice (fullshard reduces a unit
        as soon as its gradients are complete, which may come before torch's end of backward),
        how many times each unit is reduced is not."""
        names = []
        for k, nbytes in self.counter.log:
            if k in ("reduce_scatter", "all_to_all"):
                names.append(f"RS {self._unit(nbytes)}")
            elif k == "all_reduce":
                names.append("AR")
        return sorted(names)


def step(model: Model, rank: int, world: int, n: int = 0, trace: Trace | None = None) -> dict:
    """One forward and backward on this rank's batch; which units are sharded after each."""
    out: dict[str, Any] = {}
    with trace if trace is not None else nullcontext():
        loss = loss_of(model, data(world, n)[rank])
        out["after_forward"] = sharded(model)
        loss.backward()
    out["after_backward"] = sharded(model)
    return out


# -- fully_shard and the module-level names ---------------------------------------------------
def c_fully_shard(rank: int, world: int, api: Any) -> dict:
    """fully_shard on each block and the root: return value, class, placements, what is
    sharded after forward and backward, gradients, the all-gathers and reduce-scatters."""
    model, ref = make()
    ret = api.fully_shard(model.blocks[0])
    for b in model.blocks[1:]:
        api.fully_shard(b)
    root = api.fully_shard(model)
    out: dict[str, Any] = {
        "returns_module": ret is model.blocks[0] and root is model,
        "class": type(model).__name__,
        "still_model": isinstance(model, Model),
        "is_fsdp": isinstance(model, api.FSDPModule)
        and isinstance(model.blocks[0], api.FSDPModule),
        "block_class": type(model.blocks[0]).__name__,
        "placements": {k: str(p.placements) for k, p in model.named_parameters()},
        "local_shapes": {k: tuple(p.to_local().shape) for k, p in model.named_parameters()},
    }
    trace = Trace(model)
    out.update(step(model, rank, world, trace=trace))
    out["trace"] = trace.events()
    out["reduces"] = trace.reduces()
    out["grads"] = grads(model)
    # the next step: the same all-gathers in the same order (fullshard's implicit forward
    # prefetch issues each a unit earlier than torch's eager schedule does: not compared)
    again = Trace(model)
    step(model, rank, world, 1, again)
    out["gathers_step_1"] = [e for e in again.events() if e.startswith("AG")]
    out["grad_placements"] = {k: str(p.grad.placements) for k, p in model.named_parameters()}
    out["vs_one_process"] = max_diff(out["grads"], ref_grads(ref, world)) <= 1e-12
    return out


def c_list_unit(rank: int, world: int, api: Any) -> dict:
    """fully_shard([norm, head]): a list in, the list out, one unit gathered once."""
    model, ref = make()
    for b in model.blocks:
        api.fully_shard(b)
    ret = api.fully_shard([model.norm, model.head])
    api.fully_shard(model)
    with C10dCounter() as c:
        loss_of(model, data(world)[rank]).backward()
    return {
        "returns_list": ret == [model.norm, model.head],
        "gathers": c.calls["all_gather"],
        "grads": grads(model),
    }


def c_mesh(rank: int, world: int, api: Any) -> dict:
    """mesh=: a 1-D mesh, and a 2-D (replicate, shard) mesh (HSDP): placements, gradients."""
    out: dict[str, Any] = {}
    for name, shape in (("1d", (world,)), ("hsdp", (world, 1))):
        names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        model, _ = make()
        shard(api, model, mesh=mesh)
        step(model, rank, world)
        out[name] = {
            "placements": str(model.head.weight.placements),
            "grads": grads(model),
        }
    return out


def c_reshard_after_forward(rank: int, world: int, api: Any) -> dict:
    """reshard_after_forward=True / False / None / an int: what is sharded between forward
    and backward; the invalid values' exception types."""
    out: dict[str, Any] = {}
    for value in (True, False, None, 1, world):
        model, _ = make()
        for b in model.blocks:
            api.fully_shard(b, reshard_after_forward=value)
        api.fully_shard(model, reshard_after_forward=value)
        out[str(value)] = step(model, rank, world)
        out[f"{value} grads"] = grads(model)
    for bad in (3, 0, "yes", 0.5):
        out[f"bad {bad!r}"] = raises(lambda b=bad: api.fully_shard(Blk(0), reshard_after_forward=b))
    return out


def c_shard_placement_fn(rank: int, world: int, api: Any) -> dict:
    """shard_placement_fn: Shard(1) for the head, Shard(0) elsewhere."""
    model, _ = make()

    def fn(p: nn.Parameter) -> Shard | None:
        return Shard(1) if p.ndim == 2 and p.shape == (V, D) else None

    for b in model.blocks:
        api.fully_shard(b, shard_placement_fn=fn)
    api.fully_shard(model, shard_placement_fn=fn)
    step(model, rank, world)
    return {
        "placements": {k: str(p.placements) for k, p in model.named_parameters()},
        "grads": grads(model),
    }


def c_mixed_precision(rank: int, world: int, api: Any) -> dict:
    """MixedPrecisionPolicy's four fields: the dtypes a block's forward sees, the output's, the
    gradients'; and the policy as a value (frozen, equal, hashable)."""
    out: dict[str, Any] = {}
    mp_cls = api.MixedPrecisionPolicy
    bf16 = mp_cls(param_dtype=torch.bfloat16)
    for name, mp, root_mp in (
        ("bf16", bf16, bf16),
        ("reduce fp32", mp_cls(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), None),
        ("no input cast", mp_cls(param_dtype=torch.bfloat16, cast_forward_inputs=False), None),
        ("output fp32", bf16, mp_cls(param_dtype=torch.bfloat16, output_dtype=torch.float32)),
    ):
        model, _ = make()
        for b in model.blocks:
            api.fully_shard(b, mp_policy=mp)
        api.fully_shard(model, mp_policy=root_mp or mp)
        logits = model(data(world)[rank])
        out[name] = {
            "seen": model.blocks[1].seen,
            "output": str(logits.dtype),
        }
        logits.float().square().mean().backward()
        out[name]["grad_dtypes"] = sorted({str(p.grad.dtype) for p in model.parameters()})
        out[name]["param_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
        # a block called on its own with a float64 input: cast to param_dtype, or not
        with torch.no_grad():
            out[name]["direct"] = raises(lambda m=model: m.blocks[1](torch.randn(2, D)))
        out[name]["direct_seen"] = model.blocks[1].seen
    mp = mp_cls(param_dtype=torch.bfloat16)
    out["frozen"] = raises(lambda: setattr(mp, "param_dtype", torch.float16))
    out["equal"] = mp == mp_cls(param_dtype=torch.bfloat16)
    out["hashable"] = raises(lambda: hash(mp))
    out["fields"] = sorted(f for f in mp_cls.__dataclass_fields__ if f != "param_dtype_override_fn")
    return out


def c_offload_policy(rank: int, world: int, api: Any) -> dict:
    """OffloadPolicy / CPUOffloadPolicy: mutable dataclasses; CPUOffloadPolicy(pin_memory=False)
    trains with shards on CPU."""
    out: dict[str, Any] = {}
    policy = api.CPUOffloadPolicy()
    out["pin_default"] = policy.pin_memory
    out["mutable"] = raises(lambda: setattr(policy, "pin_memory", False))
    out["after_set"] = policy.pin_memory
    out["equal"] = api.CPUOffloadPolicy(pin_memory=False) == policy
    out["subclass"] = issubclass(api.CPUOffloadPolicy, api.OffloadPolicy)
    out["base_equal"] = api.OffloadPolicy() == api.OffloadPolicy()
    for name, pol in (
        ("cpu", api.CPUOffloadPolicy(pin_memory=False)),
        ("none", api.OffloadPolicy()),
    ):
        model, _ = make()
        shard(api, model, offload_policy=pol)
        step(model, rank, world)
        out[name] = {
            "grads": grads(model),
            "devices": sorted({p.device.type for p in model.parameters()}),
        }
    return out


def c_ignored_params(rank: int, world: int, api: Any) -> dict:
    """ignored_params: left a plain tensor, not sharded, its gradient the rank's own."""
    model, _ = make()
    ignored = {model.blocks[1].extra}
    for b in model.blocks:
        api.fully_shard(b, ignored_params=ignored)
    api.fully_shard(model, ignored_params=ignored)
    step(model, rank, world)
    p = model.blocks[1].extra
    return {
        "plain": not isinstance(p, DTensor),
        "grad": p.grad.clone(),
        "grads": grads(model),
    }


def c_dp_mesh_dims(rank: int, world: int, api: Any) -> dict:
    """DataParallelMeshDims (exported, its fields and properties, its ValueError) and
    fully_shard(mesh=spmd, dp_mesh_dims=...) over parameters that are DTensors on that mesh."""
    cls = api.DataParallelMeshDims
    dims = cls(shard="dp_shard")
    out: dict[str, Any] = {
        "fields": sorted(cls.__dataclass_fields__),
        "shard_names": dims.shard_names,
        "replicate_names": dims.replicate_names,
        "tuple_names": cls(shard=("a", "b"), replicate="r").shard_names,
        "neither": raises(lambda: cls()),
        "mutable": raises(lambda: setattr(dims, "replicate", None)),
    }
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    torch.manual_seed(0)
    lin = nn.Linear(D, D)
    for name, p in list(lin.named_parameters()):
        setattr(lin, name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()])))
    api.fully_shard(lin, mesh=mesh, dp_mesh_dims=dims)
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(7))  # the global batch
    lin(distribute_tensor(x, mesh, [Shard(0)])).square().sum().backward()
    out["placements"] = str(lin.weight.placements)
    out["grads"] = grads(lin)
    return out


def c_state_accessor(rank: int, world: int, api: Any) -> dict:
    """fully_shard.state(module): an object for a wrapped module, None for another."""
    model, _ = make()
    shard(api, model)
    return {
        "wrapped": api.fully_shard.state(model) is not None,
        "unwrapped": api.fully_shard.state(model.norm) is None,
    }


def c_fsdp_module(rank: int, world: int, api: Any) -> dict:
    """FSDPModule as a class: indexing a sharded Sequential builds the original class, and deep
    copy is refused."""
    seq = nn.Sequential(nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D))
    api.fully_shard(seq)
    sliced = seq[0:2]
    return {
        "slice_class": type(sliced).__name__,
        "slice_is_fsdp": isinstance(sliced, api.FSDPModule),
        "deepcopy": raises(lambda: copy.deepcopy(seq)),
    }


def c_unshard_reshard(rank: int, world: int, api: Any) -> dict:
    """unshard() / unshard(async_op=True) / reshard() / UnshardHandle: what each returns and
    what the module shows after it; the values of a forward run on the unsharded unit."""
    model, ref = make()
    shard(api, model)
    b = model.blocks[1]
    out: dict[str, Any] = {"sync_returns": repr(b.unshard())}
    out["after_unshard"] = sharded(model)
    out["weight"] = b.lin.weight.detach().clone()
    b.reshard()
    out["after_reshard"] = sharded(model)
    handle = b.unshard(async_op=True)
    out["handle_type"] = isinstance(handle, api.UnshardHandle)
    out["wait_returns"] = repr(handle.wait())
    out["after_wait"] = sharded(model)
    b.reshard()
    empty = api.UnshardHandle()
    out["bare_handle"] = repr(empty.wait())
    out["want"] = ref.blocks[1].lin.weight.detach().clone()
    return out


def c_register_fsdp_forward_method(rank: int, world: int, api: Any) -> dict:
    """register_fsdp_forward_method: a method other than forward gathers the units; a missing
    method's exception; a module that is not an FSDPModule is left alone."""
    model, ref = make()
    shard(api, model)
    api.register_fsdp_forward_method(model, "score")
    idx = data(world)[rank]
    got = model.score(idx)
    plain = Model()
    api.register_fsdp_forward_method(plain, "score")  # a no-op
    return {
        "score": got,
        "want": ref.score(idx),
        "after": sharded(model),
        "missing": raises(lambda: api.register_fsdp_forward_method(model, "nope")),
        "plain_unchanged": "score" not in vars(plain),
    }


def c_share_comm_ctx(rank: int, world: int, api: Any) -> dict:
    """share_comm_ctx: roots that share one context train as each alone; a module that is not
    an FSDPModule is a ValueError; an empty list is fine."""
    share = api.share_comm_ctx
    models = [make(seed)[0] for seed in (0, 1)]
    for m in models:
        shard(api, m)
    share(models)
    for m in models:
        step(m, rank, world)
    return {
        "grads": [grads(m) for m in models],
        "not_fsdp": raises(lambda: share([models[0], nn.Linear(2, 2)])),
        "empty": raises(lambda: share([])),
    }


# -- FSDPModule's controls --------------------------------------------------------------------
def c_reset_iter_state(rank: int, world: int, api: Any) -> dict:
    """reset_iter_state after a forward that raised: the next step's gradients."""
    model, _ = make()
    shard(api, model)
    model.blocks[1].register_forward_hook(_raise_once())
    forward_raised = raises(lambda: loss_of(model, data(world)[rank]))
    model.reset_iter_state()
    model.zero_grad(set_to_none=True)
    out = step(model, rank, world, 1)
    return {"forward_raised": forward_raised, **out, "grads": grads(model)}


def _raise_once() -> Callable[..., None]:
    armed = [True]

    def hook(*_: Any) -> None:
        if armed[0]:
            armed[0] = False
            raise RuntimeError("boom")

    return hook


def c_is_last_backward(rank: int, world: int, api: Any) -> dict:
    """set_is_last_backward(False) then True over two micro-batches: the gradients after each
    backward (the root's too), and what is sharded."""
    model, ref = make()
    shard(api, model)
    out: dict[str, Any] = {}
    for n, last in enumerate((False, True)):
        model.set_is_last_backward(last)
        out[f"step {n}"] = step(model, rank, world, n)
        out[f"grads {n}"] = grads(model)
    out["vs_one_process"] = max_diff(out["grads 1"], ref_grads(ref, world, (0, 1))) <= 1e-12
    return out


def c_requires_gradient_sync(rank: int, world: int, api: Any) -> dict:
    """set_requires_gradient_sync(False) for one micro-batch, True for the next: which
    parameters have gradients after each, the final gradients, the collectives."""
    model, ref = make()
    shard(api, model)
    out: dict[str, Any] = {}
    for n, sync in enumerate((False, True)):
        model.set_requires_gradient_sync(sync)
        trace = Trace(model)
        out[f"step {n}"] = step(model, rank, world, n, trace)
        out[f"rs {n}"] = trace.reduces()
        out[f"has grad {n}"] = {k: p.grad is not None for k, p in model.named_parameters()}
    out["grads"] = grads(model)
    out["vs_one_process"] = max_diff(out["grads"], ref_grads(ref, world, (0, 1))) <= 1e-12
    return out


def c_requires_all_reduce(rank: int, world: int, api: Any) -> dict:
    """HSDP (replicate 2 x shard 1): set_requires_all_reduce(False) for one micro-batch, True
    for the next: the all-reduces, the gradients."""
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    model, ref = make()
    shard(api, model, mesh=mesh)
    out: dict[str, Any] = {}
    for n, ar in enumerate((False, True)):
        model.set_requires_all_reduce(ar)
        with C10dCounter() as c:
            loss_of(model, data(world, n)[rank]).backward()
        out[f"all-reduces {n}"] = c.calls["all_reduce"] > 0
    out["grads"] = grads(model)
    out["vs_one_process"] = max_diff(out["grads"], ref_grads(ref, world, (0, 1))) <= 1e-12
    return out


def c_set_reshard_after_forward(rank: int, world: int, api: Any) -> dict:
    """set_reshard_after_forward(bool) (recurse, and not): what is sharded between forward and
    backward; non-bool values' exception types."""
    out: dict[str, Any] = {}
    model, _ = make()
    shard(api, model)
    model.set_reshard_after_forward(False)
    out["all false"] = step(model, rank, world)
    model.set_reshard_after_forward(True, recurse=False)
    out["root true"] = step(model, rank, world, 1)
    for bad in (2, 1, "yes", None, 0.5):
        out[f"bad {bad!r}"] = raises(lambda b=bad: model.set_reshard_after_forward(b))
    out["grads"] = grads(model)
    return out


def c_reshard_after_backward(rank: int, world: int, api: Any) -> dict:
    """set_reshard_after_backward(False): what stays gathered after backward; the next
    forward's all-gathers."""
    model, _ = make()
    shard(api, model)
    model.set_reshard_after_backward(False)
    model.set_requires_gradient_sync(False)
    out = {"step 0": step(model, rank, world)}
    model.set_reshard_after_backward(True)
    model.set_requires_gradient_sync(True)
    trace = Trace(model)
    out["step 1"] = step(model, rank, world, 1, trace)
    out["trace"] = trace.events()
    out["grads"] = grads(model)
    return out


def c_forward_prefetch(rank: int, world: int, api: Any) -> dict:
    """set_modules_to_forward_prefetch([b1, b2]) on b0: both gathered before b0 computes."""
    return _explicit_prefetch(rank, world, api, "forward")


def c_backward_prefetch(rank: int, world: int, api: Any) -> dict:
    """set_modules_to_backward_prefetch([b0, b1]) on b2 (not the implicit b1 alone): the
    all-gathers of backward, in order."""
    return _explicit_prefetch(rank, world, api, "backward")


def _explicit_prefetch(rank: int, world: int, api: Any, phase: str) -> dict:
    model, _ = make()
    shard(api, model)
    b0, b1, b2 = model.blocks
    setter, targets = (
        (b0.set_modules_to_forward_prefetch, [b1, b2])
        if phase == "forward"
        else (b2.set_modules_to_backward_prefetch, [b0, b1])
    )
    setter(targets)
    trace = Trace(model)  # the first step: a list set before it applies at once
    out = step(model, rank, world, 0, trace)
    return {
        **out,
        "trace": trace.events(),
        "grads": grads(model),
        "not_fsdp": raises(lambda: setter([nn.Linear(2, 2)])),
    }


class _AllGather:
    """FSDP2's custom all-gather interface over torch's own collective; counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: Any, input_tensor: Any, group: Any, async_op: bool = False
    ) -> Any:
        self.calls += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group, async_op=async_op)


class _ReduceScatter(_AllGather):
    def __call__(  # type: ignore[override]
        self, output_tensor: Any, input_tensor: Any, group: Any, op: Any, async_op: bool = False
    ) -> Any:
        self.calls += 1
        # gloo has no AVG: sum, and divide here when FSDP2 asked for an average
        work = dist.reduce_scatter_tensor(
            output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=group
        )
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(dist.get_world_size(group))
        return work


def c_custom_comms(rank: int, world: int, api: Any) -> dict:
    """set_custom_all_gather / set_custom_reduce_scatter: each called once per collective."""
    model, _ = make()
    shard(api, model)
    ag, rs = _AllGather(), _ReduceScatter()
    for m in unit_modules(model).values():
        m.set_custom_all_gather(ag)
        m.set_custom_reduce_scatter(rs)
    step(model, rank, world)
    return {"ag_calls": ag.calls, "rs_calls": rs.calls, "grads": grads(model)}


def c_all_reduce_hook(rank: int, world: int, api: Any) -> dict:
    """set_all_reduce_hook: what the hook receives (fp32, fp64, after
    set_force_sum_reduction_for_comms, with a divide factor, under HSDP), and the gradients
    after a hook that changes the shard in place; the stream= refusal under HSDP."""
    out: dict[str, Any] = {}
    runs: dict[str, dict[str, Any]] = {
        "fp64": {},
        "fp32": {"dtype": torch.float32},
        "force sum": {"force": True},
        "fp32 force sum": {"dtype": torch.float32, "force": True},
        "factor 4": {"factor": 4.0},
        "hsdp": {"hsdp": True},
        "doubling": {"double": True},
    }
    for name, how in runs.items():
        mesh = None
        if how.get("hsdp"):
            mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
        model, _ = make()
        if how.get("dtype"):
            model.to(how["dtype"])
        shard(api, model, **({"mesh": mesh} if mesh is not None else {}))
        seen: list[torch.Tensor] = []

        def hook(t: torch.Tensor, seen: list = seen, how: dict = how) -> None:
            seen.append(t.detach().clone())
            if how.get("double"):
                t.mul_(2)

        for m in unit_modules(model).values():
            m.set_all_reduce_hook(hook)
            if how.get("force"):
                m.set_force_sum_reduction_for_comms(True)
            if how.get("factor"):
                m.set_gradient_divide_factor(how["factor"])
        step(model, rank, world)
        # the shards' layouts differ (each pads in its own way): compare each unit's sum and
        # norm, which show the scale the hook saw
        summary = sorted((float(t.norm()), float(t.sum())) for t in seen)
        dtype = how.get("dtype", torch.float64)
        out[name] = {"seen": torch.tensor(summary, dtype=dtype), "grads": grads(model)}
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    model, _ = make()
    shard(api, model, mesh=mesh)
    stream = torch.cpu.Stream()
    try:
        model.set_all_reduce_hook(lambda t: None, stream=stream)
        out["hsdp stream"] = ("none", "")
    except Exception as exc:
        out["hsdp stream"] = (kind(exc), str(exc))
    return out


def c_post_optim_event(rank: int, world: int, api: Any) -> dict:
    """set_post_optim_event: the next forward waits for the event instead; the step's
    gradients are unchanged."""
    model, _ = make()
    shard(api, model)
    step(model, rank, world)
    outcome = raises(lambda: model.set_post_optim_event(torch.Event("cpu")))
    try:
        out = step(model, rank, world, 1)
        second = "none"
    except Exception as exc:
        out, second = {}, kind(exc)
    return {"set": outcome, "step": second, **out}


def c_divide_factors(rank: int, world: int, api: Any) -> dict:
    """set_gradient_divide_factor; set_reduce_scatter_divide_factor (deprecated: its warning)."""
    out: dict[str, Any] = {}
    model, _ = make()
    shard(api, model)
    for m in unit_modules(model).values():
        m.set_gradient_divide_factor(1.0)
    step(model, rank, world)
    out["factor 1"] = grads(model)
    model, _ = make()
    shard(api, model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.set_reduce_scatter_divide_factor(4.0)
    out["warnings"] = sorted({w.category.__name__ for w in caught})
    out["warning_text"] = sorted({str(w.message) for w in caught})
    step(model, rank, world)
    out["old name"] = grads(model)
    return out


class _Unused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(D, D)
        self.unused = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def c_reduce_scatter_unused_params(rank: int, world: int, api: Any) -> dict:
    """set_reduce_scatter_unused_params: a parameter no rank used gets a gradient (zero) with
    True, none without."""
    out: dict[str, Any] = {}
    for flag in (False, True):
        torch.manual_seed(0)
        m = _Unused()
        api.fully_shard(m)
        if flag:
            m.set_reduce_scatter_unused_params(True)
        x = torch.randn(3, D, generator=torch.Generator().manual_seed(rank))
        m(x).square().mean().backward()
        out[str(flag)] = grads(m)
    return out


def c_max_input_buffers(rank: int, world: int, api: Any) -> dict:
    """set_reduce_scatter_max_input_buffers: the argument's checks, the gradients with 2."""
    model, _ = make()
    shard(api, model)
    out = {
        "bool": raises(lambda: model.set_reduce_scatter_max_input_buffers(True)),
        "float": raises(lambda: model.set_reduce_scatter_max_input_buffers(2.0)),
        "zero": raises(lambda: model.set_reduce_scatter_max_input_buffers(0)),
        "two": raises(lambda: model.set_reduce_scatter_max_input_buffers(2)),
    }
    out.update(step(model, rank, world))
    out["grads"] = grads(model)
    return out


def c_separate_reduce_scatter_group(rank: int, world: int, api: Any) -> dict:
    """set_separate_reduce_scatter_group: reduce-scatters on a group other than the
    all-gathers'; the gradients; False goes back."""
    out: dict[str, Any] = {}
    for enable in (True, False):
        model, _ = make()
        shard(api, model)
        model.set_separate_reduce_scatter_group(True)
        if not enable:
            model.set_separate_reduce_scatter_group(False)
        with _Groups() as g:
            step(model, rank, world)
        out[str(enable)] = {"separate": g.separate(), "grads": grads(model)}
    return out


class _Groups(C10dCounter):
    """The process groups (by name) the all-gathers and the reduce-scatters ran on."""

    def __init__(self) -> None:
        super().__init__()
        self.groups: dict[str, set[str]] = {"gather": set(), "reduce": set()}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "c10d":
            op = func._opname
            kind_ = (
                "gather"
                if "allgather" in op
                else "reduce"
                if "scatter" in op or "alltoall" in op
                else ""
            )
            for a in args:
                if kind_ and isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a):
                    self.groups[kind_].add(dist.ProcessGroup.unbox(a).group_name)  # boxed
        return super().__torch_dispatch__(func, types, args, kwargs)

    def separate(self) -> bool:
        return bool(self.groups["reduce"]) and not (self.groups["reduce"] & self.groups["gather"])


class _Embedded(nn.Module):
    """An embedding far larger than the rest, so their collectives' bytes tell them apart."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(128, D)  # 1024 elements
        self.body = Blk(400)  # 473
        self.head = nn.Linear(D, V, bias=False)  # the root's 128

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(idx)))


def c_unshard_in_backward(rank: int, world: int, api: Any) -> dict:
    """set_unshard_in_backward(False) on a unit whose backward needs no parameter (an
    embedding): not gathered in backward, its gradient still reduced."""
    torch.manual_seed(0)
    model = _Embedded()
    api.fully_shard(model.embed)
    api.fully_shard(model.body)
    api.fully_shard(model)
    model.embed.set_unshard_in_backward(False)
    units = {"root": model, "embed": model.embed, "body": model.body}
    trace = Trace(units)
    with trace:
        idx = torch.randint(128, (2, 5), generator=torch.Generator().manual_seed(rank))
        model(idx).square().mean().backward()
    return {"trace": trace.events(), "reduces": trace.reduces(), "grads": grads(model)}


def c_comm_allocation(rank: int, world: int, api: Any) -> dict:
    """set_allocate_memory_from_process_group_for_comm and set_symm_mem_for_comm: accepted on
    the default collectives (gloo: ordinary buffers), refused beside a custom collective."""
    out: dict[str, Any] = {}
    model, _ = make()
    shard(api, model)
    out["alloc"] = raises(lambda: model.set_allocate_memory_from_process_group_for_comm(True))
    try:
        step(model, rank, world)
        out["alloc step"] = "none"
        out["alloc grads"] = grads(model)
    except Exception as exc:
        out["alloc step"] = kind(exc)
    model, _ = make()
    shard(api, model)
    model.set_custom_all_gather(_AllGather())
    out["alloc custom"] = raises(
        lambda: model.set_allocate_memory_from_process_group_for_comm(True)
    )
    out["symm custom"] = raises(lambda: model.set_symm_mem_for_comm())
    return out


def c_cast_after_init(rank: int, world: int, api: Any) -> dict:
    """Module._apply after fully_shard (model.to(float32)): dtypes, still DTensors, trains."""
    model, _ = make()
    shard(api, model)
    model.to(torch.float32)
    out = step(model, rank, world)
    return {
        **out,
        "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "dtensors": all(isinstance(p, DTensor) for p in model.parameters()),
        "grads": grads(model),
    }


# -- torch 2.15 ----------------------------------------------------------------------------------
def c_manual_finalization(rank: int, world: int, api: Any) -> dict:
    """2.15's set_manual_backward_finalization + finalize_backward(async_op=True) +
    GradientReductionHandle, as a pipeline stage runs them: micro-batches without sync, then
    sync on and one finalize: no gradient before it, one process's after, each unit
    reduce-scattered once; and a backward's end that finishes nothing."""
    model, ref = make()
    shard(api, model)
    if not hasattr(model, "finalize_backward"):
        return {"absent": True}
    out: dict[str, Any] = {}
    model.set_manual_backward_finalization(True)
    model.set_requires_gradient_sync(False)
    trace = Trace(model)
    with trace:
        for n in (0, 1):
            loss_of(model, data(world, n)[rank]).backward()
        out["grads_before"] = any(p.grad is not None for p in model.parameters())
        model.set_requires_gradient_sync(True)
        handle = model.finalize_backward(async_op=True)
        out["handle"] = type(handle).__name__
        handle.wait()
    out["after"] = sharded(model)
    out["rs_per_unit"] = trace.reduces()
    out["grads"] = grads(model)
    out["vs_one_process"] = max_diff(out["grads"], ref_grads(ref, world, (0, 1))) <= 1e-12
    out["in_backward"] = _set_in_backward(model)
    out["left_gathered"] = _left_gathered(rank, api)
    model.set_manual_backward_finalization(False)
    model.zero_grad(set_to_none=True)
    out["sync finalize"] = repr(model.finalize_backward())
    step(model, rank, world, 2)
    out["next step"] = max_diff(grads(model), ref_grads(ref, world, (2,))) <= 1e-12
    return out


class _Side(nn.Module):
    """A block whose output the loss does not use (its backward never runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.main, self.side = Blk(0), Blk(400)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.side(x)
        return self.head(self.main(x))


def _left_gathered(rank: int, api: Any) -> dict[str, tuple[bool, bool]]:
    """A unit kept gathered after forward (reshard_after_forward=False) that no backward
    reaches: whether it is sharded after the backward, and after finalize_backward. A
    backward's end reshards it; under manual finalization it waits for finalize_backward."""
    out = {}
    for manual in (False, True):
        torch.manual_seed(0)
        m = _Side()
        api.fully_shard(m.main)
        api.fully_shard(m.side, reshard_after_forward=False)
        api.fully_shard(m)
        m.set_manual_backward_finalization(manual)
        x = torch.randn(3, D, generator=torch.Generator().manual_seed(rank))
        m(x).square().mean().backward()
        after = isinstance(m.side.lin.weight, DTensor)
        m.finalize_backward()
        out[str(manual)] = (after, isinstance(m.side.lin.weight, DTensor))
    return out


def _set_in_backward(model: Model) -> str:
    """set_manual_backward_finalization during a backward: its exception type."""
    got = ["none"]

    def hook(g: torch.Tensor) -> torch.Tensor:
        got[0] = raises(lambda: model.set_manual_backward_finalization(False))
        return g

    leaf = torch.ones(2, requires_grad=True)
    y = leaf * 2
    y.register_hook(hook)
    y.sum().backward()
    return got[0]


def c_keep_unsharded_storage(rank: int, world: int, api: Any) -> dict:
    """2.15's set_keep_unsharded_storage(True): resharding keeps the gathered storage, so the
    gathered parameters keep their addresses across steps; without it the storage is freed."""
    out: dict[str, Any] = {}
    for keep in (False, True):
        model, _ = make()
        shard(api, model)
        if keep:
            if not hasattr(model, "set_keep_unsharded_storage"):
                return {"absent": True}
            model.set_keep_unsharded_storage(True)
        seen: list[torch.Tensor] = []
        model.blocks[1].register_forward_pre_hook(
            lambda m, a, seen=seen: seen.append(m.lin.weight)  # the gathered parameter
        )
        for n in (0, 1):
            step(model, rank, world, n)
        out[str(keep)] = {
            "same_address": seen[0].data_ptr() == seen[1].data_ptr(),
            "kept": seen[1].untyped_storage().size() > 0,
            "after": sharded(model),
            "grads": grads(model),
        }
    return out


def c_param_dtype_override(rank: int, world: int, api: Any) -> dict:
    """2.15's MixedPrecisionPolicy(param_dtype_override_fn=...): the blocks' ``extra`` stays
    fp64 inside a bf16 unit; a dtype other than None / param_dtype / its own is a ValueError."""
    cls = api.MixedPrecisionPolicy
    if "param_dtype_override_fn" not in cls.__dataclass_fields__:
        return {"absent": True}

    def keep_extra(p: nn.Parameter) -> torch.dtype | None:
        return p.dtype if p.ndim == 1 and p.numel() in {e + 1 for e in EXTRA} else None

    mp = cls(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float64, param_dtype_override_fn=keep_extra
    )
    model, _ = make()
    shard(api, model, mp_policy=mp)
    loss_of(model, data(world)[rank]).backward()
    bad = cls(param_dtype=torch.bfloat16, param_dtype_override_fn=lambda p: torch.float16)
    return {
        "seen": model.blocks[1].seen,
        "grad_dtypes": sorted({str(p.grad.dtype) for p in model.parameters()}),
        "bad": raises(lambda: api.fully_shard(Blk(0), mp_policy=bad)),
        "keyword_only": raises(lambda: cls(None, None, None, True, keep_extra)),
    }


CASES: dict[str, Callable[[int, int, Any], dict]] = {
    name[2:]: fn for name, fn in globals().items() if name.startswith("c_") and callable(fn)
}


def api_program(rank: int, world: int, impl: str) -> dict[str, dict]:
    """Every case under ``impl``, each in float64 on a model of its own; a case that raises
    records its traceback and does not hide the others."""
    api = api_of(impl)
    out: dict[str, dict] = {}
    for name, case in CASES.items():
        torch.set_default_dtype(torch.float64)
        try:
            out[name] = case(rank, world, api)
        except Exception:
            out[name] = {"raised": traceback.format_exc()}
        dist.barrier()
    return out
