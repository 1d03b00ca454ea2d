"""``fullshard prepare``: its options, their validation, and its run.

The work is ``fullshard.app.data.prepare`` (tokenize once, in parallel, into token shards that
``fullshard train --data`` memory-maps; it checks its own options and output folder, as a
library function must); ``--verify DIR`` re-hashes a prepared folder instead.
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

from fullshard.app.errors import ConfigError

__all__ = ["DESCRIPTION", "EPILOG", "HELP", "add_arguments", "run", "validate"]

HELP = "tokenize a corpus once, in parallel, into token shards that train memory-maps"
DESCRIPTION = (
    "Read text files, folders, JSONL, Parquet or Arrow files, tokenize them in parallel worker "
    "processes and stream the tokens to shard files with an index, split into train and "
    "validation as fullshard train splits text. Train on the result with fullshard train --data "
    "DIR."
)
EPILOG = """\
examples:
  fullshard prepare corpus/ --out data/corpus-byte           # byte tokens (UTF-8 bytes)
  fullshard prepare shards/*.jsonl --out data/c --tokenizer tok/ --workers 8
  fullshard train --data data/corpus-byte                    # trains from the memory-mapped shards
  fullshard prepare --verify data/corpus-byte                # re-hash every shard

Re-running with the same inputs and options does nothing. The folder is complete once its
index.json exists (written last).
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``fullshard prepare``."""
    from fullshard.app.data.corpus import TEXT_SUFFIXES
    from fullshard.app.data.corpus_stream import DATA_SUFFIXES
    from fullshard.app.data.prepare import DEFAULT_SHARD_TOKENS

    parser.add_argument(
        "inputs",
        nargs="*",
        metavar="INPUT",
        help="text files (one document each), .jsonl (a 'text' field per line), .parquet / "
        ".arrow (a 'text' column; Hugging Face dataset files on disk), or folders of them "
        f"(recursively: {', '.join(TEXT_SUFFIXES + DATA_SUFFIXES)})",
    )
    parser.add_argument("--out", "-o", metavar="DIR", help="output folder (created if missing)")
    parser.add_argument(
        "--tokenizer",
        default="byte",
        help="'byte' (UTF-8 bytes) or a local Hugging Face tokenizer directory (default: byte)",
    )
    parser.add_argument(
        "--val-fraction",
        type=float,
        default=0.05,
        help="fraction held out for validation, in evenly spaced 4096-token blocks, as "
        "fullshard train splits text (default: 0.05)",
    )
    parser.add_argument(
        "--shard-tokens",
        type=int,
        default=DEFAULT_SHARD_TOKENS,
        help=f"tokens per shard file (default: {DEFAULT_SHARD_TOKENS}, 256 Mi)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=0,
        help="tokenizer worker processes for a --tokenizer directory (default 0: one per CPU; 1: "
        "in this process); byte tokens are encoded in this process (a copy: cheaper than a worker)",
    )
    parser.add_argument(
        "--verify",
        metavar="DIR",
        help="re-hash every shard of the prepared folder DIR against its index (and record "
        "their current mtimes, so start-ups trust them again), instead of preparing",
    )
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="show a progress bar on stderr (on a terminal)",
    )


def validate(args: argparse.Namespace) -> None:
    """``--verify DIR`` names a prepared folder and comes alone. (Preparing checks its options
    and its output folder itself: ``fullshard.app.data.prepare.prepare``.)"""
    if args.verify is None:
        return
    from fullshard.app.data.token_shards import INDEX

    if args.inputs or args.out:
        raise ConfigError("--verify DIR checks a prepared folder: give no inputs or --out")
    if not (Path(args.verify) / INDEX).is_file():
        raise ConfigError(f"--verify {args.verify}: no {INDEX}: not a prepared folder")


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Prepare the inputs, or verify a prepared folder."""
    from fullshard.app.data.prepare import PrepareOptions, prepare, verify

    validate(args)
    if args.verify is not None:
        print(verify(args.verify))
        return 0
    names = [f.name for f in fields(PrepareOptions) if hasattr(args, f.name)]
    prepare(PrepareOptions(**{name: getattr(args, name) for name in names}))
    return 0
