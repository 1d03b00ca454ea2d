"""Faults: desync, a dead or stalled rank, models that differ, bad input. Every surviving rank
raises a clear error that says which rank is where, and nothing hangs.

No test measures how long a failure took: the harness deadline (``run_ranks(timeout_s=...)``)
turns a hang into a failure naming the ranks, and *how* a failure was caught (the payload tags
before any result was used, a bounded wait that gave up while the other rank was still away) is
read from the error itself."""

from __future__ import annotations

import functools
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from harness import RanksFailed, case_results, run_cases, run_ranks
from torch import nn
from toy import Block, ToyLM, batches, loss_of, shard_toy

import fullshard
from fullshard import FullshardError, fully_shard


def _in_env(rank: int, world: int, env: dict[str, str], fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(rank, world, *args)`` with ``env`` set in the rank. The test process's own
    ``os.environ`` does not reliably reach the ranks: they fork from a server started at the
    test process's first launch, which keeps the environment of that moment."""
    os.environ.update(env)
    return fn(rank, world, *args)


def _catch(fn) -> dict:  # type: ignore[no-untyped-def]
    try:
        fn()
        return {"error": "", "type": ""}
    except FullshardError as e:
        return {"error": str(e), "type": type(e).__name__}


class _SkippingLM(ToyLM):
    """Rank 1 skips block 1 in forward: 'another branch'."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for i, block in enumerate(self.blocks):
            if not (i == 1 and torch.distributed.get_rank() == 1):
                x = block(x)
        return self.head(self.norm(x))


def _desync(rank: int, world: int, how: str) -> dict:
    torch.manual_seed(0)
    model = shard_toy(_SkippingLM() if how == "branch" else ToyLM())
    data = batches(4, world)

    def run() -> None:
        for step in range(4):
            if how == "skip_forward" and rank == 1 and step == 1:
                continue  # rank 1 skips a whole forward/backward
            micro = 3 if (how == "micro_batches" and rank == 1) else 2
            for k in range(micro if how == "micro_batches" else 1):
                model.set_requires_gradient_sync(k == micro - 1 or how != "micro_batches")
                loss_of(model, data[step][rank]).backward()

    return _catch(run)


def test_another_branch_is_caught_before_its_first_gather() -> None:
    # blocks 1 and 2 have the same size: unchecked, rank 0 would compute with rank 1's block-2
    # shards. The first forward's gathers are fingerprinted (NOTE [Units every rank runs]):
    # both ranks raise before the mispaired gather, naming both positions and what to do.
    for res in run_ranks(_desync, 2, "branch", timeout_s=90):
        assert res["type"] == "DesyncError", res
        msg = res["error"]
        assert "(the units check)" in msg, msg
        assert "rank 0: all_gather of unit 'blocks.1'" in msg, msg
        assert "rank 1: all_gather of unit 'blocks.2'" in msg, msg
        assert "set_optional()" in msg, msg


# The waits below are as short as keeps each failure mode apart: a process group timeout of 3 s
# (every collective of a launch, its start-up barrier included, must finish within it) and a
# report wait of 1 s where the other rank is known never to report (gone, or asleep for longer).


def test_different_micro_batch_counts_fail_within_the_timeout_naming_positions() -> None:
    # both ranks wait in a collective the other never issues: the process group's timeout
    # ends both waits; each rank then reports at once (a report wait of 2 s covers the skew)
    env = {"FULLSHARD_REPORT_WAIT_S": "2"}
    res = run_ranks(_in_env, 2, env, _desync, "micro_batches", timeout_s=90, pg_timeout_s=3)
    for r in res:
        assert r["type"] == "DesyncError", r
        assert "rank 0: reduce-scatter of unit" in r["error"], r
        assert "rank 1: backward gather of unit" in r["error"], r


def test_a_skipped_forward_makes_the_busier_rank_fail_naming_the_other() -> None:
    # rank 1 skips one step: its collectives pair with rank 0's (same units, same order) until
    # it has run out of steps and left; rank 0's next collective then fails, naming rank 1
    env = {"FULLSHARD_REPORT_WAIT_S": "1"}
    res = run_ranks(_in_env, 2, env, _desync, "skip_forward", timeout_s=90, pg_timeout_s=3)
    assert res[0]["type"] == "DesyncError", res[0]
    assert "rank 1: did not report" in res[0]["error"] and "step 3" in res[0]["error"]
    assert res[1]["error"] == ""  # it finished its (shorter) loop


def _debug_mode(rank: int, world: int) -> dict:
    os.environ["FULLSHARD_DEBUG_COLLECTIVES"] = "1"
    torch.manual_seed(0)

    class Uneven(nn.Module):  # blocks of different sizes: skipping one mismatches the sizes
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 8)
            self.c = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if rank == 0:
                x = self.a(x)
            return self.c(self.b(x))

    model = Uneven()
    for m in (model.a, model.b, model.c):
        fully_shard(m)
    fully_shard(model)
    return _catch(lambda: model(torch.randn(3, 4)).sum().backward())


def test_debug_mode_catches_a_size_mismatch_at_once() -> None:
    for res in run_ranks(_debug_mode, 2, timeout_s=60):
        assert res["type"] == "DesyncError" and "debug mode" in res["error"], res
        assert "unit 'a'" in res["error"] and "unit 'b'" in res["error"], res


def _dead_rank(rank: int, world: int) -> dict:
    os.environ["FULLSHARD_REPORT_WAIT_S"] = "1"  # rank 1 is gone: it never reports
    torch.manual_seed(0)
    model = shard_toy(ToyLM())
    data = batches(3, world)
    loss_of(model, data[0][rank]).backward()
    if rank == 1:
        os._exit(1)  # killed mid-run
    return _catch(lambda: loss_of(model, data[1][rank]).backward())


def _survivor(rank: int, world: int, path: str) -> None:
    res = _dead_rank(rank, world)
    with open(path, "w") as f:
        f.write(res["error"])


@functools.cache
def _dead_rank_run() -> tuple[str, str]:
    """One launch whose rank 1 dies: what run_ranks raised, and the survivor's own error (a
    file: run_ranks fails because rank 1 died, so rank 0's return value never comes back)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rank0.txt")
        with pytest.raises(RanksFailed) as info:
            run_ranks(_survivor, 2, path, timeout_s=90, pg_timeout_s=20)
        with open(path) as f:
            return str(info.value), f.read()


def test_a_dead_rank_is_named_by_the_survivors() -> None:
    text = _dead_rank_run()[0]
    assert "rank 1 raised" in text and "exited with code 1" in text  # the one we killed
    assert "rank 0 raised" not in text  # the survivor caught its error instead of raising


def test_survivor_error_names_the_lost_rank() -> None:
    msg = _dead_rank_run()[1]
    assert "rank 1: did not report" in msg, msg
    assert "rank 0:" in msg and "unit '" in msg, msg


def _stall(rank: int, world: int) -> dict:
    # fullshard's waits and gloo's end together after 3 s; then 1 s to hear from rank 1, which
    # sleeps 8 s: still asleep when rank 0 gives up, with 4 s to spare
    os.environ["FULLSHARD_TIMEOUT_S"] = "3"
    os.environ["FULLSHARD_REPORT_WAIT_S"] = "1"
    torch.manual_seed(0)
    model = shard_toy(ToyLM())
    data = batches(2, world)
    loss_of(model, data[0][rank]).backward()
    if rank == 1:
        time.sleep(8)  # stuck outside any collective for longer than the timeout
    return _catch(lambda: loss_of(model, data[1][rank]).backward())


def test_a_stalled_rank_times_out_instead_of_hanging() -> None:
    res = run_ranks(_stall, 2, timeout_s=90, pg_timeout_s=3)
    assert res[0]["type"] == "DesyncError", res[0]
    # rank 0 gave up while rank 1 was still asleep (it had not reported), not when it came back
    assert "rank 1: did not report" in res[0]["error"], res[0]
    assert res[1]["type"] == "DesyncError"  # the late rank then fails too, it does not hang


def _differs(rank: int, world: int, what: str) -> dict:
    torch.manual_seed(0)
    if what == "shape":
        block = Block(hidden=13 if rank == 0 else 14)
    elif what == "dtype":
        block = Block().to(torch.float64 if rank == 1 else torch.float32)
    else:
        block = Block()
        if rank == 1:
            block.extra = nn.Parameter(torch.zeros(3))
    return _catch(lambda: fully_shard(block))


DIFFERS = {
    "shape": "shape (14, 12) vs (13, 12)",
    "dtype": "dtype torch.float64 vs torch.float32",
    "count": "extra parameter 'extra'",
}


@pytest.mark.parametrize("what,says", DIFFERS.items())
def test_a_model_that_differs_across_ranks_is_refused_before_any_gather(
    what: str, says: str
) -> None:
    for res in _of(2, f"differs: {what}"):
        assert says in res["error"] and "rank 1" in res["error"], res


def _bad_inputs(rank: int, world: int) -> dict:
    import warnings

    out = {}
    torch.manual_seed(0)
    # optimizer built before wrapping: warned at its first step
    model = ToyLM()
    early = torch.optim.SGD(model.parameters(), lr=0.1)
    shard_toy(model)
    loss_of(model, batches(1, world)[0][rank]).backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        early.step()
    out["early_optimizer"] = " ".join(str(w.message) for w in caught)
    # an empty unit (no parameters) works and issues nothing
    holder = nn.Sequential(nn.ReLU(), nn.Linear(3, 2))
    fully_shard(holder[0])
    fully_shard(holder)
    holder(torch.randn(2, 3)).sum().backward()
    out["empty_unit_ok"] = holder[1].weight.grad is not None
    # a non-contiguous parameter is sharded from its values
    lin = nn.Linear(4, 6)
    lin.weight = nn.Parameter(torch.randn(4, 6).t())  # non-contiguous view
    ref = lin.weight.detach().clone()
    fully_shard(lin)
    lin.unshard()
    out["noncontig_ok"] = torch.equal(lin.weight, ref)
    lin.reshard()
    # optimizer step before any backward: nothing changes, no error
    m2 = shard_toy(ToyLM())
    opt = torch.optim.AdamW(m2.parameters())
    before = [p.detach().clone() for p in m2.parameters()]
    opt.step()
    out["step_before_backward_ok"] = all(
        torch.equal(a, p) for a, p in zip(before, m2.parameters(), strict=True)
    )
    # zero_grad in both modes keeps the next gradient exact
    grads = {}
    for set_to_none in (True, False):
        torch.manual_seed(0)
        m3 = shard_toy(ToyLM())
        o3 = torch.optim.SGD(m3.parameters(), lr=0.1)
        for step in range(2):
            loss_of(m3, batches(2, world)[step][rank]).backward()
            if step == 0:
                o3.zero_grad(set_to_none=set_to_none)
        grads[set_to_none] = [p.grad.clone() for p in m3.parameters() if p.grad is not None]
    out["zero_grad_modes_agree"] = all(
        torch.equal(a, b) for a, b in zip(grads[True], grads[False], strict=True)
    )
    return out


def test_bad_input_catalog() -> None:
    for res in _of(2, "bad inputs"):
        assert "built before wrapping" in res["early_optimizer"], res
        assert res["empty_unit_ok"] and res["noncontig_ok"]
        assert res["step_before_backward_ok"] and res["zero_grad_modes_agree"]


def _broadcast(rank: int, world: int) -> dict:
    from fullshard import broadcast_from_rank0

    torch.manual_seed(rank)  # every rank initialises differently
    model = ToyLM()
    broadcast_from_rank0(model)  # before wrapping: in place
    shard_toy(model)
    a = {k: v.full_tensor() for k, v in model.state_dict().items()}
    torch.manual_seed(0)
    want = ToyLM().state_dict()
    # meta-device init on every rank but 0, then broadcast of rank 0's full weights
    if rank == 0:
        torch.manual_seed(0)
        source = ToyLM()
        full = source.state_dict()
        meta_model = shard_toy(source)
    else:
        full = None
        with torch.device("meta"):
            meta_model = shard_toy(ToyLM())
        meta_model.to_empty(device="cpu")
    broadcast_from_rank0(meta_model, full)
    b = {k: v.full_tensor() for k, v in meta_model.state_dict().items()}
    loss_of(meta_model, batches(1, world)[0][rank]).backward()  # and it trains
    return {
        "checksum": sum(float(v.double().sum()) for v in a.values()),
        "unwrapped_equal": all(torch.equal(a[k], want[k]) for k in want),  # rank 0's seed-0 init
        "meta_equal": all(torch.equal(b[k], want[k]) for k in want),
    }


def test_broadcast_from_rank0_before_wrapping_and_after_meta_init() -> None:
    res = _of(3, "broadcast")
    assert len({r["checksum"] for r in res}) == 1  # all ranks hold rank 0's weights
    assert all(r["unwrapped_equal"] and r["meta_equal"] for r in res)


def _tagged_reduce(rank: int, world: int, how: str, dtype: torch.dtype, sums: bool) -> dict:
    """One reduce-scatter block per rank carrying the engine's extra columns (presence bits,
    tag bits), checked as the engine checks it: every rank's rows before the sum (gloo), or
    the summed columns (NCCL's path, here through gloo's own reduce-scatter)."""
    from datetime import timedelta

    from fullshard.comm.collectives import reduce_scatter
    from fullshard.comm.desync import Position, Verdict, reduce_tag_row

    index = 2 if how == "units" and rank == world - 1 else 1  # blocks.1 / blocks.2
    present = [True, rank != 0] if how == "presence" else [True, True]
    pos = Position(7, 0, "reduce_scatter", f"blocks.{index}", "reduce-scatter", index)
    extra = reduce_tag_row(pos, present, dtype, torch.device("cpu")).expand(world, -1)
    k = extra.shape[1]
    full = torch.cat([torch.randn(world, 6).to(dtype), extra], 1)
    verdict = Verdict()
    verdict.names = {1: "blocks.1", 2: "blocks.2"}
    group = torch.distributed.group.WORLD
    names = ["fc.weight", "fc.bias"]

    def run() -> None:
        out = torch.empty(6 + k, dtype=dtype)
        if sums:
            torch.distributed.reduce_scatter_tensor(out, full.view(-1), group=group)
            verdict.reduce_sums(out[-k:], world, pos, group, names)
        else:
            pending = reduce_scatter(out, full, group, what="test", timeout=timedelta(seconds=30))
            pending.wait()
            assert pending.rows is not None
            verdict.reduce_rows(pending.rows[:, -k:], rank, pos, group, names)

    return _catch(run)


def test_mispaired_reduce_scatters_are_caught_by_their_tags() -> None:
    # two ranks reduce-scatter different units of the same size (e.g. a backward that finished
    # units in another order): the tags in every block expose it before the sum is used
    for res in _of(2, "tagged: units, rows"):
        assert res["type"] == "DesyncError", res
        assert "different reduce-scatters" in res["error"], res
        assert "unit 'blocks.1'" in res["error"] and "unit 'blocks.2'" in res["error"], res


def test_reduce_scatter_tags_are_exact_in_bf16_sums() -> None:
    # NCCL sums the tags: in bf16 the old encoding rounded 3 x 173 = 519 to 520 and raised a
    # false desync at 3 ranks. Bits sum to at most the group size, exact in bf16 up to 256.
    same, units = _of(3, "tagged: same, bf16 sums"), _of(3, "tagged: units, bf16 sums")
    assert all(r["error"] == "" for r in same), same
    for r in units:
        assert r["type"] == "DesyncError" and "different reduce-scatters" in r["error"], r


def test_a_gradient_on_some_ranks_only_passes_the_tag_check() -> None:
    # NOTE [Which gradients exist]: rank 0 has no gradient for 'fc.bias', rank 1 has one; the
    # presence columns then differ (or sum to 1 of 2), which is allowed: only tags must agree
    for res in _of(2, "tagged: presence, rows") + _of(2, "tagged: presence, sums"):
        assert res == {"error": "", "type": ""}, res


class _TwinLM(nn.Module):
    """Two identical blocks; ``swap`` makes rank 1 run them in the other order."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(37, 12)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(12, 37)
        self.swap = False

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        order = [1, 0] if self.swap and torch.distributed.get_rank() == 1 else [0, 1]
        for i in order:
            x = self.blocks[i](x)
        return self.head(x)


def _deferred(rank: int, world: int) -> dict:

    torch.manual_seed(0)
    model = _TwinLM()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    data = batches(3, world)
    loss_of(model, data[0][rank]).backward()
    # what a GPU does (NOTE [Reading the verdict]): keep the checks, read them at the next step
    fullshard.step_schedule(model).verdict.defer_cpu = True
    model.swap = True
    during = _catch(lambda: loss_of(model, data[1][rank]).backward())
    model.swap = False
    after = _catch(lambda: loss_of(model, data[2][rank]).backward())
    return {"during": during["error"], **after}


def test_deferred_checks_report_a_desync_at_the_next_step_on_every_rank() -> None:
    for res in run_ranks(_deferred, 2, timeout_s=60):
        assert res["during"] == "", res  # the swapped step ran: its checks were not read yet
        assert res["type"] == "DesyncError", res
        assert "unit 'blocks.0'" in res["error"] and "unit 'blocks.1'" in res["error"], res
        assert "restart from the last checkpoint" in res["error"], res


def _unit_codes(rank: int, world: int) -> dict:
    from fullshard.app.config import ParallelismConfig
    from fullshard.app.models.gpt import build_model, unit_types_of
    from fullshard.app.models.wrap import shard_model

    model = build_model("gpt2-124m", 256, seed=0, device="meta")
    shard_model(model, ParallelismConfig(), unit_types_of(model))
    model.to_empty(device="cpu")  # uninitialised memory is enough to number the units
    # the root numbers its units on its first forward: one token is enough
    model(torch.zeros(1, 1, dtype=torch.long))
    names = fullshard.step_schedule(model).stats.names
    return {"codes": sorted(names), "names": sorted(names.values())}


def test_unit_codes_are_the_registration_order_and_never_collide() -> None:
    # crc32 % 251 made blocks.3 and blocks.8 of gpt2-124m collide; indices cannot
    res = run_ranks(_unit_codes, 1, timeout_s=60)[0]
    assert res["codes"] == list(range(13)), res
    assert (
        len(set(res["names"])) == 13 and "blocks.3" in res["names"] and "blocks.8" in res["names"]
    )


class _RankOnlyBlock(Block):
    """A block whose ``extra`` layer only rank 0's forward uses (a data-dependent branch)."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(12, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = super().forward(x)
        return x + self.extra(x) if torch.distributed.get_rank() == 0 else x


def _partial_gradients(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = _TwinLM()
    model.blocks[0] = _RankOnlyBlock()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    loss_of(model, batches(1, world)[0][rank]).backward()
    grad = model.blocks[0].extra.weight.grad
    return {"grad": None if grad is None else grad.full_tensor()}


def test_a_parameter_used_on_some_ranks_only_gets_their_gradient_on_every_rank() -> None:
    # NOTE [Which gradients exist]: rank 0 has gradients for blocks.0's 'extra', rank 1 none;
    # every rank gets rank 0's gradient / 2 (rank 1 adds zero). Parity: test_conditional.py
    res = run_ranks(_partial_gradients, 2, timeout_s=60)
    assert all(r["grad"] is not None for r in res), res
    assert torch.equal(res[0]["grad"], res[1]["grad"]) and res[0]["grad"].abs().sum() > 0


# Cases that share a launch (``_launch``: a launch costs seconds, mostly each new rank's first
# steps; these cases a fraction of one). Each finishes, on every rank, every collective it
# starts: a refusal comes after a blocking exchange, and no asynchronous collective is left in
# flight, so the next case starts in step. The desyncs, dead and stalled ranks above abort
# mid-step and get a launch each: a collective they leave in flight would pair with the next
# case's. A case that asks the store where the other ranks are must come last (its keys stay).
SHARED: dict[int, dict[str, tuple[Callable[..., Any], tuple]]] = {
    2: {
        "bad inputs": (_bad_inputs, ()),
        **{f"differs: {what}": (_differs, (what,)) for what in DIFFERS},
        # mispaired units, then a gradient on one rank only, read from every rank's rows
        # (gloo) and from the summed columns (NCCL's path)
        "tagged: units, rows": (_tagged_reduce, ("units", torch.float32, False)),
        "tagged: presence, rows": (_tagged_reduce, ("presence", torch.float32, False)),
        "tagged: presence, sums": (_tagged_reduce, ("presence", torch.float32, True)),
    },
    3: {
        "broadcast": (_broadcast, ()),
        "tagged: same, bf16 sums": (_tagged_reduce, ("same", torch.bfloat16, True)),
        "tagged: units, bf16 sums": (_tagged_reduce, ("units", torch.bfloat16, True)),
    },
}


def _in_turn(rank: int, world: int) -> dict[str, dict]:
    """This world size's shared cases in turn: each one's result, or the traceback it raised."""
    # a mismatched bf16 sum asks the store where every rank is: all of them report at once
    os.environ["FULLSHARD_REPORT_WAIT_S"] = "2"
    return run_cases(rank, world, SHARED[world])


@functools.cache
def _launch(world: int) -> list[dict[str, dict]]:
    return run_ranks(_in_turn, world, timeout_s=120)


def _of(world: int, name: str) -> list[Any]:
    """One shared case's result on every rank (its traceback, if it raised)."""
    return case_results(_launch(world), name)
