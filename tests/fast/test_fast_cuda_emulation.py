"""The CUDA emulation's checker: each ordering rule, shown to raise without the ordering and not
with it (NOTE [Happens-before under CUDA emulation])."""

from __future__ import annotations

import datetime
import inspect

import pytest
import torch
import torch.distributed as dist

from fullshard.testing.emulation import (
    StreamOrderError,
    VirtualEvent,
    VirtualStream,
    as_device,
    count_host_sync,
    cuda_emulation,
    current_stream,
    default_stream,
    emulated_collective,
    emulated_pinned,
    enabled_from_env,
    is_active,
    name_tensor,
    reset_sync_counts,
    stream,
    sync_counts,
    synchronize,
    untracked,
)

pytestmark = pytest.mark.fast


def _line() -> int:
    """The caller's line number (for call sites in the sync counter)."""
    frame = inspect.currentframe()
    assert frame is not None and frame.f_back is not None
    return frame.f_back.f_lineno


def _site(line: int) -> str:
    return f"{__file__}:{line}"


# -- streams ------------------------------------------------------------------------------------
@pytest.mark.parametrize("ordered", [False, True])
def test_side_stream_write_then_compute_read_needs_wait_stream(ordered: bool) -> None:
    with cuda_emulation() as emu:
        side = VirtualStream("gather")
        x = as_device(torch.zeros(4))
        with side:
            assert current_stream() is side
            x.fill_(1.0)
        assert current_stream() is emu.compute is default_stream()
        if ordered:
            emu.compute.wait_stream(side)
            assert (x * 2).sum().item() == 8.0
        else:
            with pytest.raises(StreamOrderError, match="stream 'compute' reads.*stream 'gather'"):
                x * 2


def test_same_stream_needs_no_ordering_and_concurrent_reads_are_fine() -> None:
    with cuda_emulation() as emu:
        a, b = VirtualStream("a"), VirtualStream("b")
        x = as_device(torch.ones(3))
        x.add_(1)  # compute writes
        a.wait_stream(emu.compute)
        b.wait_stream(emu.compute)
        with a:
            x * 2
        with b:
            x * 3  # two unordered reads do not conflict
        x + 1  # compute reads its own write


def test_event_snapshot_orders_only_what_came_before_the_record() -> None:
    with cuda_emulation() as emu:
        side = VirtualStream("gather")
        x = as_device(torch.zeros(2))
        early = VirtualEvent()
        early.record(side)  # before the write
        with side:
            x.fill_(3.0)
        emu.compute.wait_event(early)
        with pytest.raises(StreamOrderError):
            x.sum()
        never = VirtualEvent()
        never.wait()  # never recorded: orders nothing
        with pytest.raises(StreamOrderError):
            x.sum()
        late = side.record_event()
        late.wait(emu.compute)
        assert x.sum().item() == 6.0


def test_ordering_is_transitive_through_events() -> None:
    with cuda_emulation() as emu:
        a, b = VirtualStream("a"), VirtualStream("b")
        x = as_device(torch.zeros(2))
        with a:
            x.fill_(1.0)
        b.wait_event(a.record_event())
        with b:
            x.sum()  # b after a
        emu.compute.wait_event(b.record_event())
        x.add_(1)  # compute after b's read, hence after a's write


@pytest.mark.parametrize("ordered", [False, True])
def test_write_after_unordered_read_on_another_stream(ordered: bool) -> None:
    with cuda_emulation() as emu:
        reader = VirtualStream("reduce")
        x = as_device(torch.ones(4))
        reader.wait_stream(emu.compute)
        with reader:
            x.sum()
        if ordered:
            emu.compute.wait_stream(reader)
            x.zero_()
        else:
            with pytest.raises(StreamOrderError, match="compute' writes.*'reduce' read"):
                x.zero_()


def test_error_names_op_tensor_and_both_streams() -> None:
    with cuda_emulation():
        gather = VirtualStream("gather")
        w = name_tensor(as_device(torch.zeros(2, 3, dtype=torch.float64)), "unit 1 param weight")
        with gather:
            w.add_(1.0)
        with pytest.raises(StreamOrderError) as info:
            torch.mm(w, w.t())
    message = str(info.value)
    assert isinstance(info.value, RuntimeError)
    for part in ("aten.mm.default", "'unit 1 param weight'", "shape [2, 3], float64"):
        assert part in message
    assert "stream 'compute'" in message and "aten.add_.Tensor on stream 'gather'" in message


# -- the caching allocator ----------------------------------------------------------------------
@pytest.mark.parametrize("cover", [None, "record_stream", "wait", "wait_after_free"])
def test_resize_to_zero_of_buffer_used_on_another_stream(cover: str | None) -> None:
    """The freed block goes back to compute's pool at once: compute's next allocation may get
    it while the side stream still reads it, unless compute waited for that read first (before
    the free, or at least before that allocation) or ``record_stream`` covers it."""
    with cuda_emulation() as emu:
        side = VirtualStream("reduce")
        x = name_tensor(as_device(torch.ones(8)), "packed grads")  # allocated on compute
        side.wait_stream(emu.compute)
        with side:
            x.sum()
        if cover == "record_stream":
            x.record_stream(side)
        elif cover == "wait":
            emu.compute.wait_stream(side)
        x.untyped_storage().resize_(0)  # the free itself is fine...
        if cover == "wait_after_free":
            emu.compute.wait_stream(side)
        if cover is None:
            with pytest.raises(StreamOrderError, match="'packed grads'.*allocated on stream "):
                x.untyped_storage().resize_(8 * 4)  # ...the next allocation on compute is not
        else:
            x.untyped_storage().resize_(8 * 4)  # re-allocated, on compute: no history
            x.fill_(0.0)


def test_resize_to_zero_after_use_on_the_allocating_stream_only() -> None:
    with cuda_emulation():
        x = as_device(torch.ones(8))
        x.mul_(2)
        x.untyped_storage().resize_(0)
        x.untyped_storage().resize_(8 * 4)


def test_deleting_the_last_tensor_is_a_free_checked_at_the_next_allocation() -> None:
    with cuda_emulation() as emu:
        gather = VirtualStream("gather")
        with gather:
            out = as_device(torch.empty(4))  # allocated on gather
            out.fill_(1.0)
        emu.compute.wait_stream(gather)
        (out * 2).sum()  # compute reads it
        del out  # gather never waited for that read
        torch.ones(1) + 1  # an allocation elsewhere cannot get the block
        with gather, pytest.raises(StreamOrderError, match="freed.*last tensor was deleted"):
            as_device(torch.empty(4))
    # a wait between the free and the next allocation orders the read before the reuse
    with cuda_emulation() as emu:
        gather = VirtualStream("gather")
        with gather:
            out = as_device(torch.zeros(4))
        emu.compute.wait_stream(gather)
        out.sum()
        del out
        gather.wait_stream(emu.compute)
        with gather:
            as_device(torch.empty(4)).fill_(2.0)


# -- pinned memory and the host -----------------------------------------------------------------
def _pinned(how: str) -> torch.Tensor:
    if how == "factory":
        return torch.empty(4, pin_memory=True)
    if how == "method":
        return torch.zeros(4).pin_memory()
    return emulated_pinned(torch.zeros(4))


@pytest.mark.parametrize("how", ["factory", "method", "helper"])
def test_non_blocking_copy_to_pinned_is_seen_by_the_host_after_event_synchronize(how: str) -> None:
    with cuda_emulation() as emu:
        reduce = VirtualStream("reduce")
        grad = as_device(torch.full((4,), 2.0))
        host = _pinned(how)
        assert host.is_pinned() and not grad.is_pinned()
        reduce.wait_stream(emu.compute)
        before = reduce.record_event()
        with reduce:
            host.copy_(grad, non_blocking=True)
            after = reduce.record_event()
        with pytest.raises(StreamOrderError, match="on the host reads.*stream 'reduce' wrote"):
            host.sum()
        with pytest.raises(StreamOrderError):
            host.tolist()
        before.synchronize()  # too early: before the copy
        with pytest.raises(StreamOrderError):
            host.sum()
        after.synchronize()
        assert host.tolist() == [2.0] * 4
        assert host.sum().item() == 8.0  # a host tensor: no synchronisation counted
    assert {kind for kind, _ in sync_counts()} == {"event.synchronize"}
    assert sum(sync_counts().values()) == 2


def test_blocking_copy_to_pageable_memory_syncs_the_host() -> None:
    reset_sync_counts()
    with cuda_emulation():
        x = as_device(torch.ones(3))
        host = torch.empty(3)
        line = _line() + 1
        host.copy_(x)
        host.add_(1)
        pinned = torch.empty(3, pin_memory=True)
        pinned.copy_(x)  # blocking, though pinned
        pinned.add_(1)
    assert sync_counts() == {("copy_to_host", _site(line)): 1, ("copy_to_host", _site(line + 3)): 1}


def test_host_must_not_overwrite_pinned_source_of_async_upload() -> None:
    with cuda_emulation() as emu:
        host = torch.ones(4, pin_memory=True)
        dev = host.to("cpu", non_blocking=True)  # an upload: the device *is* the CPU
        assert not dev.is_pinned() and dev.data_ptr() != host.data_ptr()
        with pytest.raises(StreamOrderError, match="host writes.*stream 'compute' read"):
            host.fill_(5.0)
        emu.compute.synchronize()
        host.fill_(5.0)
        assert dev.sum().item() == 4.0


def test_launch_orders_stream_work_after_what_the_host_did() -> None:
    with cuda_emulation():
        host = torch.zeros(4, pin_memory=True)
        host.fill_(3.0)  # the host writes...
        dev = host.to("cpu", non_blocking=True)  # ...then queues a copy that reads it: ordered
        side = VirtualStream("side")
        with side:
            other = as_device(torch.zeros(4))
            other.fill_(1.0)
        side.synchronize()  # the host waited for side, so what it queues next runs after side
        assert (dev + other).sum().item() == 16.0  # compute reads side's write


# -- host synchronisation counter --------------------------------------------------------------
def test_host_sync_counter_by_kind_and_call_site() -> None:
    reset_sync_counts()
    with cuda_emulation() as emu:
        x = as_device(torch.tensor([1.0, 0.0]))
        side = VirtualStream("side")
        line = _line() + 1
        x.sum().item()
        x.tolist()
        bool(x[0])
        emu.compute.record_event().synchronize()
        side.synchronize()
        host = x.cpu()
        synchronize()
        count_host_sync("work.wait(timeout)")
        for _ in range(2):
            x[1].item()
        torch.ones(2).sum().item()  # host tensors are not synchronisations
        host.tolist()
        host.sum().item()
        bool(host[0])
    expected = {
        ("item", _site(line)): 1,
        ("tolist", _site(line + 1)): 1,
        ("bool", _site(line + 2)): 1,
        ("event.synchronize", _site(line + 3)): 1,
        ("stream.synchronize", _site(line + 4)): 1,
        ("cpu", _site(line + 5)): 1,
        ("synchronize", _site(line + 6)): 1,
        ("work.wait(timeout)", _site(line + 7)): 1,
        ("item", _site(line + 9)): 2,
    }
    assert sync_counts() == expected
    x.sum().item()  # outside the emulation nothing is counted
    count_host_sync("item")
    assert sync_counts() == expected
    reset_sync_counts()
    assert sync_counts() == {}


def test_host_read_of_device_tensor_orders_the_host() -> None:
    with cuda_emulation():
        x = as_device(torch.ones(2))
        host = torch.empty(2, pin_memory=True)
        host.copy_(x, non_blocking=True)
        x.sum().item()  # the host waited for compute, hence for the copy
        assert host.tolist() == [1.0, 1.0]


# -- collectives --------------------------------------------------------------------------------
def test_collective_output_is_visible_after_wait_on_that_stream_only() -> None:
    with cuda_emulation() as emu:
        gather = VirtualStream("gather")
        shard = as_device(torch.arange(2.0))
        gather.wait_stream(emu.compute)
        with gather:
            out = torch.empty(4)  # a collective's tensors are device tensors
            work = emulated_collective([out], [shard], name="all_gather_into_tensor")
            with pytest.raises(StreamOrderError, match="'gather' reads.*all_gather_into_tensor"):
                out.sum()  # the issuing stream too must wait
            work.wait()
            out.sum()
        with pytest.raises(StreamOrderError, match="'compute' reads"):
            out.sum()  # gather waited, compute did not
        work.wait()
        out.sum()


def test_collective_waits_for_its_issuing_stream_only() -> None:
    with cuda_emulation() as emu:
        gather = VirtualStream("gather")
        shard = as_device(torch.zeros(2))
        shard.fill_(1.0)  # written on compute
        with gather, pytest.raises(StreamOrderError, match="gather \\(collective\\)"):
            emulated_collective([as_device(torch.empty(4))], [shard])
        gather.wait_stream(emu.compute)
        with gather:
            emulated_collective([as_device(torch.empty(4))], [shard]).wait()


@pytest.mark.parametrize("case", ["ordered", "no_compute_wait", "dropped_before_wait"])
def test_collective_input_from_compute_is_freed_only_after_compute_waits(case: str) -> None:
    """NOTE [Streams and buffer lifetimes] rule 3: gradients packed on compute, reduce-scattered
    on the reduce stream, are held until compute waited for the reduce stream. The handle holds
    them until ``wait()`` (NCCL's stash), where dropping the last reference frees them."""
    with cuda_emulation() as emu:
        reduce = VirtualStream("reduce")
        packed = name_tensor(as_device(torch.ones(8)), "packed grads")
        packed.mul_(0.5)  # made on compute
        reduce.wait_stream(emu.compute)  # rule 4
        with reduce:
            out = as_device(torch.empty(4))
            work = emulated_collective([out], [packed], name="reduce_scatter_tensor")
        if case == "dropped_before_wait":
            del packed  # not freed yet: the handle holds it...
            with reduce:
                work.wait()  # ...until here, and compute never waited for the collective
            with pytest.raises(StreamOrderError, match="'packed grads'.*reduce_scatter"):
                as_device(torch.empty(4))  # compute's next allocation may get its block
            return
        with reduce:
            work.wait()
        del work
        if case == "ordered":
            emu.compute.wait_stream(reduce)
        del packed
        if case == "no_compute_wait":
            with pytest.raises(StreamOrderError, match="allocated on stream 'compute', was freed"):
                as_device(torch.empty(4))  # compute's next allocation may get its block
        else:
            as_device(torch.empty(4))


def test_collective_wraps_a_real_gloo_work() -> None:
    pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=30))
    reset_sync_counts()
    with cuda_emulation():
        shard, out = as_device(torch.arange(3.0)), as_device(torch.empty(3))
        work = emulated_collective([out], [shard], work=pg._allgather_base(out, shard))
        line = _line() + 1
        work.wait(datetime.timedelta(seconds=30))  # a bounded host wait: counted
        assert out.tolist() == [0.0, 1.0, 2.0]
    assert sync_counts()[("work.wait(timeout)", _site(line))] == 1
    assert emulated_collective([out], [shard], work=pg._allgather_base(out, shard)).wait()


def test_untracked_ops_are_neither_checked_nor_recorded() -> None:
    with cuda_emulation() as emu:
        side = VirtualStream("side")
        x = as_device(torch.zeros(2))
        with side:
            x.fill_(1.0)
        with untracked():
            x.sum().item()  # no check, no count
        assert sync_counts() == {}
        with pytest.raises(StreamOrderError):
            x.sum()
        emu.compute.wait_stream(side)
        with untracked():
            x.fill_(2.0)  # not recorded: side's write stays the last one seen
        with side:
            x.sum()


# -- end to end: FSDP's all-gather --------------------------------------------------------------
@pytest.mark.parametrize("case", ["ordered", "no_event_wait", "early_release"])
def test_fsdp_gather_pattern(case: str) -> None:
    """NOTE [Streams and buffer lifetimes] rules 1 and 2: gather into a buffer on the gather
    stream, copy out on compute after an event, release the buffer after gather waits."""
    with cuda_emulation() as emu:
        compute, gather = emu.compute, VirtualStream("gather")
        shard = name_tensor(as_device(torch.arange(4.0)), "unit 0 shard")
        param = name_tensor(as_device(torch.empty(8)), "unit 0 gathered param")
        shard.mul_(1.0)  # the optimizer wrote it on compute
        gather.wait_stream(compute)  # rule 1
        with gather:
            out = name_tensor(torch.empty(8), "unit 0 all-gather output")
            torch.cat([shard, shard], out=out)  # the data the collective would move
            work = emulated_collective([out], [shard], name="all_gather_into_tensor")
            work.wait()
            ready = gather.record_event()
        if case == "no_event_wait":
            with pytest.raises(StreamOrderError, match="compute' reads.*all-gather output.*gather"):
                param.copy_(out)
            return
        compute.wait_event(ready)
        param.copy_(out)  # copy-out
        if case == "ordered":
            gather.wait_event(compute.record_event())  # rule 2
        del out, work
        if case == "early_release":
            with gather, pytest.raises(StreamOrderError, match="output.*allocated on stream 'g"):
                as_device(torch.empty(8))  # the next all-gather's output may get the block
            return
        assert (param * 2).sum().item() == 2 * 2 * 6.0


# -- modes, helpers and whole programs ----------------------------------------------------------
def test_all_device_mode_runs_training_steps_without_false_alarms() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reset_sync_counts()
    with cuda_emulation(all_device=True) as emu:
        side = VirtualStream("reduce")
        for _ in range(2):
            loss = model(torch.randn(3, 4)).pow(2).mean()
            loss.backward()
            side.wait_stream(emu.compute)
            with side:
                for p in model.parameters():
                    assert p.grad is not None
                    p.grad.div_(2)
            emu.compute.wait_stream(side)
            opt.step()
            opt.zero_grad()
        host = loss.detach().cpu()
        assert not host.is_pinned()
        host.item()  # a host copy: not a synchronisation
        pinned = torch.zeros(1).pin_memory()
        pinned.copy_(loss.detach(), non_blocking=True)
        with pytest.raises(StreamOrderError):
            pinned.item()
    assert [k for k, _ in sync_counts()] == ["cpu"]


def test_tensor_subclass_ops_are_checked_on_inner_tensors() -> None:
    from torch.testing._internal.two_tensor import TwoTensor

    with cuda_emulation():
        side = VirtualStream("side")
        a, b = as_device(torch.zeros(2)), as_device(torch.zeros(2))
        t = TwoTensor(a, b)
        with side:
            t.add_(1)
        with pytest.raises(StreamOrderError, match="stream 'side' wrote"):
            t * 2


def test_entry_points_and_outside_behaviour(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FULLSHARD_CUDA_EMULATION", "1")
    assert enabled_from_env()
    monkeypatch.setenv("FULLSHARD_CUDA_EMULATION", "0")
    assert not enabled_from_env()
    original_resize = torch.UntypedStorage.resize_
    t = torch.ones(2)
    assert as_device(t) is t and name_tensor(t, "x") is t and not is_active()
    with pytest.raises(RuntimeError, match="no cuda_emulation"):
        VirtualStream("s")
    with cuda_emulation() as emu:
        assert is_active()
        with pytest.raises(RuntimeError, match="already active"), cuda_emulation():
            pass
        s = VirtualStream("s")
        with stream(s):
            assert current_stream() is s
        with stream(None):
            assert current_stream() is emu.compute
        assert s.query() and VirtualEvent().query() and s != VirtualStream("s")
    assert not is_active() and torch.UntypedStorage.resize_ is original_resize
    with pytest.raises(RuntimeError, match="has ended"):
        s.wait_stream(s)
    with pytest.raises(RuntimeError):
        torch.empty(2, pin_memory=True)  # no pinning on a CPU-only build outside
