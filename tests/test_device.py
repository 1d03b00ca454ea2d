"""NOTE [Device discipline]: one helper decides a group's device, and nobody else talks to c10d.

- a source guard: outside ``fullshard.comm`` no code calls a ``torch.distributed`` collective;
- the control-plane helpers make their tensors on ``comm_device(group)`` (checked with a fake
  device, so the test means something on a machine without a GPU) and work on real gloo ranks;
- a CPU tensor meant for NCCL is a clear error that says what to do;
- ``cuda_usable`` explains why CUDA cannot be used here.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks

from fullshard.comm import control, device
from fullshard.policies import FullshardError

SRC = Path(__file__).resolve().parent.parent / "src" / "fullshard"

# Every torch.distributed function that communicates (or waits for the other ranks).
COLLECTIVES = frozenset(
    {
        "all_gather",
        "all_gather_coalesced",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_gather_single",
        "all_reduce",
        "all_reduce_coalesced",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "batch_isend_irecv",
        "broadcast",
        "broadcast_object_list",
        "gather",
        "gather_object",
        "irecv",
        "isend",
        "monitored_barrier",
        "recv",
        "recv_object_list",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_single",
        "reduce_scatter_tensor",
        "scatter",
        "scatter_object_list",
        "send",
        "send_object_list",
    }
)

# Files outside fullshard.comm that may still call c10d directly, each with its reason: none.
ALLOWED: set[str] = set()


def _dist_names(tree: ast.Module) -> tuple[set[str], dict[str, str]]:
    """Names bound to the ``torch.distributed`` module, and collectives imported from it (local
    name -> collective)."""
    modules: set[str] = set()
    functions: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed" and a.asname:
                    modules.add(a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            for a in node.names:
                if node.module == "torch" and a.name == "distributed":
                    modules.add(a.asname or a.name)
                elif node.module.startswith("torch.distributed") and a.name in COLLECTIVES:
                    functions[a.asname or a.name] = a.name
    return modules, functions


def _is_dist_module(node: ast.expr, modules: set[str]) -> bool:
    if isinstance(node, ast.Name):
        return node.id in modules
    # torch.distributed.<fn>, or torch.distributed.distributed_c10d.<fn>
    if isinstance(node, ast.Attribute):
        if node.attr == "distributed":
            return isinstance(node.value, ast.Name) and node.value.id == "torch"
        if node.attr == "distributed_c10d":
            return _is_dist_module(node.value, modules)
    return False


def collective_calls(source: str) -> list[tuple[int, str]]:
    """``(line, name)`` of every call of a torch.distributed collective in ``source``.

    Parsed, not grepped: a collective named in a comment or a docstring is not a call.
    """
    tree = ast.parse(source)
    modules, functions = _dist_names(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in COLLECTIVES:
            if _is_dist_module(f.value, modules):
                found.append((node.lineno, f.attr))
        elif isinstance(f, ast.Name) and f.id in functions:
            found.append((node.lineno, functions[f.id]))
    return sorted(found)


def test_the_guard_sees_calls_not_comments() -> None:
    source = '''
import torch
import torch.distributed as dist
import torch.distributed as c10d
from torch import distributed as td
from torch.distributed import all_reduce as ar, new_group
"""dist.barrier() in a docstring is not a call"""
# dist.all_reduce(t) in a comment is not one either
dist.barrier()
c10d.all_gather_object(out, obj)
td.broadcast(t, src=0)
torch.distributed.reduce_scatter_tensor(out, inp)
torch.distributed.distributed_c10d.send(t, 1)
ar(t)
dist.init_process_group("gloo")
new_group([0, 1])
'''
    calls = collective_calls(source)
    assert [name for _, name in calls] == [
        "barrier",
        "all_gather_object",
        "broadcast",
        "reduce_scatter_tensor",
        "send",
        "all_reduce",
    ]


def test_no_collective_outside_fullshard_comm() -> None:
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith("comm/") or rel in ALLOWED:
            continue
        for line, name in collective_calls(path.read_text(encoding="utf-8")):
            offenders.append(f"src/fullshard/{rel}:{line}: torch.distributed.{name}")
    assert not offenders, (
        "collectives outside fullshard.comm (use fullshard.comm.control, which puts every "
        "tensor on comm_device(group)):\n" + "\n".join(offenders)
    )
    # the allow-list only names files that still need it
    for rel in ALLOWED:
        assert collective_calls((SRC / rel).read_text(encoding="utf-8")), f"{rel}: drop it"


# ----------------------------------------------------------------------------------------------
# the control helpers put their tensors on comm_device(group)


class _Done:
    def wait(self) -> None:
        pass


@pytest.fixture
def meta_comm(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, torch.device]]:
    """``comm_device`` says "meta", and the collectives record the devices they were handed."""
    seen: list[tuple[str, torch.device]] = []

    def all_reduce(t: torch.Tensor, group: Any, **kw: Any) -> _Done:
        seen.append(("all_reduce", t.device))
        return _Done()

    def all_gather(out: torch.Tensor, shard: torch.Tensor, group: Any, **kw: Any) -> _Done:
        seen.append(("all_gather", out.device))
        seen.append(("all_gather", shard.device))
        return _Done()

    monkeypatch.setattr(control, "comm_device", lambda group=None: torch.device("meta"))
    monkeypatch.setattr(control, "all_reduce", all_reduce)
    monkeypatch.setattr(control, "all_gather", all_gather)
    monkeypatch.setattr(control.dist, "get_world_size", lambda group=None: 2)
    return seen


def test_control_helpers_use_comm_device(meta_comm: list[tuple[str, torch.device]]) -> None:
    control.barrier()
    out = control.all_reduce_values([1.0, 2.0], "max")
    assert out.device.type == "meta" and out.dtype == torch.float64
    # a host tensor handed in is moved to the group's device, not reduced where it was
    out = control.all_reduce_values(torch.ones(3), "sum")
    assert out.device.type == "meta"
    table = control.all_gather_values([1.0, 2.0, 3.0])
    assert table.device.type == "meta" and tuple(table.shape) == (2, 3)
    kinds = [kind for kind, _ in meta_comm]
    assert kinds == ["all_reduce", "all_reduce", "all_reduce", "all_gather", "all_gather"]
    assert all(d.type == "meta" for _, d in meta_comm), meta_comm


def _control_on_ranks(rank: int, world: int) -> dict[str, Any]:
    total = control.all_reduce_values([rank + 1.0, 1.0], "sum").tolist()
    top = control.all_reduce_values(torch.tensor([float(rank)]), "max").tolist()
    table = control.all_gather_values([rank, 10.0 * rank]).tolist()
    objects = control.all_gather_objects({"rank": rank})
    word = control.broadcast_object("from rank 0" if rank == 0 else "not me")
    control.barrier(what="test barrier")
    control.host_barrier(what="test host barrier")
    return {"total": total, "max": top, "table": table, "objects": objects, "word": word}


def test_control_helpers_on_gloo_ranks() -> None:
    results = run_ranks(_control_on_ranks, 3)
    for r in results:
        assert r["total"] == [6.0, 3.0]
        assert r["max"] == [2.0]
        assert r["table"] == [[0.0, 0.0], [1.0, 10.0], [2.0, 20.0]]
        assert r["objects"] == [{"rank": 0}, {"rank": 1}, {"rank": 2}]
        assert r["word"] == "from rank 0"


# ----------------------------------------------------------------------------------------------
# which devices a backend moves, and the error for the wrong one


@pytest.mark.parametrize(
    ("backend", "accepted"),
    [
        ("nccl", {"cuda"}),
        ("gloo", {"cpu", "cuda"}),
        ("cpu:gloo,cuda:nccl", {"cpu", "cuda"}),
    ],
)
def test_accepted_devices(monkeypatch: pytest.MonkeyPatch, backend: str, accepted: set) -> None:
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    assert device.accepted_devices() == accepted


def test_cpu_tensor_for_nccl_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    device.check_device(torch.device("cuda", 0), None, "all-gather of unit blocks.0")
    with pytest.raises(FullshardError) as err:
        device.check_tensor(torch.zeros(1), None, "all-gather of unit blocks.0")
    message = str(err.value)
    assert "rank 0" in message and "all-gather of unit blocks.0" in message
    assert "cpu tensor" in message and "(nccl)" in message
    assert "model.to('cuda')" in message and "gloo" in message  # what to do


def test_comm_device_follows_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert device.comm_device() == torch.device("cpu")  # gloo: no device round trip for a flag


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_usable_says_why_not_here() -> None:
    message = device.cuda_usable(0)
    assert message.startswith("no CUDA device is visible")
    assert "--device cpu" in message
