"""FSDP2 programs for what the rest of torch's FSDP2 tests and the frameworks that call
``fully_shard`` exercise (issue 33): loading into meta-initialised shards with ``assign=True``,
structured activations and activation checkpointing under mixed precision,
``fully_shard.state``, FSDP2's error types. (Freezing and thawing after ``fully_shard``:
``tests/freeze_programs.py``.)

``dropin_program`` runs every case in one launch (as ``fsdp2_gaps.gaps_program``) under torch's
``fully_shard`` or fullshard's, and returns per case the largest difference from one process in
float64 (``diff``) and the named facts its test checks (each must be true).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch
import torch.distributed as dist
from fsdp2_gaps import run_all
from fsdp2_programs import Net, _setup, _train_against, api_of, max_diff, shard
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from toy import DIM, batches, loss_of


class _Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


@dataclasses.dataclass
class _Box:
    x: torch.Tensor
    scale: float


class _Structured(nn.Module):
    """Takes and returns a dataclass and a NamedTuple (test_structured_input_output)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, box: _Box) -> _Pair:
        y = self.lin(box.x) * box.scale
        return _Pair(y, y.relu())


def _structured_activations(rank: int, world: int, impl: str) -> dict:
    """Mixed precision with dataclass / NamedTuple activations: inputs cast, outputs come back
    in their own types, backward runs (bf16 compute, so compared with torch's, not exact)."""
    api = api_of(impl)
    torch.manual_seed(0)
    model = nn.Sequential(_Structured(), _Structured())

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = model[0], model[1]

        def forward(self, box: _Box) -> torch.Tensor:
            p = self.a(box)
            q = self.b(_Box(p.a + p.b, 0.5))
            return (q.a + q.b).float().square().mean()

    root = Two()
    mp = api.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    api.fully_shard(root.a, mp_policy=mp)
    api.fully_shard(root.b, mp_policy=mp)
    api.fully_shard(root, mp_policy=mp)
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        root(_Box(x, 2.0)).backward()
    grads = all(p.grad is not None for p in root.parameters())
    return {"diff": 0.0, "grads": grads}


def _load_assign_into_meta(rank: int, world: int, impl: str, inside: bool = False) -> dict:
    """accelerate's cpu_ram_efficient_loading: shard on meta, then load_state_dict(sd,
    assign=True) of DTensors distributed from rank 0's full weights; trains as one process.
    ``inside``: fully_shard called inside the ``torch.device("meta")`` context too (as torch's
    meta-init tests do), where a buffer the call makes without a device would be meta."""
    ref, src = _setup()
    with torch.device("meta"):
        torch.manual_seed(0)
        model = Net()
        if inside:
            shard(model, impl)
    if not inside:
        shard(model, impl)
    full = src.state_dict()
    sd = {}
    for k, meta_param in model.state_dict().items():
        t = full[k].clone() if rank == 0 else torch.empty_like(full[k])
        dist.broadcast(t, src=0)
        sd[k] = distribute_tensor(t, meta_param.device_mesh, meta_param.placements)
    model.load_state_dict(sd, assign=True)
    on_cpu = all(not p.is_meta and p.device.type == "cpu" for p in model.parameters())
    return {"diff": _train_against(model, ref, rank, world), "on_cpu": on_cpu}


def _checkpoint_under_mixed_precision(rank: int, world: int, impl: str) -> dict:
    """Activation checkpointing around a unit under bf16: the recomputed forward casts its
    inputs and its outputs as the first forward did (test_checkpoint_recompute_casts_*)."""
    from torch.utils.checkpoint import checkpoint

    api = api_of(impl)
    out = {}
    for cast in ("inputs", "outputs"):
        torch.manual_seed(0)

        class Outer(nn.Module):
            def __init__(self, to_dtype: torch.dtype) -> None:
                super().__init__()
                self.lin = nn.Linear(DIM, DIM)
                self.seen: list[torch.dtype] = []
                self.to_dtype = to_dtype

            def run_lin(self, x: torch.Tensor) -> torch.Tensor:
                y = self.lin(x)
                self.seen.append(y.dtype)
                return y

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                # past the root's cast: the unit's own pre-forward must cast it, also recomputed
                x = x.to(self.to_dtype)
                y = checkpoint(self.run_lin, x, use_reentrant=False, early_stop=False)
                return y.float().square().mean()

        model = Outer(torch.float64 if cast == "inputs" else torch.bfloat16)
        if cast == "inputs":
            mp = api.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        else:
            mp = api.MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, output_dtype=torch.float32, cast_forward_inputs=False
            )
        api.fully_shard(model.lin, mp_policy=mp)
        api.fully_shard(model, mp_policy=mp)
        x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(rank))
        model(x).backward()
        want = torch.bfloat16 if cast == "inputs" else torch.float32
        out[f"recomputed_{cast}_cast"] = model.seen == [want, want] or str(model.seen)
    return {"diff": 0.0, **out}


def _error_types(rank: int, world: int, impl: str) -> dict:
    """What FSDP2 refuses raises FSDP2's exception type (code that catches it works)."""
    api = api_of(impl)
    out = {}
    try:  # a module class fully_shard cannot take
        api.fully_shard(nn.ModuleList([nn.Linear(2, 2)]))
        out["module_list_value_error"] = False
    except ValueError:
        out["module_list_value_error"] = True
    try:
        api.fully_shard(nn.Linear(2, 2), reshard_after_forward="yes")  # type: ignore[arg-type]
        out["bad_reshard_value_error"] = False
    except ValueError:
        out["bad_reshard_value_error"] = True
    return {"diff": 0.0, **out}


def _ignored_set_for_the_whole_model(rank: int, world: int, impl: str) -> dict:
    """One ignored_params set passed to every fully_shard call of a model (bottom up): each
    call leaves alone the ignored parameters it holds (test_ddp_A_fsdp_B_ddp_C)."""
    _, model = _setup()
    ignored = {model.blocks[1].gate}
    fs = api_of(impl).fully_shard
    for b in model.blocks:
        fs(b, ignored_params=ignored)
    fs(model, ignored_params=ignored)
    loss_of(model, batches(1, world)[0][rank]).backward()
    return {
        "diff": 0.0,
        "ignored_left_alone": not isinstance(model.blocks[1].gate, DTensor),
        "others_sharded": isinstance(model.blocks[1].fc1.weight, DTensor),
    }


def _jvp_without_warmup(rank: int, world: int, impl: str) -> dict:
    """A unit whose first forward runs inside ``torch.func.jvp``, reshard_after_forward=False,
    bf16 (test_no_warmup_jvp_reshard_after_forward_false): its lazy init and gather run there."""
    api = api_of(impl)
    mp = api.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    torch.manual_seed(0)
    enc, dec = nn.Linear(8, 16, bias=False), nn.Linear(16, 12, bias=False)
    for m in (enc, dec):
        api.fully_shard(m, mp_policy=mp, reshard_after_forward=False)
    x = torch.randn(8, dtype=torch.bfloat16)
    e = enc(x)
    primal = torch.randn(12, dtype=torch.bfloat16, requires_grad=True)
    out, tangent_out = torch.func.jvp(lambda _: dec(e), (primal,), (torch.randn(12).bfloat16(),))
    return {
        "diff": 0.0,
        "output": out.shape == (12,) and out.dtype == torch.bfloat16,
        "tangent_zero": bool((tangent_out == 0).all()),
    }


def _non_contiguous_parameter(rank: int, world: int, impl: str) -> dict:
    """A channels_last conv weight: FSDP2 refuses it (NotImplementedError); fullshard accepts
    it (the shard is a contiguous copy of its rows, the values are the same) and trains it as
    one process does. Each import as documented."""
    api = api_of(impl)
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 4, 3)
    conv.weight = nn.Parameter(conv.weight.detach().to(memory_format=torch.channels_last))
    ref = copy.deepcopy(conv)
    try:
        api.fully_shard(conv)
    except NotImplementedError:
        return {"diff": 0.0, "as_documented": impl == "torch"}
    opt = torch.optim.AdamW(conv.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(5)
    for _ in range(2):
        xs = [torch.randn(2, 2, 6, 6, generator=g) for _ in range(world)]
        conv(xs[rank]).square().mean().backward()
        for x in xs:
            ref(x).square().mean().backward()
        for p in ref.parameters():
            p.grad.div_(world)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    diff = max_diff(dict(conv.named_parameters()), dict(ref.named_parameters()))
    return {"diff": diff, "as_documented": impl == "fullshard"}


def _unnamed_2d_mesh(rank: int, world: int, impl: str) -> dict:
    """A 2-D mesh without dim names: FSDP2 refuses it (AssertionError: its code slices the
    mesh by name); fullshard reads a 2-D mesh by position, (replicate, shard), and trains HSDP
    on it with the same bits as on the same mesh named, and as one process. Each import as
    documented (test_2d_mesh_without_mesh_dim_names is the upstream test of the refusal)."""
    from torch.distributed.device_mesh import init_device_mesh

    got = {}
    for named in (True, False):
        names = ("replicate", "shard") if named else None
        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=names)
        ref, model = _setup()
        try:
            shard(model, impl, mesh=mesh)
        except AssertionError:
            return {"diff": 0.0, "as_documented": impl == "torch" and not named}
        got[named] = (_train_against(model, ref, rank, world), dict(model.named_parameters()))
    same = max_diff(got[True][1], got[False][1]) == 0.0
    return {"diff": got[False][0], "as_documented": impl == "fullshard", "same_bits": same}


def _state_accessor(rank: int, world: int, impl: str) -> dict:
    """``fully_shard.state(module)`` returns the module's FSDP state object (not None)."""
    api = api_of(impl)
    lin = nn.Linear(DIM, DIM)
    api.fully_shard(lin)
    state = api.fully_shard.state(lin)
    return {"diff": 0.0, "state": state is not None}


CASES: dict[str, Callable[[int, int, str], dict]] = {
    "structured activations under mixed precision": _structured_activations,
    "load_state_dict(assign=True) into meta shards": _load_assign_into_meta,
    "fully_shard inside torch.device('meta'), then loaded": partial(
        _load_assign_into_meta, inside=True
    ),
    "activation checkpointing under mixed precision": _checkpoint_under_mixed_precision,
    "FSDP2's error types": _error_types,
    "fully_shard.state(module)": _state_accessor,
    "a non-contiguous parameter: refused by FSDP2, trained by fullshard": _non_contiguous_parameter,
    "a 2-D mesh without names: refused by FSDP2, trained by fullshard": _unnamed_2d_mesh,
    "functorch jvp through a unit's first forward": _jvp_without_warmup,
    "one ignored_params set for the whole model": _ignored_set_for_the_whole_model,
}


def dropin_program(rank: int, world: int, impl: str) -> dict[str, dict]:
    return run_all(CASES, rank, world, impl)
