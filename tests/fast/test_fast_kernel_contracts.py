"""NOTE [Kernel contracts] (``fullshard/testing/_emulation_contracts.py``): under the CUDA
emulation, each op checks what its CUDA kernel demands and its CPU twin does not, raising with
the broken precondition and passing without it; the fill counter; and the fixed-order slice
sums that need no reduction kernel."""

from __future__ import annotations

import math

import pytest
import torch

from fullshard.deterministic import _slice_squares
from fullshard.testing.emulation import (
    KernelContractError,
    cuda_emulation,
    emulated_collective,
    fill_counts,
    same_bits,
)

pytestmark = pytest.mark.fast


def _adamw(lr: torch.Tensor, found_inf: torch.Tensor | None = None, **opt: object) -> None:
    p = torch.nn.Parameter(torch.ones(8))
    p.grad = torch.full((8,), 0.5)
    torch.optim.AdamW([p], lr=lr, fused=True, **opt).step()  # type: ignore[arg-type]
    if found_inf is not None:
        adam = torch.optim.AdamW([p], lr=lr, fused=True)
        adam.found_inf = found_inf  # type: ignore[attr-defined]
        adam.step()


def test_fused_adamw_takes_a_float32_device_lr_and_refuses_float64() -> None:
    with cuda_emulation(all_device=True):
        _adamw(torch.full((), 1e-3, dtype=torch.float32))  # what the CUDA kernel reads
        with pytest.raises(KernelContractError, match="lr is float64.*found Double"):
            _adamw(torch.full((), 1e-3, dtype=torch.float64))
        with pytest.raises(KernelContractError, match="found_inf is float64"):
            _adamw(torch.full((), 1e-3), found_inf=torch.zeros((), dtype=torch.float64))


def test_a_host_kernel_refuses_device_inputs_it_would_read_before_their_copy_lands() -> None:
    """CPU offload: parameters in (pinned) host memory, lr and found_inf on the device."""
    with cuda_emulation(all_device=True):
        p = torch.nn.Parameter(torch.ones(8, pin_memory=True))
        p.grad = torch.full((8,), 0.5, pin_memory=True)
        lr = torch.full((), 1e-3)  # a device tensor (all-device emulation)
        with pytest.raises(KernelContractError, match="parameters are host memory.*lr is a device"):
            torch.optim.AdamW([p], lr=lr, fused=True).step()  # type: ignore[arg-type]
        host_lr = torch.full((), 1e-3, pin_memory=True)
        torch.optim.AdamW([p], lr=host_lr, fused=True).step()  # type: ignore[arg-type]


def test_step_counts_must_be_float32_on_the_device() -> None:
    with cuda_emulation(all_device=True):
        params = [torch.ones(4)]
        states = [torch.zeros(4), torch.zeros(4)]
        kwargs = dict(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.0, eps=1e-8)
        flags = dict(amsgrad=False, maximize=False)
        good = [torch.ones((), dtype=torch.float32)]
        torch._fused_adamw_(
            params, [torch.ones(4)], [states[0]], [states[1]], [], good, **kwargs, **flags
        )  # type: ignore[arg-type]
        bad = [torch.ones((), dtype=torch.float64)]
        with pytest.raises(KernelContractError, match="step count.*float64.*misread"):
            torch._fused_adamw_(
                params, [torch.ones(4)], [states[0]], [states[1]], [], bad, **kwargs, **flags
            )  # type: ignore[arg-type]


def test_fused_sgd_lr_is_float32_too() -> None:
    with cuda_emulation(all_device=True):
        for dtype, ok in ((torch.float32, True), (torch.float64, False)):
            p = torch.nn.Parameter(torch.ones(4))
            p.grad = torch.ones(4)
            opt = torch.optim.SGD(
                [p], lr=torch.full((), 0.1, dtype=dtype), momentum=0.9, fused=True
            )
            if ok:
                opt.step()
            else:
                with pytest.raises(KernelContractError, match="lr is float64"):
                    opt.step()


def test_the_amp_kernels_want_one_float32_found_inf_and_an_int32_tracker() -> None:
    with cuda_emulation(all_device=True):
        grads = [torch.ones(4)]
        torch._amp_foreach_non_finite_check_and_unscale_(grads, torch.zeros(1), torch.ones(1))
        with pytest.raises(KernelContractError, match="found_inf is a device float64"):
            torch._amp_foreach_non_finite_check_and_unscale_(
                grads, torch.zeros(1, dtype=torch.float64), torch.ones(1)
            )
        scale, found = torch.ones(1), torch.zeros(1)
        torch._amp_update_scale_(scale, torch.zeros(1, dtype=torch.int32), found, 2.0, 0.5, 10)
        with pytest.raises(KernelContractError, match="growth_tracker is a device int64"):
            torch._amp_update_scale_(scale, torch.zeros(1, dtype=torch.int64), found, 2.0, 0.5, 10)


def test_foreach_ops_refuse_mixed_devices_and_a_device_scalar_for_host_tensors() -> None:
    with cuda_emulation(all_device=True):
        dev, host = torch.ones(3), torch.ones(3, pin_memory=True)
        torch._foreach_mul_([dev, torch.ones(2)], torch.tensor(2.0).to("cpu"))
        with pytest.raises(KernelContractError, match="mix device and host"):
            torch._foreach_add_([dev], [host])
        with pytest.raises(KernelContractError, match="device tensor scalar with host tensors"):
            torch._foreach_mul_([host], torch.full((), 2.0))


def test_collectives_take_contiguous_device_tensors_of_one_dtype() -> None:
    with cuda_emulation(all_device=True):
        out = torch.zeros(8)
        emulated_collective([out], [torch.zeros(4)], name="all-gather").wait()
        with pytest.raises(KernelContractError, match="host tensor.*CUDA and dense"):
            emulated_collective([out], [torch.zeros(4, pin_memory=True)], name="all-gather")
        with pytest.raises(KernelContractError, match="non-contiguous"):
            emulated_collective([out], [torch.zeros(4, 2).t()], name="all-gather")
        with pytest.raises(KernelContractError, match="dtypes"):
            emulated_collective([out], [torch.zeros(4, dtype=torch.bfloat16)], name="all-gather")


def test_no_reduction_kernel_where_bits_are_promised() -> None:
    rows = torch.randn(6, 37, dtype=torch.float64)
    with cuda_emulation(all_device=True):
        x = rows.clone()
        x.sum(dim=1)  # outside same_bits: fine
        with same_bits("a rank's slices"):
            with pytest.raises(KernelContractError, match=r"reduction inside same_bits\(\)"):
                x.pow(2).sum(dim=1)
            got = _slice_squares(x, 0)  # elementwise only
    # The sums themselves, against the correctly rounded sums (math.fsum) of the same squares,
    # not against a reduction kernel (whose order follows the CPU's vector width). A derived
    # bound, not a tolerance: each square is added at most depth = ceil(log2(37)) = 6 times on
    # its way up the tree, so the tree is off the true sum s by at most gamma(depth) * s
    # (pairwise summation of non-negative terms, Higham's Accuracy and Stability of Numerical
    # Algorithms, 4.2), and fsum by at most u * s; s <= fsum / (1 - u).
    u = 2.0**-53  # float64's unit roundoff
    depth = math.ceil(math.log2(rows.shape[1]))
    gamma = depth * u / (1 - depth * u)
    for got_row, squares in zip(got.tolist(), rows.pow(2).tolist(), strict=True):
        exact = math.fsum(squares)
        assert abs(got_row - exact) <= (gamma + u) * exact / (1 - u), (got_row, exact)
    # the same rows, whatever the rows around them (a rank's shard at any world size)
    assert torch.equal(_slice_squares(rows[:2], 0), got[:2])
    assert torch.equal(_slice_squares(rows.t().contiguous(), 1), got)  # slices along dim 1
    assert _slice_squares(rows[:0], 0).shape == (0,)


def test_the_deterministic_fill_is_counted() -> None:
    import torch.utils.deterministic as det

    was = torch.are_deterministic_algorithms_enabled(), det.fill_uninitialized_memory
    try:
        torch.use_deterministic_algorithms(True)
        with cuda_emulation(all_device=True):
            det.fill_uninitialized_memory = False
            torch.empty(100)
            assert fill_counts() == {}
            det.fill_uninitialized_memory = True
            torch.empty(100)
            (site, filled), *rest = fill_counts().items()
            assert (filled, rest) == (400, []) and site.startswith(__file__)
    finally:
        torch.use_deterministic_algorithms(was[0])
        det.fill_uninitialized_memory = was[1]
