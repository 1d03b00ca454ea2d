"""Joining the process group: device and backend choice, errors before any rank waits, flags.

CUDA is faked (``torch.cuda.is_available`` / ``device_count`` and ``cuda_usable`` patched) so
the rules run here, on a machine without a GPU; the process group is never really joined.
"""

from __future__ import annotations

import argparse
from typing import Any

import pytest
import torch

from fullshard.app.errors import ConfigError
from fullshard.app.launch import local as launch


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A machine with ``state["count"]`` GPUs; ``state["busy"]`` lists the unusable ones; the
    process group is recorded, not joined."""
    state: dict[str, Any] = {"count": 2, "busy": set(), "init": None, "set_device": None}

    def cuda_usable(index: int) -> str:
        if index >= state["count"]:
            return f"this rank needs CUDA device {index}, but only {state['count']} are visible"
        if index in state["busy"]:
            return f"CUDA device {index} cannot be used (busy or unavailable)"
        return ""

    def init_process_group(**kwargs: Any) -> None:
        state["init"] = kwargs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: state["count"] > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: state["count"])
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: state.update(set_device=d))
    monkeypatch.setattr(launch, "cuda_usable", cuda_usable)
    monkeypatch.setattr(launch.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(launch.dist, "init_process_group", init_process_group)
    monkeypatch.setattr(launch.dist, "PrefixStore", lambda prefix, store: store)
    monkeypatch.setattr(launch, "rendezvous", lambda *a, **k: iter([(object(), 0, 1)]))
    # init_distributed sets it for the run; set-then-delete makes monkeypatch remove it after
    monkeypatch.setenv("FULLSHARD_TIMEOUT_S", "0")
    monkeypatch.delenv("FULLSHARD_TIMEOUT_S")
    return state


def _env(monkeypatch: pytest.MonkeyPatch, rank: int, local_ranks: int) -> None:
    for key, value in {
        "RANK": rank,
        "WORLD_SIZE": local_ranks,
        "LOCAL_RANK": rank,
        "LOCAL_WORLD_SIZE": local_ranks,
    }.items():
        monkeypatch.setenv(key, str(value))


def test_nccl_takes_one_gpu_per_rank_and_binds_it(
    gpus: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    _env(monkeypatch, rank=1, local_ranks=2)
    info = launch.init_distributed("auto", 30.0)
    assert (info.device, info.backend) == (torch.device("cuda", 1), "nccl")
    assert gpus["set_device"] == torch.device("cuda", 1)
    assert gpus["init"]["backend"] == "nccl"
    assert launch.os.environ["FULLSHARD_TIMEOUT_S"] == "30.0"  # fullshard's waits: same bound
    if launch._accepts_device_id():  # torch >= 2.3: NCCL binds its device eagerly
        assert gpus["init"]["device_id"] == torch.device("cuda", 1)


def test_gloo_ranks_share_the_gpus(gpus: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    gpus["count"] = 1
    _env(monkeypatch, rank=3, local_ranks=4)  # four ranks, one GPU: NCCL would refuse
    info = launch.init_distributed("cuda", 30.0, backend="gloo")
    assert (info.device, info.backend) == (torch.device("cuda", 0), "gloo")
    assert gpus["init"]["backend"] == "gloo" and "device_id" not in gpus["init"]
    gpus["count"] = 2
    assert launch.rank_device("cuda", "gloo", 3, 4) == (torch.device("cuda", 1), "gloo")


def test_more_nccl_ranks_than_gpus_fails_on_every_rank_before_joining(
    gpus: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    gpus["count"] = 2
    for rank in range(3):  # rank 0 has a GPU, and still refuses: its peer 2 never would come
        _env(monkeypatch, rank=rank, local_ranks=3)
        with pytest.raises(ConfigError, match="only 2 CUDA device") as err:
            launch.init_distributed("cuda", 30.0)
        assert "--backend gloo" in str(err.value) and "--nproc" in str(err.value)
    assert gpus["init"] is None  # no rank joined the process group


def test_busy_gpu_is_an_error_before_joining(
    gpus: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    gpus["busy"] = {1}
    _env(monkeypatch, rank=1, local_ranks=2)
    with pytest.raises(ConfigError, match="local rank 1: CUDA device 1 cannot be used"):
        launch.init_distributed("auto", 30.0)
    assert gpus["init"] is None


def test_device_cuda_without_cuda(gpus: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    gpus["count"] = 0
    _env(monkeypatch, rank=0, local_ranks=1)
    with pytest.raises(ConfigError, match="--device cuda: "):
        launch.init_distributed("cuda", 30.0)
    with pytest.raises(ConfigError, match="--backend nccl moves CUDA tensors only"):
        launch.init_distributed("auto", 30.0, backend="nccl")
    assert gpus["init"] is None
    # auto on a machine without CUDA: gloo on the CPU
    assert launch.resolve_backend("auto", "auto") == ("cpu", "gloo")


def test_cpu_with_nccl_is_refused(gpus: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="--device cpu was asked for"):
        launch.resolve_backend("cpu", "nccl")
    assert launch.resolve_backend("cpu", "auto") == ("cpu", "gloo")
    assert launch.resolve_backend("auto", "auto") == ("cuda", "nccl")


def test_forward_flags_are_full_names_without_excluded() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--model", default="small")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--prompt", default="The ")
    args = parser.parse_args(
        ["--nproc", "3", "--seq-len", "16", "--check", "--no-progress", "--prompt=-x"]
    )
    flags = launch.forward_flags(parser, args, exclude=("nproc",))
    assert flags == ["--seq-len=16", "--check", "--no-progress", "--prompt=-x"]
    assert parser.parse_args(flags).seq_len == 16  # the ranks read them back


# ----------------------------------------------------------------------------------------------
# the in-process torchrun agent: statuses the launcher turns the ranks' exits into

FAKE_RANK = """\
import os, sys, time
from pathlib import Path

mode, rank = sys.argv[2], os.environ["RANK"]
if mode in ("forked", "fresh"):  # NOTE [Ranks from a forkserver]: forked by the server
    forked = os.getppid() != int(os.environ["LAUNCHER_PID"]) and os.getcwd() in sys.path
    sys.exit(0 if forked == (mode == "forked") else 8)
if mode == "raise":  # an uncaught exception: its traceback and status 1, as `python -m` gives
    raise ValueError(f"boom on rank {rank}")
if mode == "ok":  # the launcher validated: the ranks are told so
    sys.exit(0 if os.environ.get("FULLSHARD_VALIDATED") == "1" else 9)
if mode == "input-error":  # what fullshard.app.errors.report_error does on a rank
    marker = Path(os.environ["FULLSHARD_ERROR_MARKER"])
    if rank == "1":
        marker.write_text("--resume latest: bad shard")
    else:  # a real rank exits 65 only once the message is written (by it, or by a peer)
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    sys.exit(65)
if mode == "crash":
    sys.exit(3 if rank == "1" else 0)
if mode == "preempted":
    if rank == "0":
        Path(os.environ["FULLSHARD_PREEMPT_MARKER"]).write_text('{"preempted_after": 2}')
    sys.exit(75)
time.sleep(120)  # "hang"
"""


@pytest.mark.parametrize(
    ("mode", "status", "message"),
    [
        ("ok", 0, None),
        ("input-error", 2, "fullshard fake: error: --resume latest: bad shard"),
        ("crash", 1, "fullshard: rank 1 failed (exit status 3"),
        ("preempted", 75, None),
        ("hang", 124, "fullshard: launch timed out after 3 s"),
    ],
)
def test_launcher_statuses(
    tmp_path: Any, capfd: pytest.CaptureFixture[str], mode: str, status: int, message: str | None
) -> None:
    import os

    (tmp_path / "fake_rank.py").write_text(FAKE_RANK)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(tmp_path)
    before = dict(os.environ)
    timeout = 3.0 if mode == "hang" else 120.0
    got = launch.launch_local(2, ["fake", mode], module="fake_rank", env=env, timeout_s=timeout)
    assert got == status
    assert dict(os.environ) == before  # the ranks' environment was ours only while they ran
    err = capfd.readouterr().err
    assert "Traceback" not in err
    if message is not None:
        assert message in err
    if mode == "input-error":  # one message: the agent's "failed (exitcode: 65)" lines dropped
        assert err.strip().splitlines() == [message], err


@pytest.mark.parametrize("fresh", [False, True])
def test_ranks_are_forked_from_a_server_unless_fresh_interpreters_are_asked(
    tmp_path: Any, fresh: bool
) -> None:
    import os

    (tmp_path / "fake_rank.py").write_text(FAKE_RANK)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(tmp_path)  # found by a forked rank too, as by `python -m`
    env["LAUNCHER_PID"] = str(os.getpid())
    mode = "fresh" if fresh else "forked"
    got = launch.launch_local(
        2, ["fake", mode], module="fake_rank", env=env, fresh_interpreters=fresh
    )
    assert got == 0


def test_a_forked_rank_that_raises_prints_its_traceback_and_fails(tmp_path: Any) -> None:
    import os
    import subprocess
    import sys

    # its own launcher process: a forkserver this test process started earlier writes to the
    # stderr it had then, which capfd does not see
    (tmp_path / "fake_rank.py").write_text(FAKE_RANK)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(tmp_path) + os.pathsep + env.get("PYTHONPATH", "")
    # (its server preloads nothing: the traceback does not depend on it, and the training
    # rank's imports cost seconds of CPU)
    code = (
        "import sys; from fullshard.app.launch import local as launch; launch.RANK_PRELOAD.clear(); "
        "sys.exit(launch.launch_local(2, ['fake', 'raise'], module='fake_rank'))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 1, proc.stderr
    err = proc.stderr
    assert 'raise ValueError(f"boom on rank {rank}")' in err and "ValueError: boom on rank" in err
    assert "fullshard: rank " in err and "failed (exit status 1" in err
