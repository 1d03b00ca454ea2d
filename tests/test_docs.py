"""The README and the docs/ pages: every link leads to a file and a heading that exist, and every
``fullshard`` command they show (in a code block, directly or under torchrun) parses with the
command line's own parser, so a renamed or removed option cannot leave a page behind.

Whether a command also *runs* as written is checked by running it (the examples of each page
were run when written); this is what stays checked on every ``make test``, in milliseconds.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from fullshard.app.cli import build_parser

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```(\w*)\s*$")


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in _prose(page) if line.startswith("#")}


def _prose(page: Path) -> Iterator[str]:
    """The page's lines outside code blocks."""
    inside = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            inside = not inside
        elif not inside:
            yield line


def test_every_link_leads_to_a_file_and_heading() -> None:
    broken = []
    for page in PAGES:
        for line in _prose(page):
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                    continue
                path, _, anchor = target.partition("#")
                dest = (page.parent / path).resolve() if path else page
                if not dest.exists():
                    broken.append(f"{page.name}: {target} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                    broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken


def _shown_commands(page: Path) -> Iterator[tuple[str, list[str]]]:
    """(the command as shown, the arguments after ``fullshard``) of each command in a shell code
    block, continuation lines joined, comments and leading ``VAR=value`` settings dropped."""
    lines = page.read_text(encoding="utf-8").splitlines()
    block: str | None = None
    pending = ""
    for line in lines:
        fence = FENCE.match(line)
        if fence:
            block = fence.group(1) if block is None else None
            continue
        if block not in ("bash", "sh"):
            continue
        pending += line.rstrip("\\") + " " if line.endswith("\\") else line
        if line.endswith("\\"):
            continue
        shown, pending = pending, ""
        words = shlex.split(shown, comments=True)
        while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
            words.pop(0)
        if words[:1] == ["fullshard"]:
            argv = words[1:]
        elif "fullshard.app.cli" in words:
            argv = words[words.index("fullshard.app.cli") + 1 :]
        else:
            continue
        if "..." not in argv:  # an illustrative tail ("the run's other options") is not parsed
            yield shown.strip(), argv


def test_every_fullshard_command_shown_parses(capsys: pytest.CaptureFixture[str]) -> None:
    shown = [(page.name, text, argv) for page in PAGES for text, argv in _shown_commands(page)]
    assert len(shown) > 30  # the pages' examples were found at all
    parser = build_parser()
    failed = []
    for name, text, argv in shown:
        try:
            parser.parse_args(argv)
        except SystemExit:
            failed.append(f"{name}: {text}\n  {capsys.readouterr().err.strip().splitlines()[-1]}")
    assert not failed, "\n".join(failed)
