"""``fullshard bench`` end to end on the tiny model: files, figures, and the communication and
memory each variant must show. No wall-clock assertion: times are only checked to be positive."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fullshard.app.commands.bench import (
    add_arguments,
    default_variants,
    main_bench,
    parse_variants,
)

# launches the CLI or torchrun as subprocesses: the top of the test pyramid
pytestmark = pytest.mark.e2e

MIB = 2**20


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


# The demo model (1.3M parameters, 6 blocks) at batch 1 x 16 tokens: activations stay small,
# so the model state (what sharding saves) dominates each rank's memory and full_shard vs DDP
# differs by several model sizes, far above noise; steps stay fast.
DEMO = ["--model=demo", "--batch-size=1", "--seq-len=16", "--timeout=300"]


def _bench(out: Path, *argv: str) -> tuple[int, Path, dict[str, Any]]:
    rc = main_bench(_args(*DEMO, *argv, f"--out={out}"))
    summary = json.loads((out / "bench.json").read_text()) if rc == 0 else {}
    return rc, out, summary


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path, dict[str, Any]]:
    """Timing and communication of fullshard, FSDP2 and DDP side by side (the timing launch)."""
    out = tmp_path_factory.mktemp("bench")
    return _bench(out, "--variants=full_shard,fsdp2,ddp", "--warmup=1", "--rounds=2", "--no-memory")


@pytest.fixture(scope="module")
def bench_memory(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path, dict[str, Any]]:
    """The memory launches of full_shard and DDP (one per variant, each rank a fresh interpreter:
    glibc reads MALLOC_MMAP_THRESHOLD_ only at start-up), after a minimal timing launch.

    FSDP2's memory launch runs DDP's code (only fullshard variants add the tracker), so is not
    repeated here: its timing, communication and training are ``bench``'s."""
    out = tmp_path_factory.mktemp("bench_memory")
    return _bench(out, "--variants=full_shard,ddp", "--warmup=1", "--rounds=1", "--memory-steps=2")


def test_writes_json_table_and_plot(bench: tuple[int, Path, dict[str, Any]]) -> None:
    rc, out, summary = bench
    assert rc == 0
    assert (out / "bench.png").stat().st_size > 10_000
    table = (out / "bench.md").read_text()
    for name in ("full_shard", "fsdp2", "ddp"):
        assert f"| {name} |" in table
    assert list(summary["variants"]) == ["full_shard", "fsdp2", "ddp"]
    assert "issue ms (% step)" in table
    assert summary["config"]["dtype"] == "float32" and summary["config"]["device"] == "cpu"
    for fig in summary["variants"].values():
        assert fig["step_ms_median"] > 0
        assert len(fig["step_ms_rounds"]) == 2
        # issue time is part of the step; how large a part is timing (gloo's all-reduce for DDP
        # runs on its own thread, so the host may finish issuing before it ends): any share
        assert 0 < fig["issue_ms_median"] <= fig["step_ms_median"]
        ratio = statistics.median(fig["issue_ms_rounds"]) / statistics.median(fig["step_ms_rounds"])
        assert fig["issue_fraction"] == pytest.approx(ratio) and 0 < ratio <= 1
        assert fig["tokens_per_step"] == 2 * 16
        assert fig["tokens_per_s"] > 0
    assert summary["variants"]["ddp"]["step_vs_ddp"] == pytest.approx(1.0)
    # same weights, same data: the three implementations trained identically, to the bit. At
    # 2 ranks each computes a rank's gradient with the same kernels on the same rows, the
    # reduction adds two ranks' (one addition: the same bits in either order) and halves it
    # (exact), and AdamW is elementwise (the same bits on a shard as on the whole tensor): on
    # any CPU, nothing is left for rounding to differ in. (At more ranks the implementations
    # sum in different orders; this check would then need a derived bound.)
    assert summary["config"]["world_size"] == 2
    assert summary["checks"]["max_loss_difference_between_distributed_variants"] == 0.0


def test_communication_in_model_units(bench: tuple[int, Path, dict[str, Any]]) -> None:
    _, _, summary = bench
    root = summary["config"]["root_fraction"]  # the root unit is gathered once, blocks twice
    # fullshard's reduce-scatter is an all-to-all + local sum on gloo (same bytes)
    for name, rs in (("full_shard", "all_to_all"), ("fsdp2", "reduce_scatter")):
        units = summary["variants"][name]["comm_units"]
        assert set(units) == {"all_gather", rs}, name
        # padding to a multiple of the world size adds at most a few elements per parameter
        assert units["all_gather"] == pytest.approx(2 - root, abs=0.02), name
        assert units[rs] == pytest.approx(1, abs=0.02), name
    ddp = summary["variants"]["ddp"]["comm_units"]
    assert set(ddp) == {"all_reduce"}
    assert ddp["all_reduce"] == pytest.approx(1, abs=1e-3)
    # fullshard's own counters agree with what the c10d dispatcher saw
    fs = summary["variants"]["full_shard"]
    own = {"all_to_all": "reduce_scatter"}  # the c10d op that carries our reduce-scatter
    for kind, units in fs["comm_units"].items():
        assert fs["commstats_units"][own.get(kind, kind)] == pytest.approx(units, rel=1e-6)
    assert 0 <= fs["exposed_ms"] <= fs["observed_step_ms"]
    assert "exposed_ms" not in summary["variants"]["ddp"]


def test_memory_per_variant(bench_memory: tuple[int, Path, dict[str, Any]]) -> None:
    rc, out, summary = bench_memory
    assert rc == 0 and list(summary["variants"]) == ["full_shard", "ddp"]
    model_bytes = summary["config"]["model_bytes"]
    for name, fig in summary["variants"].items():
        mem = fig["memory"]
        assert len(mem["per_rank"]) == 2, name
        for rank in mem["per_rank"]:
            assert rank["rss_growth_bytes"] > 0, name
            assert rank["live_peak_bytes"] > 0, name
    # DDP holds parameters, gradients, its gradient buckets and two AdamW states (5 model
    # copies); full_shard holds half of parameters, gradients and AdamW state plus one window.
    fs = summary["variants"]["full_shard"]["memory"]
    ddp = summary["variants"]["ddp"]["memory"]
    assert ddp["live_peak_mib"] * MIB >= 4 * model_bytes
    # The live peak includes the step's transients, whose overlap depends on timing (gloo's
    # work threads, DDP's bucket all-reduce during backward): measured over 7 launches on one
    # machine, full_shard 3.0-4.6 and DDP 5.1-6.1 model sizes (largest rank); a margin of one
    # model size failed once. What sharding must show regardless: less than DDP, and the
    # optimizer's parameters halved (the tracker's figure below, exact).
    assert fs["live_peak_mib"] < ddp["live_peak_mib"]
    # measured: ~5.1 vs ~7.6 model sizes (6.5 vs 9.7 MiB for this model)
    assert fs["rss_growth_mib"] < ddp["rss_growth_mib"]
    peaks = fs["per_rank"][0]["tracker_peaks"]["optimizer"]
    assert peaks["sharded_params"] == pytest.approx(model_bytes / 2, rel=0.02)
    assert peaks["optimizer_state"] == pytest.approx(model_bytes, rel=0.02)
    table = (out / "bench.md").read_text()  # the figures reach the report
    assert f" | {fs['rss_growth_mib']:.1f} | {fs['live_peak_mib']:.1f} | " in table


def test_external_torchrun_writes_a_timing_report(tmp_path: Path) -> None:
    # Under a user's own torchrun, one launch: timing and communication, no memory figures.
    cmd = [
        sys.executable,
        *["-m", "torch.distributed.run", "--standalone"],
        *["--nproc-per-node=2", "-m", "fullshard.app.cli", "bench"],
        *["--model=tiny", "--variants=no_shard,single", "--batch-size=2"],
        *["--seq-len=16", "--rounds=1", "--timeout=120"],
        f"--out={tmp_path}",
    ]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "bench.json").read_text())
    single = summary["variants"]["single"]
    assert single["tokens_per_step"] == 2 * 16  # one rank's batch
    assert "comm_units" not in single
    assert summary["variants"]["no_shard"]["comm_units"] == {
        "all_reduce": pytest.approx(1.0, abs=0.01)
    }
    assert "memory" not in summary["variants"]["no_shard"]
    assert "| single |" in proc.stdout


def test_bf16_gathers_half_the_bytes_and_reduces_in_float32(tmp_path: Path) -> None:
    # --mixed-precision bf16: fullshard and FSDP2 gather bfloat16 parameters (half the bytes of
    # the fp32 model) and reduce float32 gradients; DDP (autocast) all-reduces its float32
    # gradients. Measured at the c10d dispatcher, so the policies really reached the ranks.
    args = _args(
        *["--model=tiny", "--variants=full_shard,fsdp2,ddp"],
        *["--mixed-precision=bf16", "--batch-size=2", "--seq-len=16"],
        *["--rounds=1", "--no-memory", "--timeout=300"],
        f"--out={tmp_path}",
    )
    assert main_bench(args) == 0
    summary = json.loads((tmp_path / "bench.json").read_text())
    assert summary["config"]["dtype"] == "bfloat16"
    assert summary["config"]["master_dtype"] == "float32"
    root = summary["config"]["root_fraction"]
    for name, rs in (("full_shard", "all_to_all"), ("fsdp2", "reduce_scatter")):
        units = summary["variants"][name]["comm_units"]
        assert units["all_gather"] == pytest.approx((2 - root) / 2, abs=0.02), name
        assert units[rs] == pytest.approx(1, abs=0.02), name
    assert summary["variants"]["ddp"]["comm_units"]["all_reduce"] == pytest.approx(1, abs=1e-3)
    assert summary["checks"]["max_loss_difference_between_distributed_variants"] < 0.05
    assert "bfloat16 compute" in (tmp_path / "bench.md").read_text()


def test_one_rank(tmp_path: Path) -> None:
    args = _args(
        *["--model=tiny", "--nproc=1", "--batch-size=2", "--seq-len=16"],
        *["--rounds=1", "--no-memory", "--timeout=300"],
        f"--out={tmp_path}",
    )
    assert main_bench(args) == 0
    summary = json.loads((tmp_path / "bench.json").read_text())
    assert summary["config"]["world_size"] == 1
    assert list(summary["variants"]) == default_variants(1)  # no hybrid at one rank
    assert not any(v.startswith("hybrid") for v in default_variants(1))
    for fig in summary["variants"].values():
        assert fig["tokens_per_step"] == 2 * 16 and fig["step_ms_median"] > 0


def test_variant_choice() -> None:
    assert default_variants(2) == [
        *["full_shard", "shard_grad_op", "no_shard", "fsdp2", "ddp"],
        "single",
    ]
    assert "hybrid_shard" in default_variants(4)
    assert parse_variants("DDP, fsdp2,ddp", 2) == ["ddp", "fsdp2"]
    with pytest.raises(ValueError, match="unknown bench variant"):
        parse_variants("full_shard,zero3", 2)
    with pytest.raises(ValueError, match="at least 4"):
        parse_variants("hybrid_shard", 2)


def test_bad_options_fail_before_launching(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main_bench(_args("--variants=zero3", f"--out={tmp_path}")) == 2
    assert "unknown bench variant" in capsys.readouterr().err
    assert main_bench(_args("--model=nope", f"--out={tmp_path}")) == 2
    assert main_bench(_args("--backend=nccl", "--device=cpu", f"--out={tmp_path}")) == 2
    assert "--backend nccl moves CUDA tensors only" in capsys.readouterr().err
    assert not (tmp_path / "bench.json").exists()


def test_help_documents_every_option() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    text = parser.format_help()
    for flag in (
        *["--model", "--nproc", "--batch-size", "--seq-len", "--warmup"],
        *["--rounds", "--variants", "--out", "--threads", "--timeout"],
        *["--no-memory", "--mixed-precision", "--device", "--backend"],
    ):
        assert flag in text
    for size in ("tiny", "small", "gpt2-124m", "1b"):
        assert size in text
    assert "--bench-phase" not in text  # internal
