"""Preemption: a stop signal on any rank, on ``fullshard train`` or on torchrun's agent stops
every rank after the same step with a complete checkpoint and status 75; the checkpoint holds
exactly what the uninterrupted run holds after that step (model, optimizer, scheduler, data
position), so ``--resume latest`` continues bit for bit (NOTE [Preemption] in
fullshard.app.launch.preempt). That a resume from a run's own stop checkpoint equals the uninterrupted
run, bit for bit, is tests/test_app_resume.py's (the same checkpoint, saved at the stop by the
same code)."""

from __future__ import annotations

import contextlib
import dataclasses
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
from test_app_cli import records, train_on_ranks
from torch.distributed.elastic.multiprocessing.api import SignalException

from fullshard.app.launch.preempt import PREEMPTED_EXIT, AgentSignals, StopSignals, signal_name
from fullshard.checkpoint import verify

# launches the CLI or torchrun as subprocesses: the top of the test pyramid
pytestmark = pytest.mark.e2e

STEPS = 24  # enough steps (~0.1 s each) for an external signal to land mid-run
TRAIN = [
    "--model",
    "tiny",
    "--max-steps",
    str(STEPS),
    *["--seq-len", "32", "--batch-size", "8", "--warmup-steps", "3"],
    *["--log-every", "1", "--eval-every", "0", "--sample-tokens", "0"],
    *["--timeout", "120", "--no-progress"],
]
ARGS = [*TRAIN, "--nproc", "2"]
DEADLINE_S = 180.0
# the step the first test's rank-1 signal lands on (seeded); the straight run checkpoints there
SIGNAL_STEP = random.Random(15).randint(3, 12)


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


def _state(folder: Path, out: Path) -> dict:
    """Everything checkpoint ``folder`` holds (model and optimizer shards at their full shape,
    the run state: step, scheduler, every rank's data position and RNG), read offline after
    its files are verified against its manifest."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    assert verify(str(folder)) == ""
    dcp_to_torch_save(str(folder), str(out))
    return torch.load(out, weights_only=False)


def _same(a: object, b: object) -> bool:
    """``a`` and ``b`` hold the same values, tensors bit for bit (dtype and shape too)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and _same(vars(a), vars(b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


@dataclass(frozen=True)
class Straight:
    run: Path
    state: dict  # its checkpoint after SIGNAL_STEP: what a run preempted there must hold


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Straight:
    """The uninterrupted run every preempted run must equal; it also checkpoints after
    ``SIGNAL_STEP`` (checkpoints change no bit of training), for the first test's comparison.
    Its ranks run on the harness's, no launch: the launches are the preempted runs'."""
    root = tmp_path_factory.mktemp("straight")
    ranks = train_on_ranks(
        [*ARGS, "--save-every", str(SIGNAL_STEP), "--keep", "0"]
        + ["--runs-dir", str(root), "--name", "straight"]
    )
    assert [r["status"] for r in ranks] == [0, 0], ranks
    run = root / "straight"
    return Straight(run, _state(run / "checkpoints" / f"step_{SIGNAL_STEP:08d}", root / "s.pt"))


def _preempted_like_straight(run: Path, straight: Straight, preempted_after: int) -> None:
    """The preemption checkpoint holds the straight run's state after the same step, bit for
    bit: ``--resume latest`` from it continues as the straight run went on."""
    ckpts = sorted(os.listdir(run / "checkpoints"))
    assert ckpts == [f"step_{preempted_after:08d}"]  # committed, nothing partial left over
    summary = json.loads((run / "summary.json").read_text())
    assert summary["preempted_after"] == preempted_after
    # the same loss at every logged step up to the stop
    assert [(r["step"], r["loss"]) for r in records(run)] == [
        (r["step"], r["loss"]) for r in records(straight.run)[:preempted_after]
    ]
    state = _state(run / "checkpoints" / ckpts[0], run.parent / "cut.pt")  # every file complete
    assert set(state) == {"model", "optim", "run"} and state["run"].step == preempted_after
    assert state["model"] and state["optim"]["state"]
    # Every rank's global RNG state is saved, but each process starts it unseeded and training
    # never draws from it (the model, the data and sampling use seeded generators): not compared.
    assert len(state["run"].rng) == len(straight.state["run"].rng) == 2

    def without_rng(s: dict) -> dict:
        return {**s, "run": dataclasses.replace(s["run"], rng=[])}

    assert _same(without_rng(state), without_rng(straight.state))


def test_signal_on_one_rank_stops_every_rank_after_that_step(
    straight: Straight, tmp_path: Path
) -> None:
    # Rank 1 alone gets SIGTERM as a seeded random step starts (the hook makes it exact), and
    # again as the preemption checkpoint's save starts: the save must neither die nor tear.
    step = SIGNAL_STEP
    fault = f"signal:rank=1:step={step}:sig=TERM:repeat=2"
    env = _env(FULLSHARD_FAULT=fault)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fullshard.app.cli",
            "train",
            *ARGS,
            "--runs-dir",
            str(tmp_path),
            "--name",
            "cut",
        ],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        env=env,
        check=False,
    )
    assert proc.returncode == PREEMPTED_EXIT, proc.stdout + proc.stderr
    assert "sends itself SIGTERM again, during the preemption checkpoint's save" in proc.stdout
    assert f"preempted after step {step} (SIGTERM): checkpoint " in proc.stdout
    assert "Traceback" not in proc.stderr  # torchrun's ChildFailedError is ours to report
    _preempted_like_straight(tmp_path / "cut", straight, step)


def test_signal_to_fullshard_train_reaches_the_ranks(straight: Straight, tmp_path: Path) -> None:
    # A real signal to our CLI process (SLURM's usual warning; Kubernetes sends SIGTERM to the
    # container's first process), then SIGTERM as soon as the checkpoint folder appears. What
    # such a checkpoint holds is the first test's (the same path).
    run = tmp_path / "cut"
    cmd = [
        sys.executable,
        "-m",
        "fullshard.app.cli",
        "train",
        *ARGS,
        "--runs-dir",
        str(tmp_path),
        "--name",
        "cut",
    ]
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


@pytest.mark.parametrize(
    ("sig", "elastic"), [(signal.SIGUSR1, False), (signal.SIGINT, True)], ids=["usr1", "int"]
)
def test_a_stop_signal_to_the_whole_process_group(
    straight: Straight, tmp_path: Path, sig: signal.Signals, elastic: bool
) -> None:
    """What a terminal's Ctrl-C, ``timeout`` or a scheduler that signals every task does: the
    signal reaches the launcher, its helper processes (multiprocessing's forkserver and resource
    tracker) and every rank at once. One checkpoint after the same step on every rank, status
    75, no traceback: the helpers ignore it (NOTE [Helpers ignore stop signals]). Under
    ``--elastic`` the launcher is fullshard's own, which passes the signal on and knows a rank
    that stopped from one that was lost."""
    run = tmp_path / "cut"
    mode = ["--elastic", "--micro-batch-size", "2"] if elastic else []
    cmd = [
        sys.executable,
        "-m",
        "fullshard.app.cli",
        "train",
        *ARGS,
        *mode,
        "--runs-dir",
        str(tmp_path),
        "--name",
        "cut",
    ]
    with _started(cmd, tmp_path / "log.txt", _env()) as proc:
        _until(lambda: _logged_step(run) >= 2, proc, "logged step 2")
        os.killpg(proc.pid, sig)
        status = proc.wait(timeout=DEADLINE_S)
    out = (tmp_path / "log.txt").read_text()
    assert status == PREEMPTED_EXIT, out
    stopped = json.loads((run / "summary.json").read_text())["preempted_after"]
    assert 2 <= stopped < STEPS and f"preempted after step {stopped} ({sig.name})" in out
    assert "Traceback" not in out and "died unexpectedly" not in out, out
    assert "replacement" not in out and "exited with status" not in out  # no rank was lost
    assert sorted(os.listdir(run / "checkpoints")) == [f"step_{stopped:08d}"]
    assert verify(str(run / "checkpoints" / f"step_{stopped:08d}")) == ""
    if not elastic:  # (--elastic reads the global sampler's batches: another run)
        assert [(r["step"], r["loss"]) for r in records(run)] == [
            (r["step"], r["loss"]) for r in records(straight.run)[:stopped]
        ]


def test_sigterm_to_the_torchrun_agent(straight: Straight, tmp_path: Path) -> None:
    # An external torchrun (as under SLURM's srun): its agent forwards SIGTERM to the ranks
    # and waits for them (--shutdown-timeout) before it would SIGKILL them. What such a
    # checkpoint holds is the first test's (the same path).
    run = tmp_path / "cut"
    cmd = [
        sys.executable,
        *["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
        *["-m", "fullshard.app.cli", "train"],
        *TRAIN,
        "--runs-dir",
        str(tmp_path),
        "--name",
        "cut",
    ]
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
