"""``fullshard train`` under faults: NaN on one rank (host-decided, and on the CUDA path).

What a launched rank runs (the CLI's ``main`` in torchrun's environment, ``FULLSHARD_FAULT``
and the CUDA emulation read from it) runs on the harness's ranks (test_app_cli.train_on_ranks):
the trainer joins the process group already there. What NaN handling does is the ranks' alone;
the launch around it (its statuses, a rank's failure) is tests/test_app_launch.py's, and a whole
launch under a fault (a rank killed and restarted) is tests/test_app_resume.py's.
"""

from __future__ import annotations

import errno
import json
import signal
from pathlib import Path

import pytest
import torch
from test_app_cli import converted, records, train_on_ranks

from fullshard.app import faults as faults_mod
from fullshard.app.faults import Fault, fault_from_env
from fullshard.policies import FullshardError

ARGS = [
    *["--model", "tiny", "--seq-len", "64", "--batch-size", "16"],
    *["--log-every", "1", "--eval-every", "0", "--sample-tokens", "0"],
    *["--nproc", "2", "--timeout", "60", "--no-progress"],
]

# The runs these tests compare step with the kernel the CUDA path steps with (fused AdamW) on
# both sides, so that their weights agree bit for bit on any CPU: two implementations' roundings
# differ by what the CPU's vector kernels make of them (issue 40). The device path's learning
# rate is a float32 tensor (CUDA's kernel reads it through a float pointer), the host path's a
# float64 number: the schedule is chosen exact in float32, 2**-7 x (step + 1) / 8 inside the
# 8-step warmup, so both hold the same values. Each step's rate differs from the next, so a
# device schedule that counted a skipped step would show in the weights.
SAME_KERNEL = ["--optimizer-impl", "fused", "--lr", "0.0078125", "--warmup-steps", "8"]


def _train(args: list[str], fault: str, emulated: bool = False) -> list[dict]:
    """Every rank's status and output of a 2-rank run with the ``FULLSHARD_FAULT`` drill
    ``fault``; ``emulated``: the CUDA path, checked on CPU (NOTE [The CUDA path on CPU])."""
    env = {"FULLSHARD_FAULT": fault, **({"FULLSHARD_CUDA_EMULATION": "1"} if emulated else {})}
    return train_on_ranks([*ARGS, *SAME_KERNEL, *args], env=env)


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """5 steps with a NaN on rank 1 at step 3 and a checkpoint after every step, host-decided
    (plain CPU): the NaN test reads it, and the CUDA-path test compares its final weights."""
    root = tmp_path_factory.mktemp("nan")
    ranks = _train(
        ["--max-steps", "5", "--save-every", "1", "--keep", "5", "--runs-dir", str(root)]
        + ["--name", "n"],
        fault="nan:rank=1:step=3",
    )
    assert [r["status"] for r in ranks] == [0, 0], ranks
    (root / "n" / "stdout.txt").write_text(ranks[0]["stdout"])  # rank 0 prints the run's lines
    return root / "n"


def test_nan_on_one_rank_skips_the_step_on_every_rank(nan_run: Path, tmp_path: Path) -> None:
    stdout = (nan_run / "stdout.txt").read_text()
    assert "step 3: non-finite loss or gradient, optimizer step skipped" in stdout
    assert {"step": 3, "skipped": "non-finite loss or gradient"} in records(nan_run)
    ckpts = nan_run / "checkpoints"
    w2 = converted(ckpts / "step_00000002", tmp_path / "2.safetensors")
    w3 = converted(ckpts / "step_00000003", tmp_path / "3.safetensors")
    w4 = converted(ckpts / "step_00000004", tmp_path / "4.safetensors")
    assert all(torch.equal(w2[k], w3[k]) for k in w2)  # step 3 changed nothing, on any rank
    assert not all(torch.equal(w3[k], w4[k]) for k in w3)  # and training went on


def test_on_the_cuda_path_the_device_skips_the_step_and_quiet_steps_never_sync(
    nan_run: Path, tmp_path: Path
) -> None:
    """NOTE [The step's verdict on the device], under the CUDA emulation: fused AdamW skips
    the non-finite step 3 on the device, the device schedule stays put, the host hears of it a
    step later; no quiet step synchronises the host. The weights are the host-decided run's, bit
    for bit (``nan_run``: the same 5 steps on plain CPU with the same fused AdamW and learning
    rates, ``SAME_KERNEL``, where checkpoints and logging change no bit)."""
    common = ["--max-steps", "5", "--log-every", "5", "--save-every", "0"]
    ranks = _train(
        [*common, "--runs-dir", str(tmp_path), "--name", "emulated"],
        fault="nan:rank=1:step=3",
        emulated=True,
    )
    assert [r["status"] for r in ranks] == [0, 0], ranks
    assert "step 3: non-finite loss or gradient, optimizer step skipped" in ranks[0]["stdout"]
    summary = json.loads((tmp_path / "emulated" / "summary.json").read_text())
    syncs = summary["host_syncs_per_step"]
    print(f"\nhost syncs per step under the emulation: {syncs}")
    assert summary["skipped_nonfinite"] == [3]
    assert [syncs[str(s)] for s in (2, 3, 4)] == [0, 0, 0], syncs  # quiet steps, step 3 too
    a = converted(nan_run / "checkpoints", tmp_path / "a.safetensors")
    b = converted(tmp_path / "emulated" / "checkpoints", tmp_path / "b.safetensors")
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


def test_cpu_offload_on_the_cuda_path_steps_on_the_host_with_the_host_read_inputs(
    nan_run: Path, tmp_path: Path
) -> None:
    """--cpu-offload on the CUDA path: the optimizer's parameters live on the host, so the host
    decides the step (NOTE [The step's verdict on the device]); a device learning rate or
    found_inf handed to the host kernel would be read before its copy lands (the emulation's
    NOTE [Kernel contracts] refuses it). Two host synchronisations per quiet step: the
    offloaded gradients, and the step's verdict (which brings the clipping norm along). Every
    bit as the host-decided run without offload (the same host fused AdamW on the same
    values)."""
    common = ["--max-steps", "5", "--log-every", "4", "--save-every", "0", "--cpu-offload"]
    ranks = _train(
        [*common, "--runs-dir", str(tmp_path), "--name", "offload"],
        fault="nan:rank=1:step=3",
        emulated=True,
    )
    assert [r["status"] for r in ranks] == [0, 0], ranks
    summary = json.loads((tmp_path / "offload" / "summary.json").read_text())
    syncs = summary["host_syncs_per_step"]
    print(f"\nhost syncs per step, --cpu-offload under the emulation: {syncs}")
    assert summary["skipped_nonfinite"] == [3]
    assert [syncs[str(s)] for s in (2, 3)] == [2, 2], syncs  # quiet steps, step 3 too
    a = converted(nan_run / "checkpoints", tmp_path / "a.safetensors")
    b = converted(tmp_path / "offload" / "checkpoints", tmp_path / "b.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    lrs = {r["step"]: r["lr"] for r in records(tmp_path / "offload") if "lr" in r}
    assert sorted(lrs) == [1, 4, 5]
    assert lrs == {r["step"]: r["lr"] for r in records(nan_run) if r.get("step") in lrs}


def test_nan_with_on_nonfinite_stop_fails_every_rank_with_the_step(tmp_path: Path) -> None:
    ranks = _train(
        ["--max-steps", "4", "--on-nonfinite", "stop", "--runs-dir", str(tmp_path), "--name", "s"],
        fault="nan:rank=1:step=3",
    )
    for rank, r in enumerate(ranks):  # both ranks say so, and fail
        assert r["status"] != 0, r
        assert r["stderr"].count("step 3 produced a non-finite loss") == 1, (rank, r)


def test_fault_specs() -> None:
    def parse(spec: str, **env: str) -> tuple[Fault, ...] | None:
        faults = fault_from_env({"FULLSHARD_FAULT": spec, **env})
        return None if faults is None else faults.faults

    assert parse("signal:rank=1:step=3:sig=usr1:repeat=2") == (
        Fault("signal", 1, 3, signal.SIGUSR1, 2),
    )
    assert parse("signal:step=3") == (Fault("signal", 0, 3, signal.SIGTERM, 1),)
    with pytest.raises(FullshardError, match="sig=TERM or sig=USR1"):
        parse("signal:sig=KILL")
    both = parse("kill:rank=2:step=6+freeze:rank=1:step=4:secs=12:at=recovery")
    assert both == (
        Fault("kill", 2, 6),
        Fault("freeze", 1, 4, secs=12.0, at="recovery"),
    )
    with pytest.raises(FullshardError, match="at= is step, or recovery, generation, save, commit"):
        parse("nan:rank=1:at=recovery")  # a NaN is a step's, not a recovery's
    with pytest.raises(FullshardError, match="at= is step"):
        parse("kill:at=later")
    assert parse("kill:step=3", TORCHELASTIC_RESTART_COUNT="1") is None  # a restarted attempt
    assert parse("kill:step=3", FULLSHARD_ELASTIC_JOIN="7") is None  # a replacement
    # issue 43's moments, and a slot lost again: a replacement in it gets the fault too
    assert parse("kill:rank=0:step=4:at=commit+kill:rank=2:step=4:again=1+diskfull:step=6") == (
        Fault("kill", 0, 4, at="commit"),
        Fault("kill", 2, 4, again=True),
        Fault("diskfull", 0, 6),
    )
    assert parse("kill:rank=2:step=4:again=1+kill:step=5", FULLSHARD_ELASTIC_JOIN="7") == (
        Fault("kill", 2, 4, again=True),
    )
    assert fault_from_env({}) is None


def test_faults_fire_where_due(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step fault fires at its step only; an at=recovery fault only in a recovery from its
    step or later, on its rank; freeze ranks are the launcher's to spare."""
    slept: list[float] = []
    monkeypatch.setattr(faults_mod.time, "sleep", slept.append)  # ``hang`` sleeps
    faults = fault_from_env(
        {"FULLSHARD_FAULT": "hang:rank=1:step=3+hang:rank=0:step=5:at=recovery+freeze:rank=2"}
    )
    assert faults is not None and faults.frozen_ranks() == {2}
    assert not faults.at_step(2, 1) and not faults.at_step(3, 0) and slept == []
    assert not faults.at_step(3, 1) and len(slept) == 1  # the step fault, once
    assert not faults.at_step(5, 0) and len(slept) == 1  # at=recovery: not in a step
    faults.at_recovery(4, 0)  # a failure before its step
    faults.at_recovery(5, 1)  # another rank
    assert len(slept) == 1
    faults.at_recovery(6, 0)
    assert len(slept) == 2


def test_checkpoint_faults_fire_at_their_point() -> None:
    """``diskfull`` fails the rank's write of its step's checkpoint as a full disk does;
    ``at=save`` and ``at=commit`` fire once the files, and the merged ``.metadata``, are written
    (here a ``hang``, its sleep recorded)."""
    faults = fault_from_env(
        {"FULLSHARD_FAULT": "diskfull:rank=1:step=4+hang:rank=0:step=6:at=commit"}
    )
    assert faults is not None
    faults.at_save("write", 4, 0)  # another rank
    faults.at_save("write", 2, 1)  # another step
    with pytest.raises(OSError, match="No space left on device") as full:
        faults.at_save("write", 4, 1)
    assert full.value.errno == errno.ENOSPC
    slept: list[float] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(faults_mod.time, "sleep", slept.append)
        faults.at_save("written", 6, 0)  # at=commit: not once the files are written
        assert slept == []
        faults.at_save("metadata", 6, 0)
        assert len(slept) == 1
