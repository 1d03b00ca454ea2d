"""The library installs with torch, numpy and safetensors only.

matplotlib (the plots) and tqdm (the progress bars) are the ``cli`` extra: ``import fullshard``
never imports them, every command's ``--help`` works without them, and a command that would
draw says in one line how to get matplotlib and goes on. "Not installed" is played by putting
``None`` in ``sys.modules``: ``import matplotlib`` then raises ``ImportError``, as it does where
the package is missing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fullshard.app.data.prepare import PrepareOptions, prepare
from fullshard.app.train.monitor import plot_losses
from fullshard.observe.plot import CLI_EXTRA, draw_timeline

SRC = Path(__file__).resolve().parents[1] / "src"
EXTRAS = ("matplotlib", "tqdm")
HINT = "matplotlib is not installed (pip install 'fullshard[cli]')"


def _python(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter (this one has imported the extras long ago)."""
    env = dict(os.environ, PYTHONPATH=str(SRC))
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )


def test_the_library_and_every_commands_help_need_neither_extra() -> None:
    # A spy on every import statement that names an extra records the module that runs it
    # (torch's own `import torch` asks for tqdm, in torch.hub: what counts is who asks); the
    # extras are blocked, so any unguarded import of them fails loudly besides.
    out = _python(
        "import builtins, sys\n"
        "asked, real_import = set(), builtins.__import__\n"
        "def spy(name, globals=None, *args, **kwargs):\n"
        f"    if name.split('.')[0] in {EXTRAS!r}:\n"
        "        asked.add((globals or {}).get('__name__', '?'))\n"
        "    return real_import(name, globals, *args, **kwargs)\n"
        "builtins.__import__ = spy\n"
        f"sys.modules.update(dict.fromkeys({EXTRAS!r}))  # as if not installed\n"
        # the engine, checkpoints, planner, instruments: what a library user touches
        "import fullshard\n"
        "fullshard.fully_shard, fullshard.parallelize, fullshard.get_state_dict\n"
        "import fullshard.checkpoint, fullshard.deterministic, fullshard.elastic, fullshard.plan\n"
        "import fullshard.observe.memory, fullshard.observe.plot\n"
        "print('library', sorted(m for m in asked if m.startswith('fullshard')))\n"
        "from fullshard.app.cli import COMMANDS, main\n"
        "for argv in ([], *([c] for c in COMMANDS)):\n"
        "    try:\n"
        "        main([*argv, '--help'])\n"
        "    except SystemExit as exc:\n"
        "        assert exc.code == 0, (argv, exc.code)\n"
        "print('helped', len(COMMANDS) + 1)\n"
    )
    assert out.returncode == 0, out.stderr
    assert "library []" in out.stdout.splitlines()
    assert out.stdout.splitlines()[-1] == "helped 7"
    assert "Traceback" not in out.stderr


@pytest.mark.fast
def test_plots_without_matplotlib_are_skipped_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")  # the control: with it, the plot is drawn
    records = [{"step": 1, "loss": 5.5}, {"step": 2, "loss": 4.0, "val_loss": 4.2}]
    plot_losses(records, tmp_path / "drawn.png", "with matplotlib")
    assert (tmp_path / "drawn.png").stat().st_size > 0

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    capsys.readouterr()
    plot_losses(records, tmp_path / "loss.png", "without matplotlib")
    assert not draw_timeline([], {0: 0.0}, tmp_path / "trace.png")
    assert not (tmp_path / "loss.png").exists() and not (tmp_path / "trace.png").exists()
    assert capsys.readouterr().err.splitlines() == [
        f"fullshard: loss.png not drawn: {HINT}",
        f"fullshard: trace.png not drawn: {HINT}",
    ]


@pytest.mark.fast
def test_prepare_without_tqdm_writes_the_same_shards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = tmp_path / "a.txt"
    text.write_text("fully sharded data parallel, " * 200)
    with_bar = prepare(PrepareOptions([str(text)], str(tmp_path / "bar"), progress=True))
    monkeypatch.setitem(sys.modules, "tqdm", None)
    without = prepare(PrepareOptions([str(text)], str(tmp_path / "nobar"), progress=True))
    assert _hashes(without) == _hashes(with_bar)


def _hashes(index: dict[str, Any]) -> dict[str, list[str]]:
    """Each split's files by their sha256, from a prepared folder's index."""
    splits = index["splits"].items()
    return {k: [f["sha256"] for f in (*v["shards"], v["doc_starts"])] for k, v in splits}


@pytest.mark.fast
def test_training_without_tqdm_logs_plain_lines(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``fullshard train`` asks for a bar: without tqdm it says so once, and the trainer prints
    its plain log line per logged step (no bar: ``Trainer.log_step``)."""
    from fullshard.app.train.monitor import progress_bar

    monkeypatch.setitem(sys.modules, "tqdm", None)
    assert progress_bar(10, 0, True) is None
    assert f"no progress bar: tqdm is not installed ({CLI_EXTRA})" in capsys.readouterr().out
