"""Preemption: a stop signal on any rank, on ``fullshard train`` or on torchrun's agent stops
every rank after the same step with a complete checkpoint and status 75; ``--resume latest``
then continues bit for bit (NOTE [Preemption] in fullshard.app.preempt)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_app_cli import records, run_train
from torch.distributed.elastic.multiprocessing.api import SignalException

from fullshard.app.preempt import PREEMPTED_EXIT, AgentSignals, StopSignals, signal_name
from fullshard.checkpoint import convert, latest_checkpoint, verify

# launches the CLI or torchrun as subprocesses: the top of the test pyramid
pytestmark = pytest.mark.e2e

STEPS = 24  # enough steps (~0.1 s each) for an external signal to land mid-run
TRAIN = [
    "--model", "tiny", "--max-steps", str(STEPS), "--seq-len", "32", "--batch-size", "8",
    "--warmup-steps", "3", "--log-every", "1", "--eval-every", "0", "--sample-tokens", "0",
    "--timeout", "120", "--no-progress",
]  # fmt: skip
ARGS = [*TRAIN, "--nproc", "2"]
DEADLINE_S = 180.0


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", **extra)
    return env


@contextlib.contextmanager
def _started(cmd: list[str], log: Path, env: dict[str, str]) -> Iterator[subprocess.Popen[str]]:
    """``cmd`` running in its own process group, output to ``log``; killed (group and all)
    if still running when the block ends."""
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )
        try:
            yield proc
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _until(ready: Callable[[], bool], proc: subprocess.Popen[str], what: str) -> None:
    """Wait (polling) until ``ready()``; fail if ``proc`` ends first or the deadline passes."""
    deadline = time.monotonic() + DEADLINE_S
    while not ready():
        assert proc.poll() is None, f"the run ended (status {proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {DEADLINE_S:.0f} s"
        time.sleep(0.002)


def _logged_step(run: Path) -> int:
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    return json.loads(lines[-1])["step"] if lines and lines[-1].endswith("}") else 0


def _weights(run: Path) -> dict[str, torch.Tensor]:
    """The final weights of ``run``, from its newest checkpoint (verified against its manifest)."""
    folder = latest_checkpoint(str(run / "checkpoints"))
    assert folder is not None and verify(folder) == ""
    return load_file(convert(folder, str(run / "weights.safetensors")))


@dataclass(frozen=True)
class Straight:
    run: Path
    weights: dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Straight:
    """The uninterrupted run every preempted-and-resumed run must equal."""
    root = tmp_path_factory.mktemp("straight")
    proc = run_train([*ARGS, "--runs-dir", str(root), "--name", "straight"])
    assert proc.returncode == 0, proc.stderr
    return Straight(root / "straight", _weights(root / "straight"))


def _resume_equals_straight(run: Path, straight: Straight, preempted_after: int) -> None:
    """``--resume latest`` from the preemption checkpoint ends where the straight run ended."""
    ckpts = sorted(os.listdir(run / "checkpoints"))
    assert ckpts == [f"step_{preempted_after:08d}"]  # committed, nothing partial left over
    assert verify(str(run / "checkpoints" / ckpts[0])) == ""  # every file complete
    summary = json.loads((run / "summary.json").read_text())
    assert summary["preempted_after"] == preempted_after
    proc = run_train(
        [*ARGS, "--runs-dir", str(run.parent), "--name", run.name, "--resume", "latest"]
    )
    assert proc.returncode == 0, proc.stderr
    assert f"resumed from step {preempted_after}" in proc.stdout
    # the same loss at every logged step, and the same final weights, bit for bit
    assert [(r["step"], r["loss"]) for r in records(run)] == [
        (r["step"], r["loss"]) for r in records(straight.run)
    ]
    a, b = straight.weights, _weights(run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_signal_on_one_rank_stops_every_rank_after_that_step(
    straight: Straight, tmp_path: Path
) -> None:
    # Rank 1 alone gets SIGTERM as a seeded random step starts (the hook makes it exact), and
    # again as the preemption checkpoint's save starts: the save must neither die nor tear.
    step = random.Random(15).randint(3, 12)
    fault = f"signal:rank=1:step={step}:sig=TERM:repeat=2"
    env = _env(FULLSHARD_FAULT=fault)
    proc = subprocess.run(
        [sys.executable, "-m", "fullshard.app.cli", "train", *ARGS,
         "--runs-dir", str(tmp_path), "--name", "cut"],
        capture_output=True, text=True, timeout=DEADLINE_S, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == PREEMPTED_EXIT, proc.stdout + proc.stderr
    assert "sends itself SIGTERM again, during the preemption checkpoint's save" in proc.stdout
    assert f"preempted after step {step} (SIGTERM): checkpoint " in proc.stdout
    assert "Traceback" not in proc.stderr  # torchrun's ChildFailedError is ours to report
    _resume_equals_straight(tmp_path / "cut", straight, step)


def test_signal_to_fullshard_train_reaches_the_ranks(straight: Straight, tmp_path: Path) -> None:
    # A real signal to our CLI process (SLURM's usual warning; Kubernetes sends SIGTERM to the
    # container's first process), then SIGTERM as soon as the checkpoint folder appears. The
    # resume from such a checkpoint is the first test's (the same path).
    run = tmp_path / "cut"
    cmd = [sys.executable, "-m", "fullshard.app.cli", "train", *ARGS,
           "--runs-dir", str(tmp_path), "--name", "cut"]  # fmt: skip
    with _started(cmd, tmp_path / "log.txt", _env()) as proc:
        _until(lambda: _logged_step(run) >= 2, proc, "logged step 2")
        proc.send_signal(signal.SIGUSR1)
        _until(lambda: any((run / "checkpoints").glob("step_*")), proc, "a checkpoint folder")
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=DEADLINE_S)
    out = (tmp_path / "log.txt").read_text()
    assert status == PREEMPTED_EXIT, out
    stopped = json.loads((run / "summary.json").read_text())["preempted_after"]
    assert 2 <= stopped < STEPS and f"preempted after step {stopped} (SIGUSR1)" in out
    assert "Traceback" not in out
    assert sorted(os.listdir(run / "checkpoints")) == [f"step_{stopped:08d}"]
    assert verify(str(run / "checkpoints" / f"step_{stopped:08d}")) == ""
    assert [(r["step"], r["loss"]) for r in records(run)] == [
        (r["step"], r["loss"]) for r in records(straight.run)[:stopped]
    ]


def test_sigterm_to_the_torchrun_agent(straight: Straight, tmp_path: Path) -> None:
    # An external torchrun (as under SLURM's srun): its agent forwards SIGTERM to the ranks
    # and waits for them (--shutdown-timeout) before it would SIGKILL them. The resume from
    # such a checkpoint is the first test's (the same path).
    run = tmp_path / "cut"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "fullshard.app.cli", "train", *TRAIN,
           "--runs-dir", str(tmp_path), "--name", "cut"]  # fmt: skip
    with _started(cmd, tmp_path / "log.txt", _env()) as proc:
        _until(lambda: _logged_step(run) >= 2, proc, "logged step 2")
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=DEADLINE_S)
    out = (tmp_path / "log.txt").read_text()
    assert status != 0, out  # torchrun ends a signalled run as a failure (its own status)
    stopped = json.loads((run / "summary.json").read_text())["preempted_after"]
    assert 2 <= stopped < STEPS and f"preempted after step {stopped} (SIGTERM)" in out
    assert "SIGKILL" not in out  # every rank left within the agent's grace period
    assert sorted(os.listdir(run / "checkpoints")) == [f"step_{stopped:08d}"]
    assert verify(str(run / "checkpoints" / f"step_{stopped:08d}")) == ""
    assert [(r["step"], r["loss"]) for r in records(run)] == [
        (r["step"], r["loss"]) for r in records(straight.run)[:stopped]
    ]


def test_stop_signals_only_record_and_are_restored() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    with StopSignals() as signals:
        assert not signals.requested and signals.flag(torch.device("cpu")).tolist() == [0.0]
        os.kill(os.getpid(), signal.SIGUSR1)  # would end this process without the handler
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # handlers run on the main thread between bytecodes
        assert signals.received == [signal.SIGUSR1, signal.SIGTERM]
        # the vote carries the first signal's number; a MAX over ranks keeps one of them
        assert signals.flag(torch.device("cpu")).tolist() == [float(signal.SIGUSR1)]
    assert signal.getsignal(signal.SIGUSR1) is before
    assert signal_name(15.0) == "SIGTERM"


def test_launcher_passes_on_only_the_first_signal() -> None:
    # torchrun's agent runs in the launcher: the first stop signal becomes its SignalException
    # (which passes the signal to the ranks and waits for them); a second exception would break
    # it out of that grace-period wait, so later signals are recorded and dropped.
    raised: list[int] = []
    before = signal.getsignal(signal.SIGTERM)
    with AgentSignals() as signals:
        for _ in range(3):
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.01)
            except SignalException as exc:
                raised.append(exc.sigval)
    assert signals.received == [signal.SIGTERM] * 3 and raised == [signal.SIGTERM]
    # the launch timeout: one SIGKILL for the ranks, flagged, and no stop signal recorded
    with pytest.raises(SignalException) as caught, AgentSignals(timeout_s=0.05) as timer:
        time.sleep(5)
    assert caught.value.sigval == signal.SIGKILL and timer.timed_out and not timer.received
    assert signal.getsignal(signal.SIGTERM) is before  # the handlers are put back
