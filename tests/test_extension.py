"""All-gather extensions (NOTE [All-gather extensions]): tensor-subclass parameters that gather
themselves quantized, as torchao's float8 weights do under FSDP2.

Parity: training through a toy quantized weight (``quant_toy.QuantWeight``) equals one process
that applies the same quantization to the same row chunks (straight-through gradients), in
float64. Bytes: the all-gather of a float8 model moves half the bytes of its bf16 twin and a
quarter of its fp32 one, counted at the c10d level; the reduce-scatter is the same.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from commcount import RS, C10dCounter
from harness import run_ranks
from quant_toy import QuantWeight, fake_quant, quantize_linears
from toy import ToyLM, batches, full_params, loss_of, reference_step, shard_toy

WIRES = {"float8": torch.float8_e4m3fn, "int8": torch.int8}


class _STE(torch.autograd.Function):
    """Forward the quantized weight, pass its gradient to the weight unchanged."""

    @staticmethod
    def forward(ctx: object, w: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return q.clone()

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g, None


def _reference_quant(model: torch.nn.Module, world: int, wire: torch.dtype, scale: str) -> None:
    """Make every block linear of ``model`` compute with its fake-quantized weight."""
    for block in model.blocks:  # type: ignore[union-attr]
        for lin in (block.fc1, block.fc2, block.proj):

            def forward(x: torch.Tensor, lin: torch.nn.Linear = lin) -> torch.Tensor:
                q = fake_quant(lin.weight, world, wire, scale, lin.weight.dtype)
                return F.linear(x, _STE.apply(lin.weight, q), lin.bias)

            lin.forward = forward  # type: ignore[method-assign]


def _parity(rank: int, world: int, wire_name: str, scale: str, pad: bool, steps: int) -> dict:
    torch.set_default_dtype(torch.float64)
    wire = WIRES[wire_name]
    torch.manual_seed(0)
    ref = ToyLM(tie=False)  # a tie to the head would be split by quantizing the head alone
    model = copy.deepcopy(ref)
    for block in model.blocks:
        quantize_linears(block, wire=wire, scale=scale, pad=pad)
    _reference_quant(ref, world, wire, scale)
    model = shard_toy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    data = batches(steps, world)
    loss_diff, losses = 0.0, []
    for step in range(steps):
        loss = loss_of(model, data[step][rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses = reference_step(ref, ref_opt, [data[step][r] for r in range(world)])
        loss_diff = max(loss_diff, abs(loss.item() - ref_losses[rank]))
        losses.append(loss.item())
    got, want = full_params(model), ref.state_dict()
    assert got.keys() == want.keys()
    weight = model.blocks[0].fc1.weight
    return {
        "loss_diff": loss_diff,
        "param_diff": max((got[k] - want[k]).abs().max().item() for k in want),
        "losses": losses,
        "local_type": type(weight._local_tensor).__name__,
        "hook_calls": weight._local_tensor.gathers,
        # the quantization mattered: the plain model's loss differs from the quantized one's
        "quant_effect": abs(loss_of(_plain(), data[0][rank]).item() - losses[0]),
    }


def _plain() -> torch.nn.Module:
    """The model before quantization and training (same seed)."""
    torch.manual_seed(0)
    return ToyLM(tie=False)


@pytest.mark.parametrize(
    "world,wire,scale,pad",
    [
        (2, "float8", "shard", False),  # fullshard pads the short rank's rows
        (3, "int8", "global", True),  # the hook pads (FSDP2's rule); an all-reduce inside it
    ],
)
def test_quantized_gathers_match_one_process_within_1e12(
    world: int, wire: str, scale: str, pad: bool
) -> None:
    results = run_ranks(_parity, world, wire, scale, pad, 3)
    for res in results:
        assert res["loss_diff"] <= 1e-12, res
        assert res["param_diff"] <= 1e-12, res
        assert res["local_type"] == "QuantWeight"  # the sharded local tensor keeps its class
        assert res["hook_calls"] == 6  # forward + backward gather, 3 steps: the hooks ran
        assert res["quant_effect"] > 1e-6  # a test that would notice the quantization
    assert results[0]["losses"][0] != results[0]["losses"][-1]


def _wire_bytes(rank: int, world: int, kind: str) -> dict:
    dims = [64, 64, 64, 64]
    torch.manual_seed(0)
    blocks = [torch.nn.Linear(a, b, bias=False) for a, b in zip(dims, dims[1:], strict=False)]
    model = torch.nn.Sequential(*blocks)
    dtype = torch.float32 if kind == "fp32" else torch.bfloat16
    model.to(dtype)
    if kind == "float8":
        quantize_linears(model, wire=torch.float8_e4m3fn, scale="global")
    from fullshard import fully_shard

    for b in model:
        fully_shard(b)
    fully_shard(model)
    x = torch.randn(4, dims[0], dtype=dtype)
    model(x).float().square().mean().backward()  # step 1: first gathers agree on shapes
    with C10dCounter() as c:
        model(x).float().square().mean().backward()
    grad_dtype = model[0].weight.grad.dtype
    return {"calls": dict(c.calls), "bytes": dict(c.bytes), "grad_dtype": str(grad_dtype)}


def test_float8_all_gather_moves_half_the_bytes_of_bf16() -> None:
    world = 2
    got = {k: run_ranks(_wire_bytes, world, k)[0] for k in ("bf16", "fp32", "float8")}
    units, n, tag = 3, 64 * 64 // world, 5
    # every unit's all-gather: forward and backward, one collective each, however it is sent
    for res in got.values():
        assert res["calls"]["all_gather"] == 2 * units, res
        assert res["calls"][RS] == units, res
    # bytes per gathered unit (all ranks): the rows in the wire dtype, then the position tag
    # (float8: after padding to 16 bytes, NOTE [All-gather extensions])
    bf16 = got["bf16"]["bytes"]["all_gather"]
    fp32 = got["fp32"]["bytes"]["all_gather"]
    fp8 = got["float8"]["bytes"]["all_gather"]
    assert bf16 == 2 * units * world * (2 * n + 2 * tag)
    assert fp32 == 2 * units * world * (4 * n + 4 * tag)
    assert fp8 == 2 * units * world * (n + 16)  # 2048 bytes of float8, 11 padding, 5 tag
    payload = 2 * units * world * n
    assert fp8 - 2 * units * world * 16 == payload == (bf16 - 2 * units * world * 2 * tag) // 2
    assert fp8 < 0.51 * bf16 and fp8 < 0.26 * fp32
    # the gradients are reduced as they were computed: bf16, the same bytes as without float8
    assert got["float8"]["bytes"][RS] == got["bf16"]["bytes"][RS]
    assert got["float8"]["grad_dtype"] == got["bf16"]["grad_dtype"] == "torch.bfloat16"
    # the scale's all-reduce (one per weight per gather) is the toy's own, inside its hook
    assert got["float8"]["calls"]["all_reduce"] == 2 * units
    print(
        f"\nall-gather bytes per step, {world} ranks, 3 x (64x64) units: bf16 {bf16}, "
        f"fp32 {fp32}, float8 {fp8} ({fp8 / bf16:.3f} of bf16)"
    )


def _subclass_state(rank: int, world: int) -> dict:
    """State dicts, ``.to()`` and loading keep the subclass around the flat buffer."""
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model = ToyLM(tie=False)
    for block in model.blocks:
        quantize_linears(block)
    model = shard_toy(model)
    full = full_params(model)
    sd = model.state_dict()
    w = sd["blocks.0.fc1.weight"]
    out = {"sd_local": type(w._local_tensor).__name__}
    # load a changed full state dict: every rank takes its rows, the gathers see them
    new = {k: v + 1.0 for k, v in full.items()}
    model.load_state_dict(new)
    again = full_params(model)
    out["loaded"] = max((again[k] - new[k]).abs().max().item() for k in new)
    model.to(torch.float64)  # an _apply: shards are re-adopted into the flat buffer
    loss = loss_of(model, batches(1, world)[0][rank])
    loss.backward()
    out["local_after_to"] = type(model.blocks[0].fc1.weight._local_tensor).__name__
    out["grad"] = model.blocks[0].fc1.weight.grad is not None
    return out


def test_state_dict_load_and_to_keep_the_subclass() -> None:
    for res in run_ranks(_subclass_state, 2):
        assert res["sd_local"] == "QuantWeight"
        assert res["loaded"] == 0.0
        assert res["local_after_to"] == "QuantWeight"
        assert res["grad"]


def _mismatch(rank: int, world: int) -> str:
    """A hook that returns different shapes on different ranks fails on every rank."""
    from fullshard import fully_shard
    from fullshard.policies import FullshardError

    class Odd(QuantWeight):
        def fsdp_pre_all_gather(self, mesh, size, stride, module, mp):  # type: ignore[no-untyped-def,override]
            inputs, meta = super().fsdp_pre_all_gather(mesh, size, stride, module, mp)
            return (inputs[0][: 1 + mesh.get_rank()], inputs[1]), meta

    lin = torch.nn.Linear(4, 4, bias=False)
    lin.weight = torch.nn.Parameter(Odd(lin.weight.detach()))
    fully_shard(lin)
    try:
        lin(torch.randn(2, 4))
    except FullshardError as e:
        return str(e)
    return ""


def test_mismatched_hook_shapes_fail_on_every_rank() -> None:
    for res in run_ranks(_mismatch, 2):
        assert "differ across ranks" in res and "'weight'" in res, res


def _one_rank_quantized(rank: int, world: int) -> str:
    from fullshard import fully_shard
    from fullshard.policies import FullshardError

    lin = torch.nn.Linear(4, 4, bias=False)
    if rank == 1:
        quantize_linears(lin)
    try:
        fully_shard(lin)
    except FullshardError as e:
        return str(e)
    return ""


def test_a_subclass_on_some_ranks_only_fails_at_fully_shard() -> None:
    for res in run_ranks(_one_rank_quantized, 2):
        assert "differs across ranks" in res and "(QuantWeight)" in res, res
