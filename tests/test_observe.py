"""Observability: the timeline records every step of FSDP, memory is tracked by category, and
both stay consistent with what the engine really did."""

from __future__ import annotations

import gc
import json
import math
from pathlib import Path

import pytest
import torch
from commcount import RS, C10dCounter
from harness import run_ranks
from torch.distributed.tensor import DTensor
from toy import ToyLM, batches, loss_of, shard_toy

from fullshard import step_schedule
from fullshard.comm.desync import TAG_LEN
from fullshard.observe.memory import MemoryTracker, profiler_live_peak
from fullshard.observe.plot import draw_timeline
from fullshard.observe.timeline import Recorder, chrome_trace, exposed_seconds


def _record(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = shard_toy(ToyLM(n_blocks=3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = batches(3, world)

    def step(i: int) -> None:
        loss_of(model, data[i][rank]).backward()
        opt.step()
        opt.zero_grad()

    step(0)  # the root is set up on the first forward
    rec = Recorder().attach(model, opt)
    mem = MemoryTracker().attach(model, opt)
    with C10dCounter() as c10d:
        step(1)
    rec.detach()
    mem.detach()
    step(2)  # detached: nothing more is recorded
    units = [u.name for u in step_schedule(model).units]
    events = rec.events
    by = lambda cat, name: [e for e in events if e.cat == cat and e.name == name]  # noqa: E731
    # this rank's shard bytes from the model alone: each parameter's dim 0 split into ceil
    # rows per rank (padding included), and a position tag at the end of each unit's shard
    rows = [(-(-p.shape[0] // world) * math.prod(p.shape[1:]), p) for p in model.parameters()]
    shards = 4 * (sum(n for n, _ in rows) + TAG_LEN * (len(model.blocks) + 1))
    grad_shards = 4 * sum(n for n, p in rows if p.requires_grad)
    local = [
        t.to_local() if isinstance(t, DTensor) else t
        for s in opt.state.values()
        for t in s.values()
    ]
    adam = sum(t.numel() * t.element_size() for t in local if t.dim() > 0)  # this rank's bytes
    return {
        "units": units,
        "forward_units": sorted(e.unit for e in by("compute", "forward")),
        "backward_units": sorted(e.unit for e in by("compute", "backward")),
        "gathers": len(by("gather", "all_gather")),
        "reduces": len(by("reduce", "reduce_scatter")),
        "c10d": dict(c10d.calls),
        "frees": len(by("free", "free")),
        "optimizer_steps": len([e for e in events if e.unit == "optimizer"]),
        "spans_ok": all(e.end >= e.start for e in events),
        "exposed": exposed_seconds(events),
        "exposed_units": sorted({e.unit for e in events if e.cat == "exposed"}),
        "span": max(e.end for e in events) - min(e.start for e in events),
        "n_events": len(events),
        "trace": chrome_trace(events, {rank: rec.origin}),
        "peaks": mem.peaks,
        "shards": shards,
        "grad_shards": grad_shards,
        "adam": adam,
    }


@pytest.fixture(scope="module")
def recorded() -> list[dict]:
    """``_record`` on 2 ranks, once: the timeline, memory and drawing tests read its results."""
    return run_ranks(_record, 2)


def test_timeline_has_every_gather_compute_free_and_reduce(recorded: list[dict]) -> None:
    for r in recorded:
        units = sorted(r["units"])
        assert r["forward_units"] == units and r["backward_units"] == units
        # every collective the c10d layer saw is on the timeline
        assert r["gathers"] == r["c10d"]["all_gather"] and r["reduces"] == r["c10d"][RS]
        assert r["frees"] == 2 * (len(units) - 1) + 1  # blocks twice, the root after backward
        assert r["optimizer_steps"] == 1 and r["spans_ok"]
        # gloo waits on the host for every collective: each is an exposed span of its unit,
        # and their union (they may nest) lies within the step
        assert r["exposed_units"] and set(r["exposed_units"]) <= set(units), r["exposed_units"]
        assert r["exposed"] <= r["span"], (r["exposed"], r["span"])
        trace = json.loads(json.dumps(r["trace"]))  # serialisable as Chrome trace JSON
        complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        assert complete and all(e["dur"] >= 0 for e in complete)


def test_memory_categories_match_what_the_engine_holds(recorded: list[dict]) -> None:
    for r in recorded:
        peaks = r["peaks"]
        for phase in ("forward", "backward", "optimizer"):
            assert peaks[phase]["sharded_params"] == r["shards"]
        assert peaks["optimizer"]["optimizer_state"] >= r["adam"] > 0
        assert peaks["forward"]["activations"] > 0
        assert peaks["backward"]["gradients"] > 0
        assert peaks["forward"]["gathered_window"] > 0
        # at the optimizer step every trainable parameter has its sharded gradient
        assert peaks["optimizer"]["gradients"] >= r["grad_shards"] > 0


def _linear_stack(rank: int, world: int, batch: int) -> dict[bool, dict]:
    """The reported case: three Linear(256) blocks, each a unit, under a root; the tracker's
    peaks with the blocks resharded after forward (ZeRO-3) and kept (ZeRO-2)."""
    from torch import nn

    from fullshard import fully_shard

    out = {}
    for reshard in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(3)])
        for block in model:
            fully_shard(block, reshard_after_forward=reshard)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters())
        x = torch.randn(batch, 256)
        for i in range(2):
            if i == 1:  # the root is set up on the first forward
                mem = MemoryTracker().attach(model, opt)
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        mem.detach()
        out[reshard] = mem.peaks
    return out


def test_gathered_weights_saved_for_backward_are_not_activations() -> None:
    # Forward saves each Linear's input (x, then the first two outputs) and its weight, a view
    # of the unit's gathered storage; the loss's square saves the model's output (NOTE [The
    # loss's activations]), which its backward frees before the model's backward starts.
    # Gathering resizes the storage to a new address each time: the weights must still count
    # once, in the gathered window, never as activations.
    batch, world = 4, 2
    saved_inputs = 3 * batch * 256 * 4
    loss_input = batch * 256 * 4
    # a gathered block: every rank's shard (128 rows of weight and bias, and the tag), float32
    block = 4 * world * (128 * 257 + TAG_LEN)
    for r in run_ranks(_linear_stack, world, batch):
        for reshard, peaks in r.items():
            assert peaks["forward"]["activations"] == saved_inputs + loss_input, reshard
            assert peaks["backward"]["activations"] == saved_inputs, reshard
            assert peaks["optimizer"]["activations"] == 0
            # kept for backward (ZeRO-2): every block at once; else one at a time
            held = 1 if reshard else 3
            assert peaks["forward"]["gathered_window"] == held * block, reshard


STRATEGY_WORLDS = [
    ("full_shard", 2),
    ("shard_grad_op", 2),
    ("no_shard", 2),
    ("hybrid_shard", 4),
    ("hybrid_shard_zero2", 4),
]


def _tracker_and_profiler(rank: int, world: int, strategy: str) -> dict:
    """The tiny model, float32, under the profiler from before it is built (the live sum is
    then absolute); the tracker and the profiler's live peak over the same two steps."""
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile, record_function

    from fullshard.app.config import ParallelismConfig
    from fullshard.app.models.gpt import build_model, unit_types_of
    from fullshard.app.models.wrap import shard_model

    gen = torch.Generator().manual_seed(rank)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = build_model("tiny", 256, seed=0, device="cpu")
        shard_model(model, ParallelismConfig(strategy=strategy), unit_types_of(model))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = [torch.randint(256, (2, 33), generator=gen) for _ in range(3)]

        def step(x: torch.Tensor) -> None:
            logits = model(x[:, :-1])
            F.cross_entropy(logits.reshape(-1, 256), x[:, 1:].reshape(-1)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step(data[0])  # the root is set up on the first forward
        mem = MemoryTracker().attach(model, opt)
        with record_function("tracked steps"):
            step(data[1])
            step(data[2])
        mem.detach()
    return {"tracker": mem.peak_total, "profiler": profiler_live_peak(prof, "tracked steps")}


def _tracker_and_profiler_each(rank: int, world: int, strategies: list[str]) -> dict[str, dict]:
    """``_tracker_and_profiler`` of each strategy in turn, on the same ranks. Each profile starts
    after the previous strategy's model is gone: a storage from before the profile that it
    frees would lower its live sum, so sharing ranks can only make the check below stricter."""
    out = {}
    for strategy in strategies:
        gc.collect()
        out[strategy] = _tracker_and_profiler(rank, world, strategy)
    return out


@pytest.fixture(scope="module")
def tracker_vs_profiler() -> dict[str, list[dict]]:
    """Every rank's ``_tracker_and_profiler`` per strategy: one launch per world size."""
    out: dict[str, list[dict]] = {}
    for world in sorted({w for _, w in STRATEGY_WORLDS}):
        strategies = [s for s, w in STRATEGY_WORLDS if w == world]
        per_rank = run_ranks(_tracker_and_profiler_each, world, strategies)
        out.update({s: [r[s] for r in per_rank] for s in strategies})
    return out


@pytest.mark.parametrize(("strategy", "world"), STRATEGY_WORLDS)
def test_tracker_peak_never_exceeds_the_profilers_live_peak(
    tracker_vs_profiler: dict[str, list[dict]], strategy: str, world: int
) -> None:
    # The profiler counts every live storage (temporaries too); the tracker counts a subset,
    # each storage once, so its peak over the same steps can only be smaller.
    results = tracker_vs_profiler[strategy]
    assert len(results) == world
    for rank, r in enumerate(results):
        assert r["profiler"] is not None and r["tracker"] > 0
        assert r["tracker"] <= r["profiler"], (strategy, rank, r)


def test_timeline_png_is_drawn(recorded: list[dict], tmp_path: Path) -> None:
    from fullshard.observe.timeline import Event

    events = []
    for rank, r in enumerate(recorded):
        for e in r["trace"]["traceEvents"]:
            if e["ph"] == "X":
                lane = ("compute", "gather", "reduce", "exposed", "free")[e["tid"]]
                events.append(
                    Event(
                        e["name"].split(" ")[0],
                        lane,
                        "",
                        e["ts"] / 1e6,
                        (e["ts"] + e["dur"]) / 1e6,
                        0,
                        rank,
                    )
                )
    path = tmp_path / "t.png"
    draw_timeline(events, {0: 0.0, 1: 0.0}, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_trace_cli_writes_chrome_trace_png_and_exposed_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ``fullshard trace`` through main(), launching its ranks from this process (the console
    # entry is the train tests'): what is checked is the files rank 0 writes. --nproc given: it
    # once reached torchrun's own parser ("ambiguous option: --nproc could match
    # --nproc-per-node"); the ranks get full-name flags without it.
    from test_app_cli import main_in_process

    out = tmp_path / "trace"
    argv = [
        *["trace", "--model", "tiny", "--steps", "1", "--warmup", "1"],
        *["--seq-len", "32", "--batch-size", "2", "--nproc", "3", "--out"],
        str(out),
    ]
    assert main_in_process(argv, monkeypatch, deadline_s=300) == 0
    summary = json.loads((out / "trace_summary.json").read_text())
    assert summary["world_size"] == 3 and summary["steps"] == 1 and len(summary["per_rank"]) == 3
    assert 0 <= summary["exposed_fraction"] < 1 and summary["step_ms"] > 0
    units = summary["comm_per_step_in_model_units"]
    # blocks twice, the root (kept from forward to backward) once: under 2 by the root share
    assert 1.5 < units["all_gather"] <= 2.05
    assert units["reduce_scatter"] == pytest.approx(1.0, abs=0.05)
    trace = json.loads((out / "trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"] if "pid" in e} == {0, 1, 2}  # every rank
    assert (out / "trace.png").read_bytes()[:4] == b"\x89PNG"
