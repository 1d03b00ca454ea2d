"""``fullshard train`` end to end: 2 local ranks through torch.distributed.run, as a user runs it."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import run_command, run_ranks
from safetensors.torch import load_file

from fullshard.app.cli import main
from fullshard.app.config import load_toml

# launches the CLI or torchrun as subprocesses: the top of the test pyramid
pytestmark = pytest.mark.e2e

# A short run on the default corpus: the tiny model, 20 steps, evaluated twice.
BASE = [
    *["--model", "tiny", "--max-steps", "20", "--seq-len", "64"],
    *["--batch-size", "16", "--warmup-steps", "5", "--eval-every", "10"],
    *["--eval-batches", "2", "--log-every", "5", "--sample-tokens", "20"],
    *["--nproc", "2", "--timeout", "120"],
]


def run_train(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Run ``python -m fullshard.app.cli train ARGS`` as a fresh process (not under torchrun);
    past ``timeout`` it and its ranks are killed and the test fails naming the command."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return run_command(
        [sys.executable, "-m", "fullshard.app.cli", "train", *args],
        deadline_s=timeout,
        what="fullshard train",
        env=env,
    )


def main_in_process(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, deadline_s: float = 240
) -> int:
    """``fullshard ARGV`` through ``main`` in this process, not under torchrun; its status.

    For tests that read only the files a launch writes: no launcher interpreter (and its torch
    import), and the ranks fork from this process's forkserver, so what they print goes to that
    server's output, not the test's (tests that check it use ``run_train``). Past
    ``deadline_s`` the launch's ranks are killed and the status is 124, as ``run_train``'s
    deadline ends its process."""
    import functools

    import fullshard.app.launch.local as launch

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    bounded = functools.partial(launch.launch_local, timeout_s=deadline_s)
    monkeypatch.setattr(launch, "launch_local", bounded)
    return main(argv)


def cli_rank(rank: int, world: int, argv: list[str], env: dict[str, str]) -> dict[str, Any]:
    """What a rank of a launch runs (the CLI's ``main`` in torchrun's environment, with ``env``
    set too), on a rank of the harness: the trainer joins the harness's process group. Its exit
    status and what it printed."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world)
    )
    os.environ.update(env)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    return {"status": status, "stdout": out.getvalue(), "stderr": err.getvalue()}


def train_on_ranks(
    args: list[str], *, world: int = 2, env: dict[str, str] | None = None, timeout_s: float = 300
) -> list[dict[str, Any]]:
    """``fullshard train ARGS``'s ranks on ``world`` ranks of the harness, no launch (no launcher
    interpreter, no agent): every rank's :func:`cli_rank`. For runs whose launch is not what a
    test is about (a reference run, a mechanism of the ranks alone)."""
    return run_ranks(cli_rank, world, ["train", *args], env or {}, timeout_s=timeout_s)


def converted(ckpt: Path, out: Path) -> dict[str, torch.Tensor]:
    """The weights of checkpoint ``ckpt`` (or the newest in a folder of them) through ``fullshard
    convert``, in this process (the console entry point is what ``run_train`` launches)."""
    assert main(["convert", str(ckpt), str(out)]) == 0
    return load_file(out)


def records(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in records(run_dir)]


# shard_grad_op + accumulation, with CPU offload and shard_grad_op's own reshard rule given
ZERO2_OFFLOAD = [
    *["--strategy", "shard_grad_op", "--grad-accum", "2"],
    *["--cpu-offload", "--reshard-after-forward", "1"],
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two runs shared by the tests, both accumulating 2 micro-batches a step: a (full_shard),
    and b (shard_grad_op, with CPU offload and an explicit --reshard-after-forward 1, its own
    rule: the same math), the progress bar on while stdout and stderr are pipes.

    The same seed giving the same losses in another launch is tests/test_app_resume.py's
    (bit for bit, across a stop and a resume) and tests/test_app_preempt.py's."""
    root = tmp_path_factory.mktemp("runs")
    cfg = root / "run.toml"
    cfg.write_text(
        '[model]\nname = "demo"\n[training]\nmax_steps = 1000\n[output]\nprogress = false\n'
    )
    variants = {
        # the file says demo/1000 steps, BASE's flags must win
        "a": ["--config", str(cfg), "--grad-accum", "2"],
        "b": ZERO2_OFFLOAD,
    }
    for name, extra in variants.items():
        proc = run_train([*BASE, *extra, "--runs-dir", str(root), "--name", name])
        assert proc.returncode == 0, f"run {name} failed:\n{proc.stdout}\n{proc.stderr}"
        (root / name / "stdout.txt").write_text(proc.stdout)
        (root / name / "stderr.txt").write_text(proc.stderr)
    return root


def test_run_folder_has_config_metrics_plot_and_sample(runs: Path) -> None:
    run = runs / "a"
    for name in ("config.toml", "metrics.jsonl", "loss.png", "sample.txt", "summary.json"):
        assert (run / name).is_file(), name
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    resolved = load_toml(str(run / "config.toml"))
    assert resolved["model"] == "tiny" and resolved["max_steps"] == 20  # flags beat the file
    assert resolved["progress"] is False  # from the file
    recs = records(run)
    assert [r["step"] for r in recs] == [1, 5, 10, 15, 20]
    for r in recs:
        assert len(r["mem_mib"]) == 2 and all(m > 50 for m in r["mem_mib"])  # both ranks' RSS
        assert r["tokens_per_s"] > 0 and r["lr"] > 0
    assert [r["step"] for r in recs if "val_loss" in r] == [10, 20]
    stdout = (run / "stdout.txt").read_text()
    assert "--- sample ---" in stdout and "2 ranks (gloo)" in stdout
    assert (run / "sample.txt").read_text().startswith("The ")


def test_loss_falls_on_the_default_corpus(runs: Path) -> None:
    recs = records(runs / "a")
    start, end = recs[0]["loss"], recs[-1]["loss"]
    assert abs(start - math.log(256)) < 0.3  # an untrained byte model is near uniform
    assert end < start - 1.5, (start, end)
    val = [r["val_loss"] for r in recs if "val_loss" in r]
    assert val[-1] < val[0] < start
    summary = json.loads((runs / "a" / "summary.json").read_text())
    # the same mean loss as the last record's, which metrics.jsonl rounds to 5 decimals
    assert summary["world_size"] == 2 and round(summary["end_loss"], 5) == end


def test_shard_grad_op_with_accumulation_matches_full_shard(runs: Path) -> None:
    # The same global batch split into 2 micro-batches, the gradients synchronised on the
    # second only, in both runs: each rank computes each micro-batch's gradient with the same
    # kernels on the same rows and weights, adds the two in the same order, and the
    # reduce-scatter adds two ranks' (one addition: the same bits in either order). What
    # differs is when parameters are gathered and freed, and where the optimizer's state
    # lives (the CPU, here too), neither of which changes a value: the same bits, on any CPU.
    # (A run without accumulation sums its gradients in another order: rounding differences,
    # which AdamW's division by sqrt(v) can make as large as a step, so no tolerance would
    # hold on every CPU. Each strategy's accumulation against one process is checked in
    # float64 by tests/test_strategies.py.)
    a, b = (json.loads((runs / n / "summary.json").read_text()) for n in ("a", "b"))
    assert (b["start_loss"], b["end_loss"]) == (a["start_loss"], a["end_loss"])
    assert losses(runs / "b") == losses(runs / "a")
    assert json.loads((runs / "b" / "summary.json").read_text())["strategy"] == "shard_grad_op"
    resolved = load_toml(str(runs / "b" / "config.toml"))  # the ranks got both options
    assert (resolved["cpu_offload"], resolved["reshard_after_forward"]) == (True, "1")
    stdout = (runs / "b" / "stdout.txt").read_text()
    assert "--reshard-after-forward 1 for the blocks, CPU offload" in stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--data", "/no/such/corpus.txt"], "data path '/no/such/corpus.txt' does not exist"),
        (["--model", "gpt5"], "unknown model 'gpt5'"),
        (["--nproc", "3", "--batch-size", "16"], "not divisible by world size 3"),
        pytest.param(
            ["--device", "cuda"],
            "--device cuda: no CUDA device is visible",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is visible"),
        ),
        pytest.param(
            ["--backend", "nccl", "--device", "cpu"],
            "--backend nccl moves CUDA tensors only",
        ),
    ],
)
def test_bad_input_fails_fast_with_a_clear_message(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # In this process: the check runs before any launch (tests/test_app_bad_inputs.py runs the
    # console script itself as a user does).
    assert main(["train", *args, "--runs-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())  # nothing launched, nothing written


def test_no_progress_bar_lines_in_pipes_but_plain_log_lines(runs: Path) -> None:
    # "b" ran with the progress bar on, its output captured (not a terminal): tqdm stays
    # silent instead of writing a line per update, and each logged step is one plain line.
    stdout = (runs / "b" / "stdout.txt").read_text()
    stderr = (runs / "b" / "stderr.txt").read_text()
    assert "step/s" not in stderr and "it/s" not in stderr and "%|" not in stderr
    logged = [line for line in stdout.splitlines() if line.startswith("step ")]
    steps = [int(line.split()[1].split("/")[0]) for line in logged]
    assert steps == [r["step"] for r in records(runs / "b")]
    assert all("/20: loss " in line and "tok/s | mem r0 " in line for line in logged)
    assert sum("val_loss" in line for line in logged) == 2


def test_progress_bar_only_on_a_terminal() -> None:
    from fullshard.app.train.monitor import progress_bar

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    pipe = io.StringIO()
    bar = progress_bar(10, 0, True, file=pipe)
    assert bar.disable  # not a terminal: tqdm's disable=None turns it off
    for _ in range(10):
        bar.update(1)
    bar.close()
    assert pipe.getvalue() == ""
    terminal = Terminal()
    bar = progress_bar(10, 3, True, file=terminal)
    assert not bar.disable
    bar.update(1)
    bar.close()
    assert "4/10" in terminal.getvalue()
    assert progress_bar(10, 0, False) is None  # --no-progress
