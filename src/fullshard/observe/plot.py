"""Drawing (layer 10): every figure fullshard draws gets matplotlib from :func:`pyplot`, and the
timeline: one PNG, ranks as rows, where the five steps of FSDP show.

matplotlib is optional (``pip install 'fullshard[cli]'``, the command line's extras): without it a
figure is skipped with one line saying how to get it, and the run goes on.

Each rank gets five lanes: compute (forward/backward per unit, the optimizer step), gather and
reduce (each collective from issue to completion), exposed (the rank blocked on a collective) and
free (a tick per released unit). Overlap of communication with computation is visible as comm bars running
under compute bars; exposed bars are the part that was not hidden.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

from fullshard.observe.timeline import LANES, Event

__all__ = ["CLI_EXTRA", "draw_timeline", "pyplot"]

CLI_EXTRA = "pip install 'fullshard[cli]'"  # matplotlib and tqdm: what the CLI adds to the library


def pyplot(what: str) -> ModuleType | None:
    """matplotlib's ``pyplot`` on the Agg backend (no display on training machines), or ``None``
    after one line on stderr saying that ``what`` (e.g. ``"loss.png"``) is not drawn and how to
    get matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print(
            f"fullshard: {what} not drawn: matplotlib is not installed ({CLI_EXTRA})",
            file=sys.stderr,
            flush=True,
        )
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


COLORS = {
    "forward": "#4caf50",
    "backward": "#1b5e20",
    "optimizer step": "#8e24aa",
    "all_gather": "#1e88e5",
    "reduce_scatter": "#fb8c00",
    "all_reduce": "#6d4c41",
    "free": "#9e9e9e",
}
EXPOSED = "#e53935"


def draw_timeline(
    events: list[Event], origin: dict[int, float], path: str | Path, title: str = ""
) -> bool:
    """Save the timeline of ``events`` (times relative to each rank's ``origin``) as a PNG;
    ``False`` when matplotlib is missing (nothing written, one line said so)."""
    plt = pyplot(Path(path).name)
    if plt is None:
        return False
    from matplotlib.patches import Patch

    ranks = sorted(origin)
    rows = [(r, lane) for r in ranks for lane in LANES]
    fig, ax = plt.subplots(figsize=(14, 0.45 * len(rows) + 1.5))
    for e in events:
        y = rows.index((e.rank, e.cat))
        x0 = (e.start - origin[e.rank]) * 1e3
        if e.cat == "free":
            ax.plot([x0, x0], [y - 0.35, y + 0.35], color=COLORS["free"], linewidth=1)
            continue
        width = max((e.end - e.start) * 1e3, 0.05)
        color = EXPOSED if e.cat == "exposed" else COLORS.get(e.name, "#607d8b")
        if e.unit == "root" and e.cat == "compute":
            # the root's forward/backward encloses every block's: draw it faint, behind them
            ax.broken_barh([(x0, width)], (y - 0.45, 0.9), facecolors=color, alpha=0.25, zorder=0)
            continue
        ax.broken_barh(
            [(x0, width)], (y - 0.35, 0.7), facecolors=color, edgecolor="white", linewidth=0.3
        )
        if e.cat == "compute" and e.unit and width > 0:
            label = e.unit.split(".")[-1] if e.unit != "optimizer" else "opt"
            ax.text(x0 + width / 2, y, label, ha="center", va="center", fontsize=5)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {r} {lane}" for r, lane in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title or "fullshard timeline")
    legend = [Patch(color=c, label=n) for n, c in COLORS.items()] + [
        Patch(color=EXPOSED, label="exposed (blocked on comm)")
    ]
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=8, fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return True
