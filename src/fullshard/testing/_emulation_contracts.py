"""What CUDA kernels demand that their CPU twins do not, checked under ``cuda_emulation``.

NOTE [Kernel contracts]
The emulation runs CPU kernels. Where a CUDA kernel refuses an input that the CPU kernel
accepts (a float64 learning rate, a host tensor handed to NCCL), or misreads it silently (a
float64 step count read through a ``float*``), the emulated run passes and the first GPU run
fails. So the ops the engine and the trainer call check, before they run, the preconditions of
their CUDA implementations, read in torch's CUDA sources (``aten/src/ATen/native/cuda/``):

| op | contract on the device | source |
| --- | --- | --- |
| ``_fused_adam(w)_`` | ``lr`` (tensor), ``grad_scale``, ``found_inf`` on the params' device and float32 (read through ``float*``); a host ``lr`` is read with ``item()`` | FusedAdamKernel.cu, FusedAdamWKernel.cu (device checks), fused_adam(w)_impl.cu (``lr.const_data_ptr<float>()``) |
| ``_fused_adam(w)_`` | step counts on the device and float32 (``reinterpret_cast<const float*>``: a float64 count is misread, silently) | fused_adam_utils.cuh (``FusedAdamMathFunctor``) |
| ``_fused_adam(w)_``, ``_fused_sgd_`` | params, grads and states on one device, of one dtype (unless AdamW's mixed precision) | ForeachUtils.h (``check_fast_path_restrictions``) |
| ``_fused_sgd_`` | as Adam's: ``lr``, ``grad_scale``, ``found_inf`` on the device, float32 | FusedSgdKernel.cu (``lr.data_ptr<float>()``) |
| fused ops on host params (CPU offload) | no device ``lr``/``grad_scale``/``found_inf``: torch's optimizer moves them with ``.to("cpu", non_blocking=True)``, an asynchronous copy into pinned memory that the CPU kernel reads at once, before it lands | torch/optim/adam.py, adamw.py, sgd.py (``_fused_*``), TensorConversions.cpp (``_to_copy`` pins a non-blocking copy to the host) |
| ``_amp_foreach_non_finite_check_and_unscale_`` | ``found_inf``, ``inv_scale``: device, one element, float32; the grads on the device | AmpKernels.cu |
| ``_amp_update_scale_`` | scale float32, ``growth_tracker`` int32, ``found_inf`` float32, all on the device, one element | AmpKernels.cu |
| ``_foreach_*`` | the lists' tensors on one device (the slow path's per-tensor ops refuse a mix); a tensor scalar 0-dim | ForeachUtils.h (``check_foreach_api_restrictions``), ForeachBinaryOpScalarTensor.cu |
| collectives (NCCL) | device tensors only, dense and contiguous; inputs and outputs of one dtype | ProcessGroupNCCL.cpp (``check_gpu_single_tensor``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``) |
| reductions inside ``same_bits()`` | none: a CUDA reduction's order follows its launch shape, so a sum over rows a rank holds differs with the number of rows; add elementwise in a fixed tree | Reduce.cuh (``ReduceConfig`` from the input's shape) |

A broken contract raises ``KernelContractError`` naming the op, the argument and the fix.
Also counted, not raised: torch's fill of uninitialised memory (``torch.empty`` and its
relatives are filled with NaN under ``use_deterministic_algorithms`` while
``torch.utils.deterministic.fill_uninitialized_memory`` is on): ``fill_counts()`` by call site.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

import torch

DEVICE = "device"  # what a device storage is (``_emulation_core`` marks storages with it)


class Emulated(Protocol):
    """What a contract reads of the emulation (``_emulation_core.Emulation``): where a tensor
    lives, and the ``same_bits()`` blocks open. A protocol, so that the machinery imports the
    contracts and not the other way round."""

    same_bits: list[str]

    def kind(self, t: torch.Tensor) -> str: ...


_FILLS: Counter[str] = Counter()  # call site -> bytes torch filled


class KernelContractError(RuntimeError):
    """An input a CUDA kernel refuses or misreads, which its CPU twin accepts."""


def _named(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The op's arguments by their schema names."""
    out = {}
    for i, arg in enumerate(func._schema.arguments):
        out[arg.name] = args[i] if i < len(args) else kwargs.get(arg.name)
    return out


def _fail(op: str, what: str, source: str, fix: str) -> KernelContractError:
    return KernelContractError(f"{op}: {what} ({source}). {fix}")


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


# c10's names of scalar types, as CUDA's error messages print them
_C10 = {torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16"}


def _fused(emu: Emulated, op: str, a: dict[str, Any], lists: tuple[str, ...], src: str) -> None:
    params = a["self"]
    if not params:
        return
    on_device = emu.kind(params[0]) == DEVICE
    scalars: dict[str, torch.Tensor] = {
        n: t for n in ("lr", "grad_scale", "found_inf") if isinstance(t := a.get(n), torch.Tensor)
    }
    if not on_device:
        for name, t in scalars.items():
            if emu.kind(t) == DEVICE:
                raise _fail(
                    op,
                    f"the parameters are host memory (the CPU kernel runs), but {name} is a "
                    "device tensor: torch's optimizer moves it with .to('cpu', "
                    "non_blocking=True), an asynchronous copy into pinned memory, and the CPU "
                    "kernel reads it at once, before the copy has landed",
                    "torch/optim/adam.py _fused_adam; TensorConversions.cpp _to_copy",
                    f"Give a host {name} (copied behind an event the host has waited for), or "
                    "decide the step on the host where the parameters live there",
                )
        return
    for name in lists:
        for t in a.get(name) or ():
            if emu.kind(t) != DEVICE:
                raise _fail(
                    op,
                    f"{name} holds a host tensor beside device parameters",
                    f"{src}: check_fast_path_restrictions",
                    "Keep the optimizer's parameters, gradients and states on one device",
                )
    for name, t in scalars.items():
        if name == "lr" and emu.kind(t) != DEVICE:
            continue  # a host lr: the CUDA kernel reads it with lr.item<double>()
        if emu.kind(t) != DEVICE:
            raise _fail(
                op,
                f"{name} is a host tensor",
                f"{src}: '{name} must be on the same GPU device as the params'",
                f"Make {name} on the parameters' device",
            )
        if t.dtype != torch.float32:
            raise _fail(
                op,
                f"{name} is {_dtype(t)}; the CUDA kernel reads it through a float pointer "
                f"('expected scalar type Float but found {_C10.get(t.dtype, _dtype(t))}')",
                f"{src}: {name}.data_ptr<float>()",
                f"Make {name} a float32 tensor",
            )
    for t in a.get("state_steps") or ():
        if emu.kind(t) != DEVICE or t.dtype != torch.float32:
            raise _fail(
                op,
                f"a step count is a {'device' if emu.kind(t) == DEVICE else 'host'} "
                f"{_dtype(t)} tensor; the CUDA kernel reads it from the device as a float "
                "(reinterpret_cast<const float*>): anything else is misread without an error",
                "fused_adam_utils.cuh: FusedAdamMathFunctor",
                "Keep torch's own step counts (float32 on the parameters' device)",
            )


def _fused_adam(emu: Emulated, op: str, a: dict[str, Any]) -> None:
    lists: tuple[str, ...] = ("self", "grads", "exp_avgs", "exp_avg_sqs")
    if a.get("amsgrad"):
        lists += ("max_exp_avg_sqs",)
    _fused(emu, op, a, lists, "FusedAdamWKernel.cu / FusedAdamKernel.cu")


def _fused_sgd(emu: Emulated, op: str, a: dict[str, Any]) -> None:
    _fused(emu, op, a, ("self", "grads", "momentum_buffer_list"), "FusedSgdKernel.cu")


def _one_float_on_device(
    emu: Emulated, op: str, a: dict[str, Any], names: tuple[str, ...], dtype: torch.dtype
) -> None:
    for name in names:
        t = a[name]
        kind = "an int" if dtype == torch.int32 else "a float"
        if emu.kind(t) != DEVICE or t.numel() != 1 or t.dtype != dtype:
            raise _fail(
                op,
                f"{name} is a {'device' if emu.kind(t) == DEVICE else 'host'} {_dtype(t)} "
                f"tensor of {t.numel()} elements",
                f"AmpKernels.cu: '{name} must be a CUDA tensor', 'a 1-element tensor', "
                f"'{kind} tensor'",
                f"Make {name} one {_dtype(torch.empty((), dtype=dtype))} element on the device",
            )


def _unscale(emu: Emulated, op: str, a: dict[str, Any]) -> None:
    grads = a["self"]
    if not grads:
        return
    _one_float_on_device(emu, op, a, ("found_inf", "inv_scale"), torch.float32)
    if any(emu.kind(g) != DEVICE for g in grads):
        raise _fail(
            op,
            "a gradient is a host tensor",
            "AmpKernels.cu: 'one of scaled_grads was not a CUDA tensor'",
            "Unscale host gradients with the CPU scaler (GradScaler('cpu'))",
        )


def _update_scale(emu: Emulated, op: str, a: dict[str, Any]) -> None:
    _one_float_on_device(emu, op, a, ("self", "found_inf"), torch.float32)
    _one_float_on_device(emu, op, a, ("growth_tracker",), torch.int32)


def _foreach(emu: Emulated, op: str, a: dict[str, Any]) -> None:
    lists = [v for v in a.values() if isinstance(v, (list, tuple)) and v]
    tensors = [t for v in lists for t in v if isinstance(t, torch.Tensor)]
    kinds = {emu.kind(t) == DEVICE for t in tensors}
    if len(kinds) > 1:
        raise _fail(
            op,
            "its lists mix device and host tensors",
            "ForeachUtils.h: the slow path's per-tensor ops refuse tensors on two devices",
            "Group the tensors by device first (as torch's _group_tensors_by_device_and_dtype)",
        )
    other, scalars = a.get("other"), a.get("scalars")
    if isinstance(other, torch.Tensor) and kinds == {False} and emu.kind(other) == DEVICE:
        raise _fail(
            op,
            "a device tensor scalar with host tensors: CUDA refuses the mix ('Expected all "
            "tensors to be on the same device'), and a .to('cpu') before it, which the "
            "emulation cannot see (its device is the CPU), blocks the host",
            "ForeachBinaryOpScalarTensor.cu: the per-tensor slow path",
            "Read the value on the host once (.cpu(), counted), or keep the tensors on the device",
        )
    if isinstance(other, torch.Tensor) and other.dim() != 0:
        raise _fail(
            op,
            f"the tensor scalar has {other.dim()} dimensions",
            "ForeachBinaryOpScalarTensor.cu: 'scalar tensor expected to be 0 dim'",
            "Pass a 0-dim tensor",
        )
    if isinstance(scalars, torch.Tensor) and emu.kind(scalars) == DEVICE:
        raise _fail(
            op,
            "its tensor of scalars is a device tensor",
            "ForeachUtils.h convert_tensor_to_scalar_list: 'Expected scalars to be on CPU'",
            "Pass the scalars as a host tensor (or a list of numbers)",
        )


_REDUCTIONS = frozenset(
    {
        "sum",
        "nansum",
        "mean",
        "prod",
        "norm",
        "linalg_vector_norm",
        "_foreach_norm",
        "var",
        "std",
        "var_mean",
        "std_mean",
        "cumsum",
        "cumprod",
        "logsumexp",
        "dot",
        "mv",
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "matmul",
        "_softmax",
        "_log_softmax",
    }
)


_RULES: dict[str, Callable[[Emulated, str, dict[str, Any]], None]] = {
    "_fused_adam_": _fused_adam,
    "_fused_adamw_": _fused_adam,
    "_fused_sgd_": _fused_sgd,
    "_amp_foreach_non_finite_check_and_unscale_": _unscale,
    "_amp_update_scale_": _update_scale,
}


def check(emu: Emulated, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise ``KernelContractError`` where the CUDA kernel of ``func`` would refuse (or misread)
    these arguments (NOTE [Kernel contracts])."""
    name = func._schema.name.split("::")[-1]
    op = str(func)
    rule = _RULES.get(name)
    if rule is None and name.startswith("_foreach_"):
        rule = _foreach
    if rule is not None:
        rule(emu, op, _named(func, args, kwargs))
    if emu.same_bits and name in _REDUCTIONS:
        touched = [t for v in args for t in (v if isinstance(v, (list, tuple)) else [v])]
        if any(isinstance(t, torch.Tensor) and emu.kind(t) == DEVICE for t in touched):
            raise _fail(
                op,
                f"a reduction inside same_bits() ({emu.same_bits[-1]}): its CUDA kernel's "
                "order follows the launch shape, so the same values sum differently when a "
                "rank holds a different number of rows",
                "Reduce.cuh: ReduceConfig is chosen from the input's shape",
                "Add elementwise in a tree fixed by the values' own extent (slices and adds)",
            )


def check_collective(emu: Emulated, name: str, tensors: list[torch.Tensor]) -> None:
    """NCCL's own checks on the tensors of collective ``name`` (all-device emulation only:
    elsewhere unmarked tensors are the test's host tensors)."""
    for t in tensors:
        if emu.kind(t) != DEVICE:
            raise _fail(
                name,
                f"a host tensor ({_dtype(t)}, shape {list(t.shape)}) is handed to the collective",
                "ProcessGroupNCCL.cpp check_gpu_single_tensor: 'Tensors must be CUDA and dense'",
                "Make it on the group's device (comm.device.comm_device)",
            )
        if not t.is_contiguous():
            raise _fail(
                name,
                f"a non-contiguous tensor (shape {list(t.shape)}, stride {list(t.stride())})",
                "ProcessGroupNCCL.cpp check_gpu_single_tensor: 'Tensors must be contiguous'",
                "Pass a contiguous tensor (.contiguous(), or a flat buffer)",
            )
    if len({t.dtype for t in tensors}) > 1:
        raise _fail(
            name,
            f"its tensors have dtypes {sorted({_dtype(t) for t in tensors})}",
            "ProcessGroupNCCL.cpp: 'output tensor must have the same type as input tensor'",
            "Cast to one dtype before the collective",
        )


_EMPTY = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"})


def count_fill(func: Any, out: Any, site: Callable[[], str]) -> None:
    """Count the bytes torch filled in ``func``'s new tensor (NOTE [Kernel contracts])."""
    if func._schema.name.split("::")[-1] not in _EMPTY or not isinstance(out, torch.Tensor):
        return
    if torch.are_deterministic_algorithms_enabled() and _fill_on():
        _FILLS[site()] += out.untyped_storage().nbytes()


def _fill_on() -> bool:
    import torch.utils.deterministic

    return bool(torch.utils.deterministic.fill_uninitialized_memory)  # type: ignore[attr-defined]


def fill_counts() -> dict[str, int]:
    """Bytes of fresh memory torch filled (deterministic mode) by call site, since the reset."""
    return dict(_FILLS)


def reset_fill_counts() -> None:
    _FILLS.clear()
