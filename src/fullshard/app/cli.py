"""The ``fullshard`` command: a thin argparse front end; each subcommand calls into a module.

Every command that launches ranks (``train``, ``trace``, ``bench``, ``plan --check``) first runs
its one validation function (:mod:`fullshard.app.commands.validate`): a bad input gives one clear message
and status 2 before any rank starts, not a traceback per rank. ``fullshard train`` outside
torchrun then re-launches itself on ``--nproc`` local ranks; under torchrun (launched by us or by
an external ``torchrun --nnodes ...``) it trains.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from fullshard.app.config import add_train_arguments, config_from_args, from_env, to_env
from fullshard.app.errors import ConfigError, RunStopped
from fullshard.policies import FullshardError

__all__ = ["build_parser", "main"]

# the subcommands build_parser defines (main fills in only the one it runs)
COMMANDS = ("train", "convert", "prepare", "plan", "trace", "bench")

TRAIN_EPILOG = """\
examples:
  fullshard train                                  # the demo: 2 CPU ranks, 'demo' model, Python docs
  fullshard train --nproc 4 --model small --strategy shard_grad_op
  fullshard train --config run.toml --max-steps 100 # flags override the TOML file
  torchrun --nnodes 2 --nproc-per-node 8 ... -m fullshard.app.cli train --model 1b

Each run writes runs/<name>/: config.toml (resolved), metrics.jsonl, loss.png, sample.txt and
summary.json.
"""


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``fullshard`` argument parser with its subcommands.

    ``only``: fill in the arguments of that subcommand alone (the others keep their name and
    help line). The argument definitions of prepare, plan, trace and bench live in modules that
    import the engine, DTensor and torch.distributed.checkpoint (seconds); ``main`` parses one
    known command, so ``fullshard train`` (the launcher) need not import them.
    """

    def fill(name: str) -> bool:
        return only is None or only == name

    parser = argparse.ArgumentParser(
        prog="fullshard",
        description="Fully sharded data parallel training for PyTorch.",
        allow_abbrev=False,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = sub.add_parser(
        "train",
        help="train a decoder-only language model on N ranks",
        description="Train a decoder-only transformer LM with fullshard on N ranks.",
        epilog=TRAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    if fill("train"):
        add_train_arguments(train)
    convert = sub.add_parser(
        "convert",
        help="sharded checkpoint -> one safetensors file (offline, no process group)",
        description="Write the model weights of a sharded fullshard/DCP checkpoint as one "
        "safetensors file with the original parameter names. Runs in one process; the "
        "checkpoint is verified against its manifest first.",
        allow_abbrev=False,
    )
    if fill("convert"):
        convert.add_argument(
            "checkpoint",
            help="a checkpoint folder (step_N) or a folder of them (takes the newest)",
        )
        convert.add_argument(
            "out", help="output .safetensors file, or a folder for model.safetensors"
        )
        convert.add_argument(
            "--key",
            default="model",
            help="state-dict section holding the weights (default: model)",
        )
    _add_prepare_parser(sub, fill("prepare"))
    _add_plan_parser(sub, fill("plan"))
    trace = sub.add_parser(
        "trace",
        help="record a few training steps per rank: timeline (JSON + PNG), exposed communication",
        description="Train a built-in model for a few steps on N local ranks and record, per rank, "
        "every gather / compute / free / reduce-scatter / optimizer step. Writes a "
        "Chrome/Perfetto trace (trace.json), a PNG with ranks as rows (trace.png) and a summary "
        "with the exposed (non-overlapped) communication time.",
        allow_abbrev=False,
    )
    if fill("trace"):
        from fullshard.app.commands.trace import add_trace_arguments

        add_trace_arguments(trace)
    bench = sub.add_parser(
        "bench",
        help="step time, tokens/s, memory and communication: fullshard strategies vs FSDP2, DDP",
        description="Benchmark the same model, data and ranks under each fullshard strategy, "
        "torch FSDP2, torch DDP and a single process: step time (median of alternating rounds), "
        "tokens/s, peak memory per rank, communication per step in model units, exposed "
        "communication. Writes bench.json, bench.md and bench.png.",
        allow_abbrev=False,
    )
    if fill("bench"):
        from fullshard.app.commands.bench import add_bench_arguments

        add_bench_arguments(bench)
    return parser


PREPARE_EPILOG = """\
examples:
  fullshard prepare corpus/ --out data/corpus-byte           # byte tokens (UTF-8 bytes)
  fullshard prepare shards/*.jsonl --out data/c --tokenizer tok/ --workers 8
  fullshard train --data data/corpus-byte                    # trains from the memory-mapped shards
  fullshard prepare --verify data/corpus-byte                # re-hash every shard

Re-running with the same inputs and options does nothing. The folder is complete once its
index.json exists (written last).
"""


def _add_prepare_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], fill: bool = True
) -> None:
    prepare = sub.add_parser(
        "prepare",
        help="tokenize a corpus once, in parallel, into token shards that train memory-maps",
        description="Read text files, folders, JSONL, Parquet or Arrow files, tokenize them in "
        "parallel worker processes and stream the tokens to shard files with an index, split "
        "into train and validation as fullshard train splits text. Train on the result with "
        "fullshard train --data DIR.",
        epilog=PREPARE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    if fill:
        from fullshard.app.data.prepare import add_prepare_arguments

        add_prepare_arguments(prepare)


def _prepare(args: argparse.Namespace) -> int:
    from fullshard.app.data.prepare import run_prepare

    return run_prepare(args)


def _add_plan_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], fill: bool = True
) -> None:
    description = (
        "Predict per-device memory (the ZeRO ladder, gathered window, activations, "
        "peak per phase) and communication per step, from a parameter count (analytic mode) or "
        "a model definition built on the meta device (model mode), and recommend a strategy."
    )
    help_line = "per-device memory and communication of a sharded run, before you buy hardware"
    if not fill:  # name and help line only (see build_parser): plan_cli imports the planner
        sub.add_parser("plan", help=help_line, description=description, allow_abbrev=False)
        return
    from fullshard.app.commands.plan import PLAN_EPILOG, add_plan_arguments
    from fullshard.app.commands.plan_check import add_check_arguments

    plan = sub.add_parser(
        "plan",
        help=help_line,
        description=description,
        epilog=PLAN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    add_plan_arguments(plan)
    add_check_arguments(plan)


def _convert(args: argparse.Namespace) -> int:
    import os
    import tempfile

    from safetensors import SafetensorError

    from fullshard.checkpoint import convert, latest_checkpoint, verify
    from fullshard.checkpoint.store import MANIFEST

    # The output is checked before the checkpoint is read (hashing a large one takes minutes),
    # with convert's own rule: a .safetensors path is the file, anything else a folder for it.
    out = (
        args.out
        if args.out.endswith(".safetensors")
        else os.path.join(args.out, "model.safetensors")
    )
    above = os.path.dirname(os.path.abspath(out))
    while not os.path.exists(above):
        above = os.path.dirname(above)  # the nearest existing folder: the rest is created
    if not os.path.isdir(above):
        raise ConfigError(
            f"output {args.out}: {above} is a file, not a folder: give a .safetensors file "
            "name in a folder, or a folder (created if missing)"
        )
    try:
        with open(out, "rb") as f:
            head = f.read(9)
    except OSError:  # none (the usual case), a folder, unreadable
        head = b""
    # a safetensors file starts with its header's length (8 bytes) and then a JSON object: only
    # such a file (an earlier convert's) is replaced
    if os.path.lexists(out) and not (len(head) == 9 and head[8:] == b"{"):
        raise ConfigError(
            f"output {args.out}: {out} exists and is not a safetensors file (it is left as it "
            "is): give a new file name, or a folder"
        )
    try:  # a folder we may not write (permissions, a read-only or special file system)
        tempfile.TemporaryFile(dir=above).close()
    except OSError as exc:
        raise ConfigError(
            f"output {args.out}: cannot create a file in {above} ({exc.strerror}): give a "
            "folder you can write"
        ) from None
    folder = args.checkpoint
    if not os.path.isfile(os.path.join(folder, MANIFEST)):
        folder = latest_checkpoint(folder)
        if folder is None:
            raise ConfigError(f"{args.checkpoint} holds no committed checkpoint")
    problem = verify(folder)
    if problem:
        raise ConfigError(f"checkpoint {folder} failed verification: {problem}")
    try:
        path = convert(folder, args.out, key=args.key)
    except (OSError, SafetensorError) as exc:  # the disk filled up, the folder went away, ...
        raise ConfigError(f"converting {folder} to {out} failed ({exc})") from None
    print(f"wrote {path} from {folder}")
    return 0


def _validated_by_launcher() -> bool:
    """True on a rank that ``launch_local`` started: its arguments were validated before launch
    (one validation pass per launch), so the rank does not validate them again."""
    from fullshard.app.dims import under_torchrun
    from fullshard.app.errors import VALIDATED_ENV

    return under_torchrun() and os.environ.get(VALIDATED_ENV) == "1"


def _train(args: argparse.Namespace, argv: list[str]) -> int:
    from fullshard.app.dims import ParallelDims, under_torchrun
    from fullshard.app.launch.local import launch_local

    # a rank our launcher started gets the config it validated (an external torchrun's parse)
    cfg = from_env(os.environ) if under_torchrun() else None
    launched = cfg is not None
    cfg = cfg or config_from_args(args)
    # the run's parallel dimensions, built once: validation, the launch and the trainer share it
    dims = ParallelDims.from_env(
        cfg.nproc, tp=cfg.tp, strategy=cfg.strategy, shard_size=cfg.shard_size
    )
    if not launched:
        from fullshard.app.commands.validate import validate_train

        validate_train(cfg, dims)
    if not under_torchrun():
        if cfg.name is None:  # named here, so that restarted ranks find the same run folder
            cfg.name = time.strftime("%Y%m%d-%H%M%S")
        # the ranks get the validated config itself (their argv is just the command: torchrun's
        # own parser would claim abbreviations such as "--nproc", a prefix of its
        # --nproc-per-node)
        from fullshard.app.errors import RESUME_ENV, resume_command

        env = {**os.environ, **to_env(cfg), RESUME_ENV: resume_command(argv, cfg.name)}
        if cfg.elastic:
            from fullshard.app.launch.elastic import launch_elastic

            return launch_elastic(cfg.nproc, ["train"], max_replacements=cfg.max_replacements,
                                  env=env)  # fmt: skip
        return launch_local(cfg.nproc, ["train"], max_restarts=cfg.max_restarts, env=env)
    from fullshard.app.launch.preempt import PREEMPTED_EXIT

    if cfg.elastic:
        from fullshard.app.train.elastic import train_elastic as train
    else:
        from fullshard.app.train.trainer import train
    summary = train(cfg, dims)
    # a stop signal (NOTE [Preemption]): checkpointed, unfinished, to be resumed
    return PREEMPTED_EXIT if summary.get("preempted_after") is not None else 0


def _plan(args: argparse.Namespace) -> int:
    from fullshard.app.commands.plan import add_plan_arguments, run
    from fullshard.app.launch.local import forward_flags, launch_local, under_torchrun

    if args.calibrate:  # measure this machine (fullshard.app.commands.plan_calibrate)
        from fullshard.app.commands.plan_calibrate import run_calibrate

        return run_calibrate(args)
    if args.check:
        from fullshard.app.commands.plan_check import (
            add_check_arguments,
            check_json,
            check_rank,
            format_check,
        )
        from fullshard.app.commands.validate import validate_plan_check

        if not _validated_by_launcher():
            validate_plan_check(args)
        if not under_torchrun():
            parser = argparse.ArgumentParser(allow_abbrev=False)
            add_plan_arguments(parser)
            add_check_arguments(parser)
            return launch_local(args.devices, ["plan", *forward_flags(parser, args)])
        res = check_rank(args)
        if os.environ["RANK"] == "0":
            print(check_json(res) if args.json else format_check(res), flush=True)
        return 0
    from fullshard.app.commands.validate import validate_plan

    validate_plan(args)
    try:
        print(run(args))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return 0


def _trace(args: argparse.Namespace) -> int:
    from fullshard.app.commands.trace import add_trace_arguments, run_trace
    from fullshard.app.dims import ParallelDims
    from fullshard.app.launch.local import forward_flags, launch_local, under_torchrun

    if not _validated_by_launcher():
        from fullshard.app.commands.validate import validate_trace

        dims = ParallelDims.from_env(args.nproc, strategy=args.strategy, shard_size=args.shard_size)
        validate_trace(args, dims)
    if not under_torchrun():
        # Full-name flags without --nproc, which torchrun's parser would claim (see forward_flags)
        parser = argparse.ArgumentParser(allow_abbrev=False)
        add_trace_arguments(parser)
        return launch_local(args.nproc, ["trace", *forward_flags(parser, args, exclude=("nproc",))])
    run_trace(args)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from fullshard.app.commands.bench import main_bench, run_bench_rank
    from fullshard.app.launch.local import under_torchrun

    if under_torchrun():  # one of the launches main_bench makes, with options it checked
        return run_bench_rank(args)
    from fullshard.app.commands.validate import validate_bench

    validate_bench(args)
    return main_bench(args)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fullshard`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # Only the named command's arguments: the top parser has no options but -h, so argv[0] is
    # the command when it names one; anything else (--help, a typo) gets the whole parser.
    parser = build_parser(only=argv[0] if argv and argv[0] in COMMANDS else None)
    args = parser.parse_args(argv)
    try:
        if args.command == "train":
            return _train(args, argv)
        if args.command == "convert":
            return _convert(args)
        if args.command == "prepare":
            return _prepare(args)
        if args.command == "plan":
            return _plan(args)
        if args.command == "trace":
            return _trace(args)
        if args.command == "bench":
            return _bench(args)
    except RunStopped as exc:  # an expected ending: one message for the job, its status
        from fullshard.app.dims import under_torchrun
        from fullshard.app.errors import report_error, say_once

        if not (under_torchrun() and report_error(str(exc), exc.status)):
            say_once(f"fullshard {args.command}: {exc}", "stopped")
        return exc.status
    except ConfigError as exc:
        # NOTE [Input errors on the ranks]: a rank our launcher started hands the message to it
        from fullshard.app.dims import under_torchrun
        from fullshard.app.errors import RANK_INPUT_EXIT, report_error

        if under_torchrun() and report_error(str(exc)):
            return RANK_INPUT_EXIT
        # One line on stderr and status 2 (argparse's convention for usage errors).
        print(f"fullshard {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except FullshardError as exc:
        print(f"fullshard {args.command}: error: {exc}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
