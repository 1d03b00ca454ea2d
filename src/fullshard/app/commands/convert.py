"""``fullshard convert``: a sharded checkpoint's weights as one safetensors file, offline.

One process, no process group: the checkpoint is verified against its manifest first, then
read whole (``fullshard.checkpoint.convert``). The output is checked before the checkpoint is
read, since hashing a large one takes minutes.
"""

from __future__ import annotations

import argparse
import os
import tempfile

from fullshard.app.errors import ConfigError

__all__ = ["DESCRIPTION", "EPILOG", "HELP", "add_arguments", "run", "validate"]

HELP = "sharded checkpoint -> one safetensors file (offline, no process group)"
DESCRIPTION = (
    "Write the model weights of a sharded fullshard/DCP checkpoint as one safetensors file with "
    "the original parameter names. Runs in one process; the checkpoint is verified against its "
    "manifest first."
)
EPILOG = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The checkpoint, the output and the state dict's section."""
    parser.add_argument(
        "checkpoint", help="a checkpoint folder (step_N) or a folder of them (takes the newest)"
    )
    parser.add_argument("out", help="output .safetensors file, or a folder for model.safetensors")
    parser.add_argument(
        "--key", default="model", help="state-dict section holding the weights (default: model)"
    )


def validate(args: argparse.Namespace) -> str:
    """The output can be written, with convert's own rule (a ``.safetensors`` path is the file,
    anything else a folder for it), and no other file is in its place; returns the file's path."""
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
    return out


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Validate the output, verify the checkpoint, write the file."""
    from safetensors import SafetensorError

    from fullshard.checkpoint import convert, latest_checkpoint, verify
    from fullshard.checkpoint.store import MANIFEST

    out = validate(args)
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
