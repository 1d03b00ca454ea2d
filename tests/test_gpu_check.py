"""The GPU checks' driver off the GPU (the checks themselves are ``tests/gpu/``, skipped here):
``scripts/gpu_check.py``, the one-command entry point, on a quick dry run on gloo/CPU that drives
the real CLI and spawned ranks; and the verdict logic (a FAIL is never lost)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

# launches the CLI or torchrun as subprocesses: the top of the test pyramid
pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.py"  # the entry point; the driver is tests/gpu's
GPU_TESTS = ROOT / "tests" / "gpu"


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    # The script puts this checkout's src on PYTHONPATH itself; start it from elsewhere to
    # show that it needs no install and no PYTHONPATH of ours.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd="/",
        check=False,
    )


def _lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith(("PASS", "FAIL"))]


def test_a_dry_run_on_gloo_drives_the_cli_and_the_ranks() -> None:
    # cli.train runs `python -m fullshard.app.cli` (torchrun and its ranks included); the gloo2
    # check runs in two spawned ranks. A subset of --quick: its other cli.* checks drive the
    # CLI the same way (a subprocess each, its files checked), and resume, convert and
    # checkpoints are tested on CPU by tests/test_app_resume.py and tests/test_checkpoint.py.
    res = _run("--cpu", "--only", "cli.train,*2.parity.full_shard", timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = _lines(res.stdout)
    names = [line.split()[1].rstrip(":") for line in lines]
    assert names == ["cli.train", "gloo2.parity.full_shard"]
    assert all(line.startswith("PASS") for line in lines), res.stdout
    assert "4 of 6 steps (--stop-after)" in res.stdout
    assert "2 of 2 checks passed" in res.stdout


def _main(script: Any, capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    """The script's ``main`` with these arguments, in this process (the dry run above shows the
    script starting on its own): its exit status and what it printed."""
    capsys.readouterr()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", [str(SCRIPT), *args])
        status = script.main()
    return status, capsys.readouterr().out


def test_every_command_and_strategy_is_checked(script: Any, capsys: pytest.CaptureFixture) -> None:
    status, out = _main(script, capsys, "--cpu", "--list")
    assert status == 0, out
    names = out.split()
    for command in ("train", "resume", "convert", "hf", "trace", "bench", "plan", "share"):
        assert f"cli.{command}" in names
    for world in (2, 4):
        for check in (
            *["parity.full_shard", "parity.shard_grad_op", "parity.no_shard"],
            *["bf16", "offload", "checkpoint"],
        ):
            assert f"gloo{world}.{check}" in names
    assert "gloo4.parity.hybrid_shard" in names and "gloo4.parity.hybrid_shard_zero2" in names
    assert "gloo2.parity.hybrid_shard" not in names  # hybrid needs an even world of 4 or more
    # issue 21's CUDA-path checks, in their CPU forms (fake8.no_host_sync: a SKIP on CPU)
    for name in (
        *["gloo1.bf16_offload", "gloo2.bf16_offload", "csan.gloo1"],
        *["csan.gloo4", "fake8.steps", "fake8.no_host_sync"],
    ):
        assert name in names


def test_nothing_chosen_is_a_failure(script: Any, capsys: pytest.CaptureFixture) -> None:
    status, out = _main(script, capsys, "--cpu", "--only", "no-such-check")
    assert status == 1 and "0 of 0 checks passed" in out, out


@pytest.fixture
def script(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(GPU_TESTS))
    import gpu_check

    return gpu_check


def test_a_rank_that_raises_fails_its_check_and_the_rest(script: Any, tmp_path: Path) -> None:
    # a real spawned rank: the first check passes, the unknown one raises, the third is not run
    results = script.run_group(
        "gloo",
        "cpu",
        1,
        ["parity.full_shard", "no-such", "offload"],
        tmp_path,
        time.monotonic() + 120,
    )
    verdicts = {name: (ok, info) for name, ok, info, _ in results}
    assert verdicts["gloo1.parity.full_shard"][0] is True
    assert verdicts["gloo1.no-such"] == (False, "rank 0: raised KeyError: 'no-such'")
    assert verdicts["gloo1.offload"] == (False, "rank 0: not run")


def test_merge_needs_every_rank(script: Any) -> None:
    per_rank = [
        [{"name": "a", "ok": True, "info": "fine", "s": 1.0}],
        [{"name": "a", "ok": False, "info": "diff 1e-2", "s": 2.0}],
        [],
    ]
    [(name, ok, info, seconds)] = script.merge("gloo3.", ["a"], per_rank, late=[2])
    assert (name, ok, seconds) == ("gloo3.a", False, 2.0)
    assert info == "rank 1: diff 1e-2; rank 2: not run; ranks [2] killed at the time limit"
    [(_, ok, info, _)] = script.merge("gloo2.", ["a"], per_rank[:1] * 2, late=[])
    assert ok and info == "fine"


# The sanitizer's report, as torch.cuda._sanitizer prints it to stderr (its layout, shortened).
CSAN_REPORT = """\
============================
CSAN detected a possible data race on tensor with data pointer 139872
Access by stream 94 during kernel:
aten::mul.out(Tensor self, Tensor other, *, Tensor(a!) out) -> Tensor(a!)
writing to argument(s) out, and to the output
With stack trace:
  File "/x/scripts/gpu_checks_cuda.py", line 80, in _step
    loss.backward()
  File "/x/src/fullshard/engine/unit_reduce.py", line 150, in reduce_grads
    torch.mul(a, b, out=c)

Previous access by stream 0 during kernel:
aten::add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor
reading from argument(s) self
With stack trace:
  File "/x/src/fullshard/engine/unit.py", line 300, in copy_out
    y = c + 1

Tensor was allocated with stack trace:
  File "/x/src/fullshard/engine/unit.py", line 290, in alloc
"""


def test_csan_verdict_needs_exit_0_and_no_report(script: Any) -> None:
    verdict = script.cuda_checks.csan_verdict
    passed = [
        ["gloo4.step.full_shard", True, "2 steps", 1.0],
        ["gloo4.step.no_shard", True, "", 1.0],
    ]
    ok, info = verdict(0, "some log\n", passed, sanitized=True)
    assert ok and "full_shard, no_shard" in info and "no CSAN report" in info
    ok, info = verdict(0, "", passed, sanitized=False)
    assert ok and "CPU form" in info
    # a report fails the check even where every rank's verdict passed
    ok, info = verdict(0, "log\n" + CSAN_REPORT, passed, sanitized=True)
    assert not ok and info.startswith("1 CSAN report(s), the first: CSAN detected")
    for part in (
        "Access by stream 94",
        "aten::mul.out",
        "writing to argument(s) out",
        'unit_reduce.py", line 150',
        "Previous access by stream 0",
        "reading from argument(s) self",
        'unit.py", line 300',
    ):
        assert part in info, part
    raised = [["gloo4.step.full_shard", False, "rank 0: raised CUDASanitizerErrors: 1", 1.0]]
    ok, info = verdict(1, CSAN_REPORT * 2, raised, sanitized=True)
    assert not ok and info.startswith("2 CSAN report(s)") and "CUDASanitizerErrors" in info
    ok, info = verdict(124, "a\nb\ntimed out after 240 s", [], sanitized=True)
    assert not ok and info == "exit status 124: a | b | timed out after 240 s"
    ok, info = verdict(0, "", [], sanitized=True)  # nothing ran
    assert not ok


def _quiet(**kw: Any) -> dict[str, Any]:
    """One configuration's fake-group run, as ``gpu_checks_cuda._fake_run`` summarises it."""
    return {"side_streams": 2, "events": 40, "syncs": [], "flags": [], **kw}


def test_fake_verdicts(script: Any) -> None:
    verdicts = script.cuda_checks.fake_verdicts
    runs = {"full_shard": _quiet(), "no_shard": _quiet()}
    [(name, ok, info), (sync_name, sync_ok, sync_info)] = verdicts(
        runs, "cuda", 3, 8, "stream", True
    )
    assert (name, ok, sync_name, sync_ok) == ("fake8.steps", True, "fake8.no_host_sync", True)
    assert "full_shard 40 (2 side stream(s))" in info and "NCCL's path" in info
    assert "0 stream, event or device synchronisations" in sync_info
    # the host waits for the collectives: not NCCL's path
    [(_, ok, info), (_, sync_ok, _)] = verdicts(runs, "cuda", 3, 8, "host", True)
    assert not ok and "gloo's path" in info and sync_ok
    # a synchronisation in the quiet step, and a configuration without side streams
    runs["no_shard"] = _quiet(side_streams=0, syncs=["event synchronize at a.py:1 f"])
    [(_, ok, info), (_, sync_ok, sync_info)] = verdicts(runs, "cuda", 3, 8, "stream", True)
    assert not ok and "no side stream in ['no_shard']" in info
    runs["no_shard"]["unit_streams"] = False  # the engine made no gather/reduce streams
    assert (
        "no gather/reduce streams in the root unit of ['no_shard']"
        in verdicts(runs, "cuda", 3, 8, "stream", True)[0][2]
    )
    assert not sync_ok and sync_info == (
        "no_shard: 1 traced, 0 flagged, first event synchronize at a.py:1 f"
    )
    # a configuration that raised
    [(_, ok, info), (_, sync_ok, _)] = verdicts(
        {"full_shard": {"error": "RuntimeError: boom"}}, "cuda", 3, 8, "stream", True
    )
    assert not ok and not sync_ok and info == "full_shard: RuntimeError: boom"
    # CPU: the steps alone, and a SKIP (None) for the synchronisations
    [(_, ok, info), (_, sync_ok, sync_info)] = verdicts(
        {"full_shard": {"unit_streams": None}}, "cpu", 3, 8, "host", False
    )
    assert ok and info.startswith("CPU form") and (sync_ok, sync_info) == (None, "needs CUDA")


def test_a_skip_is_printed_and_not_counted(script: Any, capsys: pytest.CaptureFixture) -> None:
    report = script.Report(60.0)
    report.add("fake8.no_host_sync", None, "needs CUDA", 0.0)
    report.add("fake8.steps", True, "ran", 1.0)
    assert report.results == [("fake8.steps", True)] and report.skipped == ["fake8.no_host_sync"]
    out = capsys.readouterr().out.splitlines()
    assert out == ["SKIP  fake8.no_host_sync: needs CUDA", "PASS  fake8.steps: ran (1.0 s)"]
