"""Bad input to a command that launches ranks: one clear message and status 2, before any rank.

Each case runs ``fullshard.app.cli.main`` in this process with launching replaced by a failure
(a case that got past validation would otherwise start torchrun); a few run the real console
entry in a subprocess, as a user would.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fullshard.app.commands.bench as bench_module
import fullshard.app.launch.local as launch_module
from fullshard.app.cli import build_parser, main
from fullshard.app.commands.bench import validate as validate_bench
from fullshard.app.commands.plan import validate_check as validate_plan_check
from fullshard.app.commands.trace import validate as validate_trace
from fullshard.app.commands.train import validate as validate_train
from fullshard.app.config import TrainConfig
from fullshard.app.data.corpus import RankBatches, split_for_rank

SRC = Path(__file__).resolve().parents[1] / "src"
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is visible")
HAS_HF = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="needs transformers"
)


@pytest.fixture(autouse=True)
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder of inputs, as the current directory; not under torchrun; no launching."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "empties").mkdir()
    (tmp_path / "empties" / "a.txt").write_text("")
    (tmp_path / "empties" / "b.md").write_text("")
    (tmp_path / "binaries").mkdir()
    (tmp_path / "binaries" / "x.bin").write_bytes(b"\0\1")
    (tmp_path / "short.txt").write_text("hello world " * 100)  # 1200 bytes
    (tmp_path / "a_file").write_text("not a folder\n")
    (tmp_path / "runs" / "exp" / "checkpoints").mkdir(parents=True)  # a run, no checkpoint yet

    def no_launch(*args: object, **kwargs: object) -> int:
        raise AssertionError(f"ranks were launched for bad input: {args}")

    monkeypatch.setattr(launch_module, "launch_local", no_launch)
    monkeypatch.setattr(bench_module, "_launch", no_launch)
    return tmp_path


def _one_error(command: str, err: str, out: str, message: str) -> None:
    assert "Traceback" not in err and "Traceback" not in out
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err  # exactly one message
    assert lines[0].startswith(f"fullshard {command}: error: "), lines[0]
    assert message in lines[0], lines[0]


TRAIN = [
    # the corpus
    (["--data", "empty.txt"], "--data empty.txt: the file is empty"),
    (["--data", "empties"], "--data empties: all 2 files are empty"),
    (["--data", "binaries"], "holds no text files"),
    (["--data", "short.txt"], "1,200 tokens are too few for one training batch"),
    (["--data", "short.txt", "--seq-len", "72"], "needs 656"),
    (["--data", "missing.txt"], "data path 'missing.txt' does not exist"),
    (["--batch-size", "4096", "--seq-len", "256"], "default: the built-in corpus"),
    # resuming
    (["--resume", "latest"], "--resume latest continues a named run, but no --name"),
    (["--resume", "latest", "--name", "exp"], "checkpoints holds no committed checkpoint"),
    (["--resume", "latest", "--name", "typo"], "drop --resume"),
    (["--resume", "empties"], "--resume empties: not a committed checkpoint"),
    (["--resume", "missing"], "no such checkpoint"),
    # the model
    (["--model", "gpt9"], "--model: unknown model 'gpt9'"),
    (["--model", "tiny", "--seq-len", "512"], "exceeds the 128-token context of model 'tiny'"),
    pytest.param(
        ["--model", "hf:gpt2-tiny", "--seq-len", "512"],
        "exceeds the 256-token context of model 'hf:gpt2-tiny'",
        marks=HAS_HF,
    ),
    (["--model", "hf:nope"], "unknown Hugging Face model 'nope'"),
    (["--tokenizer", "missing"], "neither 'byte' nor a local tokenizer directory"),
    # counts and numbers
    (["--nproc", "0"], "--nproc must be at least 1"),
    (["--max-steps", "0"], "--max-steps must be at least 1"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--keep", "-1"], "--keep must be >= 0"),
    (["--nproc", "3"], "not divisible by world size 3"),
    (["--lr", "nan"], "--lr must be a finite number"),
    (["--timeout", "inf"], "--timeout must be a finite number"),
    (["--timeout", "0"], "--timeout must be positive"),
    (["--beta2", "1"], "--beta1 and --beta2 must be in [0, 1)"),
    (["--val-fraction", "1"], "--val-fraction must be in [0, 1)"),
    (
        ["--deterministic", "--optimizer-impl", "fused", "--device", "cpu"],
        "--deterministic with --optimizer-impl fused on CPU",
    ),
    # sharding
    (
        ["--strategy", "hybrid_shard", "--nproc", "3", "--batch-size", "15"],
        "has no default shard group size",
    ),
    (["--strategy", "hybrid_shard", "--nproc", "4", "--shard-size", "3"], "(got 3)"),
    (["--nproc", "4", "--tp", "3"], "--tp 3 does not divide the 4 ranks"),
    (["--nproc", "3", "--tp", "3", "--batch-size", "9", "--model", "hf:llama-tiny"], "--tp 3: "),
    (
        ["--nproc", "4", "--reshard-after-forward", "3"],
        "--reshard-after-forward 3 does not divide the shard group of 4 ranks (full_shard on 4 "
        "ranks): N must divide it; use one of 1, 2, 4 (1 is false, 4 is true), or true / false",
    ),
    (
        ["--nproc", "8", "--strategy", "hybrid_shard", "--reshard-after-forward", "8"],
        "does not divide the shard group of 4 ranks (hybrid_shard on 8 ranks)",
    ),
    (
        ["--strategy", "no_shard", "--reshard-after-forward", "2"],
        "shard group of 1 rank (no_shard on 2 ranks): N must divide it; use one of 1 (1 is false)",
    ),
    (
        ["--nproc", "8", "--tp", "2", "--reshard-after-forward", "3"],
        "of 4 ranks (full_shard on 8 ranks / --tp 2)",
    ),
    (
        ["--nproc", "8", "--tp", "2", "--reshard-after-forward", "2"],
        "--reshard-after-forward 2 with --tp: tensor-parallel parameters cannot reshard to a "
        "smaller group (nor in torch FSDP2): use --reshard-after-forward true or false, or drop "
        "--tp",
    ),
    (
        ["--reshard-after-forward", "maybe"],
        "--reshard-after-forward 'maybe' is neither true, false nor a number of ranks: give true",
    ),
    (["--reshard-after-forward", "0"], "--reshard-after-forward '0' is neither true, false"),
    # devices and outputs
    (["--backend", "nccl", "--device", "cpu"], "--backend nccl moves CUDA tensors only"),
    pytest.param(["--device", "cuda"], "--device cuda: no CUDA device", marks=NO_CUDA),
    (["--runs-dir", "a_file"], "--runs-dir a_file is a file"),
    (["--checkpoint-dir", "a_file/ckpt"], "lies under a_file, which is a file"),
]

TRACE = [
    (["--model", "gpt9"], "--model: unknown model 'gpt9'"),
    (["--nproc", "0"], "--nproc must be at least 1"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--warmup", "-1"], "--warmup must be at least 0"),
    (["--seq-len", "999"], "exceeds the 256-token context of model 'small'"),
    (
        ["--strategy", "hybrid_shard", "--shard-size", "3"],
        "divides 2 and is smaller than it (got 3)",
    ),
    (["--timeout", "0"], "--timeout must be a positive number of seconds"),
    (["--out", "a_file"], "--out a_file is a file"),
    (["--backend", "nccl", "--device", "cpu"], "--backend nccl moves CUDA tensors only"),
    pytest.param(["--device", "cuda"], "--device cuda: no CUDA device", marks=NO_CUDA),
]

BENCH = [
    (["--variants", "zero3"], "--variants zero3: unknown bench variant(s) ['zero3']"),
    (["--variants", "hybrid_shard"], "need an even --nproc of at least 4"),
    (["--model", "gpt9"], "--model: unknown model 'gpt9'"),
    (["--nproc", "0"], "--nproc must be at least 1"),
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--memory-steps", "0"], "--memory-steps must be at least 1"),
    (["--warmup", "-1"], "--warmup must be at least 0"),
    (["--seq-len", "999"], "exceeds the 256-token context"),
    (["--timeout", "nan"], "--timeout must be a positive number of seconds"),
    (["--out", "a_file"], "--out a_file is a file"),
    (["--backend", "nccl", "--device", "cpu"], "--backend nccl moves CUDA tensors only"),
]

PLAN_CHECK = [
    (["--model", "gpt9"], "--model: unknown model 'gpt9'"),
    (["--params", "1e9"], "--check runs a model: give --model"),
    (["--model", "tiny", "--devices", "0"], "--devices must be at least 1"),
    (["--model", "tiny", "--batch", "0"], "--batch must be at least 1"),
    (["--model", "tiny", "--seq", "999"], "--seq 999 exceeds the 128-token context"),
    (["--model", "tiny", "--check-steps", "0"], "--check-steps must be at least 1"),
    (["--model", "tiny", "--strategy", "hybrid_shard"], "has no default shard group size"),
    (
        ["--model", "tiny", "--strategy", "hybrid_shard", "--devices", "4", "--hybrid-group", "3"],
        "(got 3)",
    ),
    pytest.param(
        ["--model", "tiny", "--check-device", "cuda"], "--check-device cuda", marks=NO_CUDA
    ),
]


def _cases(command: str, prefix: list[str], table: list) -> list:
    out = []
    for case in table:
        argv, message = case.values if hasattr(case, "values") else case
        marks = case.marks if hasattr(case, "marks") else ()
        out.append(pytest.param(command, [*prefix, *argv], message, marks=marks, id=" ".join(argv)))
    return out


@pytest.mark.parametrize(
    ("command", "argv", "message"),
    _cases("train", ["train"], TRAIN)
    + _cases("trace", ["trace"], TRACE)
    + _cases("bench", ["bench"], BENCH)
    + _cases("plan", ["plan", "--check", "--devices", "2"], PLAN_CHECK),
)
def test_bad_input_is_one_message_and_status_2(
    command: str, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    _one_error(command, captured.err, captured.out, message)


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--strategy", "zero3"],
        ["train", "--nproc", "two"],
        ["trace", "--device", "tpu"],
        ["bench", "--backend", "mpi"],
        ["plan", "--check", "--devices", "2", "--model", "tiny", "--strategy", "zero3"],
    ],
)
def test_malformed_flags_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert [line for line in err.splitlines() if ": error: " in line]  # argparse's one line


ENTRY_CASES = [
    ("train", ["train", "--data", "empty.txt"], "the file is empty"),
    ("train", ["train", "--resume", "latest", "--name", "exp"], "no committed checkpoint"),
    ("trace", ["trace", "--model", "gpt9"], "unknown model 'gpt9'"),
    ("bench", ["bench", "--variants", "zero3"], "unknown bench variant"),
    ("plan", ["plan", "--check", "--devices", "2", "--model", "gpt9"], "unknown model"),
    ("prepare", ["prepare", "empties", "--out", "o"], "no text to prepare"),
    ("prepare", ["prepare", "binaries", "--out", "o"], "the folder holds no input files"),
]
# As a user runs them (a fresh interpreter, the console module): a command that does not launch
# ranks here; one that does is test_corrupted_checkpoint_found_on_the_ranks_is_one_message's
# (``fullshard train``, its one message and status 2 from a fresh interpreter). Every case again
# in this process below (each fresh interpreter costs seconds of a suite that must stay short).
CONSOLE_CASES = [ENTRY_CASES[5]]


@pytest.mark.parametrize(("command", "argv", "message"), CONSOLE_CASES)
def test_console_entry(command: str, argv: list[str], message: str, workdir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "fullshard.app.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=workdir,
        check=False,
    )
    assert proc.returncode == 2
    _one_error(command, proc.stderr, proc.stdout, message)


@pytest.mark.parametrize(("command", "argv", "message"), ENTRY_CASES)
def test_entry_in_process(
    command: str,
    argv: list[str],
    message: str,
    workdir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(workdir)
    assert main(argv) == 2
    captured = capsys.readouterr()
    _one_error(command, captured.err, captured.out, message)


# ----------------------------------------------------------------------------------------------
# good input passes, and the checks agree with what the ranks do


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_defaults_pass(workdir: Path) -> None:
    validate_train(TrainConfig(), 2)  # the demo, on the built-in corpus
    validate_train(TrainConfig.of(data="short.txt", seq_len=16, batch_size=4), 2)
    validate_trace(_parse("trace"), 2)
    assert validate_bench(_parse("bench")) == [
        *["full_shard", "shard_grad_op", "no_shard", "fsdp2", "ddp"],
        "single",
    ]
    validate_plan_check(_parse("plan", "--check", "--devices", "2", "--model", "tiny"))


@pytest.mark.parametrize(
    ("world", "extra"),
    [
        (2, {"cpu_offload": True}),
        (2, {"reshard_after_forward": "false"}),
        (2, {"reshard_after_forward": "TRUE", "strategy": "shard_grad_op"}),
        (4, {"reshard_after_forward": "2", "cpu_offload": True, "mixed_precision": "bf16"}),
        (2, {"reshard_after_forward": "1", "strategy": "no_shard", "cpu_offload": True}),
        (8, {"reshard_after_forward": "2", "strategy": "hybrid_shard", "shard_size": 4}),
        (4, {"reshard_after_forward": "2", "tp": 2, "cpu_offload": True}),  # 2 = the group: true
    ],
)
def test_sharding_options_pass(workdir: Path, world: int, extra: dict) -> None:
    validate_train(TrainConfig.of(**extra), world)


def test_float8_cannot_reshard_to_a_smaller_group(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fullshard.app.models.wrap as wrap

    monkeypatch.setattr(wrap, "float8_missing", lambda: "")  # as if torchao were installed
    cfg = TrainConfig.of(float8=True, reshard_after_forward="2")
    with pytest.raises(ValueError, match="--reshard-after-forward 2 with --float8: float8 weights"):
        validate_train(cfg, 4)
    validate_train(TrainConfig.of(float8=True, reshard_after_forward="4", cpu_offload=True), 4)


def test_resume_latest_passes_with_a_committed_checkpoint(workdir: Path) -> None:
    step = workdir / "runs" / "exp" / "checkpoints" / "step_00000006"
    step.mkdir()
    cfg = TrainConfig.of(resume="latest", name="exp")
    (step / "manifest.json").write_text('{"files": {}}')
    validate_train(cfg, 2)
    validate_train(TrainConfig.of(resume=str(step)), 2)  # a checkpoint folder itself
    validate_train(TrainConfig.of(resume=str(step.parent)), 2)  # a folder of them


@pytest.mark.parametrize(
    ("world", "seq_len", "batch"), [(1, 16, 2), (3, 8, 3), (2, 256, 16), (4, 128, 64)]
)
def test_data_check_agrees_with_the_ranks(
    workdir: Path, world: int, seq_len: int, batch: int
) -> None:
    """At the shortest corpus validation accepts, every rank gets a batch; one byte less, not.

    Half the text is held out (the larger cases span several 4096-token validation blocks).
    """
    micro = batch // world

    def accepted(n: int) -> bool:
        (workdir / "corpus.txt").write_bytes(b"a" * n)
        cfg = TrainConfig.of(data="corpus.txt", seq_len=seq_len, batch_size=batch, val_fraction=0.5)
        try:
            validate_train(cfg, world)
        except ValueError as exc:
            assert "too few for one training batch" in str(exc)
            return False
        return True

    lo, hi = 1, 200_000  # accepted(n) is monotone in n: the shortest accepted n by bisection
    assert accepted(hi) and not accepted(lo)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if accepted(mid) else (mid, hi)
    n = hi
    for size, ok in ((n, True), (n - 1, False)):
        tokens = torch.zeros(size, dtype=torch.uint8)
        for rank in range(world):
            train, _ = split_for_rank(tokens, rank, world, 0.5)
            if ok:
                RankBatches(train, seq_len, micro, seed=0, rank=rank)
            else:
                with pytest.raises(ValueError, match="fewer than one batch"):
                    RankBatches(train, seq_len, micro, seed=0, rank=rank)


# ----------------------------------------------------------------------------------------------
# damaged checkpoints and the planner's numbers


def _fake_checkpoint(workdir: Path) -> Path:
    """A committed checkpoint of run ``exp`` on paper: DCP-named files and their manifest."""
    from fullshard.checkpoint.store import write_manifest

    step = workdir / "runs" / "exp" / "checkpoints" / "step_00000004"
    step.mkdir()
    (step / ".metadata").write_bytes(b"m" * 64)
    for rank in range(2):
        (step / f"__{rank}_0.distcp").write_bytes(bytes([rank]) * 256)
    write_manifest(str(step), {"step": 4})
    (workdir / "runs" / "exp" / "config.toml").write_text("# the run's own\n")
    return step


def _truncate(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("manifest", "manifest.json cannot be read as JSON"),
        ("shard", "__1_0.distcp has 200 bytes, the manifest says 256 (truncated?)"),
        ("missing", "__0_0.distcp is missing"),
        ("table", "manifest.json has no valid table of files"),
    ],
)
def test_damaged_checkpoint_is_refused_before_launch(
    workdir: Path, damage: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    step = _fake_checkpoint(workdir)
    if damage == "manifest":
        _truncate(step / "manifest.json", 40)
    elif damage == "shard":
        _truncate(step / "__1_0.distcp", 200)
    elif damage == "missing":
        (step / "__0_0.distcp").unlink()
    else:
        (step / "manifest.json").write_text('{"files": {"__0_0.distcp": 256}}')
    before = {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()}
    for argv in (["--resume", "latest", "--name", "exp"], ["--resume", str(step)]):
        assert main(["train", *argv]) == 2
        captured = capsys.readouterr()
        _one_error("train", captured.err, captured.out, message)
        assert f"--resume {argv[1]}: checkpoint " in captured.err
    # convert names the same file
    assert main(["convert", str(step), "out.safetensors"]) == 2
    captured = capsys.readouterr()
    _one_error("convert", captured.err, captured.out, message)
    # nothing was written, deleted or changed (the run's config.toml included)
    assert {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()} == before


def test_an_intact_fake_checkpoint_passes_the_pre_launch_check(workdir: Path) -> None:
    # the check that fails above is the manifest and the sizes, not anything else of the fake
    _fake_checkpoint(workdir)
    validate_train(TrainConfig.of(resume="latest", name="exp"), 2)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--params", "inf"], "--params inf is not a parameter count"),
        (["--params", "nan"], "--params nan is not a parameter count"),
        (["--params", "-5"], "--params -5.0 is not a parameter count"),
        (["--params", "1e9", "--device-memory", "-80"], "--device-memory -80.0 is not a memory"),
        (["--params", "1e9", "--device-memory", "inf"], "--device-memory inf is not a memory"),
        (["--params", "1e9", "--reserve", "1.5"], "--reserve 1.5 is not a fraction"),
        (["--params", "1e9", "--reserve", "nan"], "--reserve nan is not a fraction"),
        (["--params", "1e9", "--layers", "0"], "--layers must be at least 1"),
        (["--model", "tiny", "--seq", "0"], "--seq must be at least 1"),
    ],
)
def test_plan_numbers(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--devices", "8", *argv]) == 2
    captured = capsys.readouterr()
    _one_error("plan", captured.err, captured.out, message)


@pytest.mark.e2e
def test_corrupted_checkpoint_found_on_the_ranks_is_one_message(workdir: Path) -> None:
    """A bit flipped in ``.metadata`` keeps its size: the launcher's check (the manifest and the
    sizes) passes it, the ranks' hashes find it. One message from the launcher, status 2, no
    torchrun traceback, the run's config.toml as it was.

    The checkpoint is ``_fake_checkpoint``'s, with a manifest of its files' true sizes and
    hashes: the ranks hash every file before DCP reads a byte, so what the files hold is not
    read (a real run's checkpoint would cost a launch more)."""
    step = _fake_checkpoint(workdir)
    meta = step / ".metadata"
    data = bytearray(meta.read_bytes())
    data[len(data) // 2] ^= 0xFF
    meta.write_bytes(bytes(data))
    validate_train(TrainConfig.of(resume="latest", name="exp", runs_dir=str(workdir / "runs")), 2)
    run = workdir / "runs" / "exp"
    config = (run / "config.toml").read_bytes()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [
            sys.executable,
            *["-m", "fullshard.app.cli", "train", "--model", "tiny", "--seq-len", "32"],
            *["--batch-size", "4", "--eval-every", "0", "--sample-tokens", "0", "--no-progress"],
            *["--runs-dir"],
            str(workdir / "runs"),
            *["--name", "exp", "--timeout", "60", "--max-steps", "6"],
            *["--resume", "latest"],
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    _one_error("train", proc.stderr, proc.stdout, ".metadata does not match its SHA-256")
    assert "--resume latest: cannot load checkpoint" in proc.stderr
    assert (run / "config.toml").read_bytes() == config
    assert sorted(os.listdir(run / "checkpoints")) == ["step_00000004"]
