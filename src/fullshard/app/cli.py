"""The ``fullshard`` command: the parser, built from the commands' own modules, and the dispatch.

Each command is one module of ``fullshard.app.commands`` (``train``, ``convert``, ``prepare``,
``plan``, ``trace``, ``bench``) holding its options (``add_arguments``), its validation and its
run (``run(args, argv)``: an exit status), and its help line, description and epilog. This
module builds the parser from them and turns the errors a command raises into one message and
an exit status.
"""

from __future__ import annotations

import argparse
import sys
from types import ModuleType

from fullshard.app.dims import under_torchrun
from fullshard.app.errors import ConfigError, RunStopped
from fullshard.policies import FullshardError

__all__ = ["COMMANDS", "build_parser", "main"]

COMMANDS = ("train", "convert", "prepare", "plan", "trace", "bench")


def command(name: str) -> ModuleType:
    """The module of command ``name``, imported when asked for: the ranks of ``fullshard
    train`` (and the launcher) need not import what plan, trace or bench import (the engine,
    DTensor, DCP: seconds)."""
    if name == "train":
        from fullshard.app.commands import train

        return train
    if name == "convert":
        from fullshard.app.commands import convert

        return convert
    if name == "prepare":
        from fullshard.app.commands import prepare

        return prepare
    if name == "plan":
        from fullshard.app.commands import plan

        return plan
    if name == "trace":
        from fullshard.app.commands import trace

        return trace
    if name == "bench":
        from fullshard.app.commands import bench

        return bench
    raise KeyError(f"no command {name!r}: one of {', '.join(COMMANDS)}")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``fullshard`` argument parser with its subcommands (``only``: that one alone)."""
    parser = argparse.ArgumentParser(
        prog="fullshard",
        description="Fully sharded data parallel training for PyTorch.",
        allow_abbrev=False,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS if only is None else (only,):
        module = command(name)
        parsed = sub.add_parser(
            name,
            help=module.HELP,
            description=module.DESCRIPTION,
            epilog=module.EPILOG,
            # an epilog of examples keeps its lines (the description is then one paragraph)
            formatter_class=argparse.RawDescriptionHelpFormatter
            if module.EPILOG
            else argparse.HelpFormatter,
            allow_abbrev=False,
        )
        module.add_arguments(parsed)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fullshard`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # Only the named command's parser: the top parser has no options but -h, so argv[0] is the
    # command when it names one; anything else (--help, a typo) gets the whole parser.
    parser = build_parser(only=argv[0] if argv and argv[0] in COMMANDS else None)
    args = parser.parse_args(argv)
    try:
        return int(command(args.command).run(args, argv))
    except RunStopped as exc:  # an expected ending: one message for the job, its status
        from fullshard.app.errors import report_error, say_once

        if not (under_torchrun() and report_error(str(exc), exc.status)):
            say_once(f"fullshard {args.command}: {exc}", "stopped")
        return exc.status
    except ConfigError as exc:
        # NOTE [Input errors on the ranks]: a rank our launcher started hands the message to it
        from fullshard.app.errors import RANK_INPUT_EXIT, report_error

        if under_torchrun() and report_error(str(exc)):
            return RANK_INPUT_EXIT
        # One line on stderr and status 2 (argparse's convention for usage errors).
        print(f"fullshard {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except FullshardError as exc:
        print(f"fullshard {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
