"""TrainConfig: TOML + flag precedence, the resolved TOML, validation messages, --help."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from fullshard.app.cli import build_parser
from fullshard.app.commands.train import validate
from fullshard.app.config import (
    OPTIONS,
    ConfigError,
    TrainConfig,
    config_from_args,
    from_env,
    load_toml,
    reshard_after_forward_arg,
    to_env,
    to_toml,
)
from fullshard.app.dims import ParallelDims


def resolve(argv: list[str]) -> TrainConfig:
    return config_from_args(build_parser().parse_args(["train", *argv]))


def test_defaults_are_the_demo() -> None:
    cfg = resolve([])
    assert cfg == TrainConfig()
    assert (cfg.model.name, cfg.launch.nproc, cfg.data.path) == ("demo", 2, None)
    assert cfg.parallelism.strategy == "full_shard"
    validate(cfg, 2)


def test_toml_then_flags_precedence(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[model]\nname = "tiny"\n[optimizer]\nlr = 1\n[training]\nmax-steps = 50\n')
    cfg = resolve(["--config", str(path), "--max-steps", "7", "--no-progress"])
    assert cfg.model.name == "tiny"  # from the file
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)  # TOML's int
    assert cfg.training.max_steps == 7  # the flag wins over the file
    assert cfg.output.progress is False
    assert cfg.data.seq_len == TrainConfig().data.seq_len  # untouched default


def test_flat_keys_of_older_files_still_read_each_to_its_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """NOTE [Flat config keys]: a file written before the sections (options by their flag
    names, at the top level or under [train]) gives the same config as the sectioned one, and
    says once which tables to write them in."""
    flat = tmp_path / "flat.toml"
    flat.write_text('model = "tiny"\nlr = 1\nmax-steps = 50\ncheckpoint_dir = "ck"\n')
    sectioned = tmp_path / "sectioned.toml"
    sectioned.write_text(
        '[model]\nname = "tiny"\n[optimizer]\nlr = 1.0\n[training]\nmax_steps = 50\n'
        '[checkpoint]\ndir = "ck"\n'
    )
    cfg = resolve(["--config", str(flat)])
    assert cfg == resolve(["--config", str(sectioned)])
    assert (cfg.model.name, cfg.training.max_steps, cfg.checkpoint.dir) == ("tiny", 50, "ck")
    said = capsys.readouterr().err
    assert f"{flat}: options outside a section (model, lr, max_steps, checkpoint_dir) are " in said
    for line in ("[model]", 'name = "tiny"', "[optimizer]", "lr = 1.0", "max_steps = 50"):
        assert line in said.splitlines(), line
    resolve(["--config", str(flat)])
    assert capsys.readouterr().err == ""  # once per file
    table = tmp_path / "table.toml"
    table.write_text('[train]\nstrategy = "shard_grad_op"\n')
    assert resolve(["--config", str(table)]).parallelism.strategy == "shard_grad_op"
    both = tmp_path / "both.toml"
    both.write_text("lr = 1.0\n[optimizer]\nlr = 2.0\n")
    with pytest.raises(ConfigError, match="sets lr twice"):
        resolve(["--config", str(both)])


def test_resolved_toml_round_trips(tmp_path: Path) -> None:
    cfg = TrainConfig.of(model="tiny", prompt='say "hi"\n', name=None, lr=2e-4, progress=False)
    path = tmp_path / "config.toml"
    path.write_text(to_toml(cfg))
    values = load_toml(str(path))
    assert "name" not in values  # None is written as a comment
    args = argparse.Namespace(config=str(path))
    assert config_from_args(args) == cfg


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('modle = "tiny"', "unknown option 'modle' in .*did you mean 'model'"),
        ('[model]\nnmae = "tiny"', r"unknown option 'nmae' in \[model\] .*did you mean 'name'"),
        ("[training]\nlr = 0.1", r"unknown option 'lr' in \[training\]"),
        ('[optimizer]\nlr = "fast"', "'lr' .* must be float"),
        ('max_steps = "ten"', "'max_steps' .* must be int"),
        ("progress = 1", "'progress' .* must be bool"),
        ('strategy = "zero3"', "must be one of full_shard, shard_grad_op"),
        ('backend = "mpi"', "'backend' .* must be one of auto, nccl, gloo"),
        ("reshard_after_forward = 1.5", "'reshard_after_forward' .* must be str"),
        ("model = ", "not valid TOML"),
    ],
)
def test_bad_toml_values_name_the_key(tmp_path: Path, toml: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(toml + "\n")
    with pytest.raises(ConfigError, match=message):
        resolve(["--config", str(path)])


def test_missing_config_file() -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        resolve(["--config", "/nonexistent/run.toml"])


@pytest.mark.parametrize(
    ("cfg", "world", "message"),
    [
        (
            TrainConfig.of(data="/no/such/file.txt"),
            2,
            "data path '/no/such/file.txt' does not exist",
        ),
        (TrainConfig.of(model="gpt5"), 2, "unknown model 'gpt5'.*tiny, demo, small"),
        (TrainConfig.of(batch_size=16), 3, "not divisible by world size 3.*--batch-size 15 or 18"),
        (TrainConfig.of(batch_size=8, grad_accum=3), 2, "x --grad-accum 3 = 6"),
        (TrainConfig.of(model="tiny", seq_len=4096), 2, "exceeds the 128-token context of model"),
        (TrainConfig.of(tokenizer="/no/tokenizer"), 2, "neither 'byte' nor a local"),
        (TrainConfig.of(max_steps=0), 2, "--max-steps must be at least 1"),
        (TrainConfig.of(val_fraction=1.0), 2, "--val-fraction"),
        (TrainConfig.of(model="hf:gpt7-giant"), 2, "gpt7-giant"),
        (TrainConfig.of(device="cpu", backend="nccl"), 2, "--backend nccl moves CUDA tensors only"),
        # --deterministic: 16 in micro-batches of 2 is 8, which runs on 1, 2, 4 or 8 ranks
        (
            TrainConfig.of(deterministic=True, micro_batch_size=2),
            3,
            "on 3 ranks.* is 8, which give the same bits on 1, 2, 4, 8 ranks",
        ),
        (
            TrainConfig.of(deterministic=True, batch_size=24, micro_batch_size=4),
            4,
            "is 6, which give the same bits on 1, 2 ranks.*a multiple of 4",
        ),
        (TrainConfig.of(deterministic=True, micro_batch_size=3), 2, "does not divide --batch-size"),
        (TrainConfig.of(deterministic=True, grad_accum=2), 2, "drop --grad-accum"),
        (TrainConfig.of(deterministic=True, tp=2), 4, "--deterministic with --tp"),
        (TrainConfig.of(deterministic=True, mixed_precision="fp16"), 2, "fp16 is not supported"),
    ],
)
def test_validation_messages(cfg: TrainConfig, world: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(cfg, world)


def test_help_documents_every_option() -> None:
    train = build_parser()._subparsers._group_actions[0].choices["train"]  # type: ignore[union-attr]
    text = train.format_help()
    for option in OPTIONS:
        assert "--" + option.replace("_", "-") in text, option
    assert "--config" in text and "metrics.jsonl" in text
    for section in [f.name for f in fields(TrainConfig)]:
        assert f"\n{section}:\n  [{section}]: " in text, section  # a group per section


def test_backend_from_toml_and_flags(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('backend = "gloo"\ndevice = "cpu"\n')
    cfg = resolve(["--config", str(path)])
    assert (cfg.launch.backend, cfg.launch.device) == ("gloo", "cpu")
    assert resolve(["--config", str(path), "--backend", "auto"]).launch.backend == "auto"
    assert load_toml_text(to_toml(cfg), tmp_path)["backend"] == "gloo"  # the run's config.toml
    validate(cfg, 2)


def load_toml_text(text: str, tmp_path: Path) -> dict:
    path = tmp_path / "resolved.toml"
    path.write_text(text)
    return load_toml(str(path))


def test_float8_without_torchao_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao", None)  # as if not installed (it is, in dev)
    with pytest.raises(ConfigError, match=r"pip install torchao .*fullshard\[float8\]"):
        validate(TrainConfig.of(float8=True), 2)


def test_sharding_options_from_flags_toml_and_back(tmp_path: Path) -> None:
    cfg = resolve(["--cpu-offload", "--reshard-after-forward", "2"])
    assert (cfg.parallelism.cpu_offload, cfg.parallelism.reshard_after_forward) == (True, "2")
    assert load_toml_text(to_toml(cfg), tmp_path)["reshard_after_forward"] == "2"
    # TOML's own booleans and integers read as the flag's words
    path = tmp_path / "run.toml"
    for toml, word in (("false", "false"), ("true", "true"), ("4", "4"), ('"TRUE"', "TRUE")):
        path.write_text(f"cpu_offload = true\nreshard_after_forward = {toml}\n")
        cfg = resolve(["--config", str(path)])
        assert (cfg.parallelism.cpu_offload, cfg.parallelism.reshard_after_forward) == (True, word)
    unset = TrainConfig()
    assert (unset.parallelism.cpu_offload, unset.parallelism.reshard_after_forward) == (False, None)
    assert "# reshard_after_forward = (unset)" in to_toml(unset)


def test_the_parallelism_section_says_its_words_on_the_run_line() -> None:
    """The run line's words after the plan's summary come from the section (the trainer reads
    no option of it): tensor parallel, --reshard-after-forward, CPU offload, in that order."""
    assert TrainConfig().parallelism.describe() == ""
    p = resolve(["--tp", "2", "--reshard-after-forward", "false", "--cpu-offload"]).parallelism
    assert p.describe() == (
        ", tensor parallel over 2 ranks, --reshard-after-forward false for the blocks, CPU offload"
    )
    assert TrainConfig.of(cpu_offload=True).parallelism.describe() == ", CPU offload"


def test_launched_ranks_get_the_validated_config_itself() -> None:
    """The launcher hands its ranks the config it validated (no flags to parse again), every
    field as it was, floats to the bit."""
    cfg = resolve(["--cpu-offload", "--reshard-after-forward", "2", "--lr", "0.1", "--name=-x"])
    cfg.optimizer.lr = 0.1 + 2**-55  # the last bit of a float survives
    assert from_env(to_env(cfg)) == cfg and from_env({}) is None


@pytest.mark.parametrize(
    ("word", "value"),
    [(None, None), ("true", True), ("False", False), (" 1 ", 1), ("8", 8)],
)
def test_reshard_after_forward_words(word: str | None, value: bool | int | None) -> None:
    got = reshard_after_forward_arg(word)
    assert got == value and type(got) is type(value)  # 1 stays an int: fully_shard reads it


@pytest.mark.parametrize("word", ["maybe", "0", "-2", "2.5", "", "yes", "\u00b2"])
def test_reshard_after_forward_bad_words(word: str) -> None:
    with pytest.raises(ConfigError, match="is neither true, false nor a number of ranks"):
        reshard_after_forward_arg(word)


def _subparser(name: str) -> argparse.ArgumentParser:
    return build_parser()._subparsers._group_actions[0].choices[name]  # type: ignore[union-attr]


def _action(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    return parser._option_string_actions[flag]


@pytest.mark.parametrize(
    "flag",
    [
        *["--model", "--strategy", "--shard-size", "--nproc", "--seq-len"],
        *["--device", "--backend", "--threads", "--mixed-precision"],
        "--timeout",
    ],
)
def test_trace_and_bench_share_train_option_definitions(flag: str) -> None:
    """One definition per option: the same type, choices and help text (the command's own
    default aside, and bench's narrower words where noted)."""
    train = _action(_subparser("train"), flag)
    for command in ("trace", "bench"):
        parser = _subparser(command)
        if flag not in parser._option_string_actions:
            continue
        other = _action(parser, flag)
        assert (other.type, other.choices) == (train.type, train.choices), command
        if not (command == "bench" and flag in ("--mixed-precision", "--timeout")):
            head = (train.help or "").split(" (default: ")[0]
            assert (other.help or "").startswith(head), (command, other.help)
    assert _subparser("trace").parse_args(["--backend", "gloo"]).backend == "gloo"
    assert _subparser("bench").parse_args([]).timeout == 900.0  # bench's own default


def test_shared_options_keep_their_checks() -> None:
    with pytest.raises(SystemExit):  # train's choices: an unknown strategy is a usage error
        _subparser("trace").parse_args(["--strategy", "zero3"])
    assert _subparser("trace").parse_args([]).model == "small"


@pytest.mark.parametrize(
    ("dims", "dp", "local_dp", "group", "shape"),
    [
        (ParallelDims(8, 8), 8, 8, 8, (8,)),
        (ParallelDims(8, 8, tp=2), 4, 4, 4, (4, 2)),
        (ParallelDims(8, 4, strategy="hybrid_shard"), 8, 4, 4, (2, 4)),
        (ParallelDims(8, 8, tp=2, strategy="hybrid_shard"), 4, 4, 2, (2, 2, 2)),
        (ParallelDims(4, 4, strategy="no_shard"), 4, 4, 1, (4, 1)),
        (ParallelDims(8, 8, strategy="hybrid_shard", shard_size=2), 8, 8, 2, (4, 2)),
    ],
)
def test_parallel_dims(
    dims: ParallelDims, dp: int, local_dp: int, group: int, shape: tuple[int, ...]
) -> None:
    assert (dims.dp, dims.local_dp, dims.shard_group(), dims.mesh_shape()) == (
        dp,
        local_dp,
        group,
        shape,
    )
    assert dims.dp_rank(dims.world - 1) == dp - 1


def test_parallel_dims_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert ParallelDims.from_env(4, tp=2) == ParallelDims(4, 4, 2)  # about to launch 4 here
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    dims = ParallelDims.from_env(4, tp=2, strategy="hybrid_shard")
    assert (dims.world, dims.local_world, dims.dp, dims.shard_group()) == (16, 8, 8, 4)
