"""The report of ``fullshard bench``: figures per variant, ``bench.json``, ``bench.md``, ``bench.png``.

:func:`summarize` turns the raw per-rank figures of the launches (see :mod:`fullshard.app.commands.bench`)
into one figure per variant; :func:`write_report` writes the three files and returns the
Markdown. Conventions:

- step time: per round, the slowest rank's step (the step is done when every rank is); the
  median over rounds. tokens/s = global tokens per step / that median.
- issue time: per round, the slowest rank's time to issue its step (NOTE [Issue time] in
  :mod:`fullshard.app.commands.bench_variants`); the median over rounds, and its ratio to the step time.
  On CPU the host does the work as it issues it: issue time is the step time (ratio ~1). On
  CUDA a ratio well below 1 means the host runs ahead of the GPU; near 1, the host is the
  bottleneck or waited on the device inside the step.
- communication: bytes of every collective kind in one step, as the c10d dispatcher saw them,
  each collective counted as the full buffer it covers, divided by the model's fp32 bytes.
- exposed communication: fullshard's timeline (time blocked waiting for a collective). FSDP2
  and DDP expose no such hook: "n/a", and the column "step - single" (the step time minus one
  process doing one rank's work without communication) bounds comm + wrapper overhead for all.
- memory: the largest rank's figure (every rank's is in the JSON); on CUDA also the caching
  allocator's peaks (allocated and reserved), reset after wrapping.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from fullshard.observe.plot import pyplot  # matplotlib, when installed

__all__ = ["markdown_table", "summarize", "write_report"]

MIB = 2**20
KIND_ABBREV = {
    "all_gather": "AG",
    "reduce_scatter": "RS",
    "all_to_all": "A2A",  # fullshard's reduce-scatter on gloo: all-to-all + local sum
    "all_reduce": "AR",
    "broadcast": "BC",
}


def _max_or_none(values: list[Any]) -> Any:
    vals = [v for v in values if v is not None]
    return max(vals) if vals else None


def _timing_of(name: str, per_rank: list[dict[str, Any]], model_bytes: int) -> dict[str, Any]:
    entries = [r[name] for r in per_rank]
    active = [e for e in entries if e["times_s"]]
    rounds = [max(ts) for ts in zip(*(e["times_s"] for e in active), strict=True)]
    issue = [max(ts) for ts in zip(*(e["issue_s"] for e in active), strict=True)]
    fig: dict[str, Any] = {
        "step_ms_median": 1e3 * statistics.median(rounds),
        "step_ms_rounds": [1e3 * t for t in rounds],
        "issue_ms_median": 1e3 * statistics.median(issue),
        "issue_ms_rounds": [1e3 * t for t in issue],
        "issue_fraction": statistics.median(issue) / statistics.median(rounds),
        "step_ms_median_per_rank": [1e3 * statistics.median(e["times_s"]) for e in active],
        "loss_per_round": [
            statistics.fmean(ls) for ls in zip(*(e["losses"] for e in active), strict=True)
        ],
    }
    first = active[0]
    if "c10d_bytes" in first:
        fig["comm_units"] = {k: b / model_bytes for k, b in first["c10d_bytes"].items()}
        fig["comm_calls"] = first["c10d_calls"]
        fig["comm_units_total"] = sum(fig["comm_units"].values())
    if "commstats_bytes" in first:
        fig["commstats_units"] = {k: b / model_bytes for k, b in first["commstats_bytes"].items()}
    if "exposed_s" in first:
        exposed = [1e3 * e["exposed_s"] for e in active]
        observed = [1e3 * e["observed_step_s"] for e in active]
        fig["exposed_ms_per_rank"] = exposed
        fig["exposed_ms"] = statistics.fmean(exposed)
        fig["observed_step_ms"] = max(observed)
        fig["exposed_fraction"] = fig["exposed_ms"] / fig["observed_step_ms"]
    return fig


def _memory_of(raw: dict[str, Any]) -> dict[str, Any]:
    ranks = raw["per_rank"]
    fig: dict[str, Any] = {"per_rank": ranks}
    for key in (
        "rss_growth_bytes",
        "live_peak_bytes",
        "tracker_peak_bytes",
        "cuda_max_allocated_bytes",  # CUDA only: the caching allocator's peaks
        "cuda_max_reserved_bytes",
    ):
        fig[key.replace("_bytes", "_mib")] = (
            None if (m := _max_or_none([r.get(key) for r in ranks])) is None else m / MIB
        )
    return fig


def summarize(
    config: dict[str, Any],
    timing: dict[str, Any],
    memory: dict[str, dict[str, Any]],
    extra: dict[str, Any],
) -> dict[str, Any]:
    """One figure set per variant from the raw launch results (``memory`` may be empty)."""
    world = config["world_size"]
    model_bytes = config["model_bytes"]
    variants: dict[str, dict[str, Any]] = {}
    for name in timing["variants"]:
        fig = _timing_of(name, timing["per_rank"], model_bytes)
        tokens = config["tokens_per_rank_step"] * (1 if name == "single" else world)
        fig["tokens_per_step"] = tokens
        fig["tokens_per_s"] = tokens / (fig["step_ms_median"] / 1e3)
        if name in memory:
            fig["memory"] = _memory_of(memory[name])
        variants[name] = fig
    for fig in variants.values():
        for ref in ("fsdp2", "ddp", "single"):
            if ref in variants:
                fig[f"step_vs_{ref}"] = fig["step_ms_median"] / variants[ref]["step_ms_median"]
        if "single" in variants:
            fig["step_minus_single_ms"] = (
                fig["step_ms_median"] - variants["single"]["step_ms_median"]
            )
    # Every distributed variant trains the same model on the same data: their losses agree to
    # rounding (different reduction orders), which says they all did the same work.
    dist_losses = [f["loss_per_round"] for n, f in variants.items() if n != "single"]
    spread = max(
        (max(abs(a - b) for a, b in zip(ls, dist_losses[0], strict=True)) for ls in dist_losses),
        default=0.0,
    )
    checks = {"max_loss_difference_between_distributed_variants": spread}
    return {"config": config, "variants": variants, "checks": checks, **extra}


def _precision(cfg: dict[str, Any]) -> str:
    if cfg.get("mixed_precision", "none") == "none":
        return cfg["dtype"]
    return f"{cfg['dtype']} compute, float32 master weights and gradient reduction"


def _fmt(value: Any, spec: str, none: str = "n/a") -> str:
    return none if value is None else format(value, spec)


def _comm_cell(fig: dict[str, Any]) -> str:
    units = fig.get("comm_units")
    if not units:
        return "0 (no peers)" if units is not None or "exposed_ms" not in fig else "n/a"
    parts = [f"{KIND_ABBREV.get(k, k)} {v:.2f}" for k, v in sorted(units.items())]
    return " + ".join(parts) + (f" = {fig['comm_units_total']:.2f}" if len(parts) > 1 else "")


def markdown_table(summary: dict[str, Any]) -> str:
    """The table of ``bench.md`` (one row per variant) and the notes that say how it was made."""
    cfg = summary["config"]
    cuda = cfg.get("device") == "cuda"
    head = (
        "| variant | step ms (median) | issue ms (% step) | x FSDP2 | x DDP | tokens/s | "
        "peak RSS growth MiB | peak live tensors MiB | tracker peak MiB | "
        + ("CUDA peak allocated / reserved MiB | " if cuda else "")
        + "comm/step (model units) | exposed comm ms (% step) | step - single ms |"
    )
    rows = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for name, f in summary["variants"].items():
        mem = f.get("memory", {})
        exposed = "n/a"
        if "exposed_ms" in f:
            exposed = f"{f['exposed_ms']:.1f} ({100 * f['exposed_fraction']:.0f}%)"
        comm = "0 (one process)" if name == "single" else _comm_cell(f)
        cuda_cell = ""
        if cuda:
            alloc = _fmt(mem.get("cuda_max_allocated_mib"), ".1f")
            cuda_cell = f"{alloc} / {_fmt(mem.get('cuda_max_reserved_mib'), '.1f')} | "
        rows.append(
            f"| {name} | {f['step_ms_median']:.1f} | {f['issue_ms_median']:.1f} "
            f"({100 * f['issue_fraction']:.0f}%) | {_fmt(f.get('step_vs_fsdp2'), '.2f')} | "
            f"{_fmt(f.get('step_vs_ddp'), '.2f')} | {f['tokens_per_s']:.0f} | "
            f"{_fmt(mem.get('rss_growth_mib'), '.1f')} | {_fmt(mem.get('live_peak_mib'), '.1f')} | "
            f"{_fmt(mem.get('tracker_peak_mib'), '.1f')} | {cuda_cell}{comm} | {exposed} | "
            f"{_fmt(f.get('step_minus_single_ms') if name != 'single' else None, '.1f', '-')} |"
        )
    notes = [
        "",
        f"Model `{cfg['model']}` ({cfg['params'] / 1e6:.2f}M parameters, {_precision(cfg)}, "
        f"{cfg['optimizer']}), {cfg['world_size']} ranks x {cfg['threads']} thread(s) "
        f"({cfg.get('device', 'cpu')}, {cfg.get('backend', 'gloo')}), batch "
        f"{cfg['batch_size']} x {cfg['seq_len']} tokens per rank; {cfg['warmup']} warm-up and "
        f"{cfg['rounds']} timed rounds, every variant one step per round in turn, a barrier "
        "before each step; a round's step time is the slowest rank's. torch "
        f"{cfg['torch']}, {cfg['cpu_count']} CPUs.",
        "- Issue time: time for the host to issue a step, before the step's final "
        "synchronisation (on CUDA: `torch.cuda.synchronize()`), slowest rank per round; "
        + (
            "a small share of the step means the host runs ahead of the GPU."
            if cuda
            else "on CPU the host does the work as it issues it, so issue time = step time."
        ),
        "- `single`: one process, one rank's batch, whole model, no communication; it runs on "
        "rank 0 of the same launch while the other ranks wait at a barrier. Its tokens/s counts "
        "one rank's tokens.",
        "- Memory: the largest rank's figure, from one launch per variant with "
        "`MALLOC_MMAP_THRESHOLD_=65536`. RSS growth: peak resident set during "
        f"{cfg['memory_steps']} training steps (peak reset after wrapping) minus the resident set "
        "after process-group init; live tensors: peak bytes of live tensor storage during the "
        "steps (profiler allocator events: parameters, gradients, optimizer state, activations, "
        "buffers); tracker: fullshard's MemoryTracker (sum of its categories, from the second "
        "step).",
        "- Communication: one step counted at the c10d dispatcher; each collective counts the "
        "full buffer it covers (all-gather output, reduce-scatter input, all-reduce tensor) over "
        f"the model's fp32 bytes; AG = all-gather, RS = reduce-scatter, AR = all-reduce. The "
        f"root unit ({100 * cfg['root_fraction']:.1f}% of the parameters) keeps its parameters "
        "from forward to backward, so FULL_SHARD gathers it once: AG = 2 - that share.",
        "- Exposed comm: time fullshard's ranks were blocked waiting for a collective "
        f"(timeline Recorder, {cfg['observed_steps']} untimed steps; % of those "
        "steps). FSDP2 and DDP expose no such measure (n/a); `step - single` bounds their "
        "communication plus wrapper overhead, for every variant alike.",
        "- Check: the largest loss difference between the distributed variants over the timed "
        "rounds is "
        f"{summary['checks']['max_loss_difference_between_distributed_variants']:.2e} "
        "(same model, same data: they did the same work).",
    ]
    for failed in summary.get("failed", []):
        notes.append(f"- FAILED: {failed}")
    return "\n".join(rows + notes) + "\n"


def _draw(summary: dict[str, Any], path: Path) -> bool:
    plt = pyplot(path.name)
    if plt is None:  # matplotlib is optional: one line said how to get it
        return False
    names = list(summary["variants"])
    figs = [summary["variants"][n] for n in names]
    cfg = summary["config"]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 4.8))
    xs = range(len(names))
    ax_t.bar(xs, [f["step_ms_median"] for f in figs], color="#4c72b0", label="median")
    for x, f in zip(xs, figs, strict=True):
        ax_t.scatter([x] * len(f["step_ms_rounds"]), f["step_ms_rounds"], s=10, c="k", zorder=3)
    ax_t.set_xticks(list(xs), names, rotation=30, ha="right")
    ax_t.set_ylabel("step time (ms); dots: rounds")
    ax_t.set_title("step time (lower is better)")
    kinds = [
        ("rss_growth_mib", "peak RSS growth", "#dd8452"),
        ("live_peak_mib", "peak live tensors", "#55a868"),
        ("tracker_peak_mib", "fullshard tracker", "#8172b3"),
    ]
    width = 0.27
    for i, (key, label, color) in enumerate(kinds):
        vals = [f.get("memory", {}).get(key) for f in figs]
        ax_m.bar(
            [x + (i - 1) * width for x in xs],
            [v or 0.0 for v in vals],
            width,
            label=label,
            color=color,
        )
    ax_m.set_xticks(list(xs), names, rotation=30, ha="right")
    ax_m.set_ylabel("MiB per rank (largest rank)")
    ax_m.set_title("peak memory per rank (lower is better)")
    ax_m.legend(fontsize=8)
    fig.suptitle(
        f"fullshard bench: {cfg['model']} ({cfg['params'] / 1e6:.1f}M params), "
        f"{cfg['world_size']} ranks x {cfg['threads']} thread(s), batch {cfg['batch_size']}x"
        f"{cfg['seq_len']} per rank, {cfg['rounds']} rounds"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(summary: dict[str, Any], out: Path) -> str:
    """Write ``bench.json``, ``bench.md`` and ``bench.png`` (with matplotlib) into ``out``;
    returns the Markdown."""
    out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(summary)
    files = [out / "bench.json", out / "bench.md", out / "bench.png"]
    files[0].write_text(json.dumps(summary, indent=2) + "\n")
    files[1].write_text(f"# fullshard bench\n\n{table}")
    if not _draw(summary, files[2]):
        files.pop()
    return table + "\nwrote " + ", ".join(str(f) for f in files)
