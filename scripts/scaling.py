"""Memory per rank against world size: measured (1, 2, 4 ranks here) and planned (up to 8).

Usage: ``python scripts/scaling.py [--model small] [--measure 1,2,4] [--plan 1,2,4,8]
[--out docs/scaling.png]``

Measured: ``fullshard plan --check --json`` (peak live tensor storage per rank, the worst rank,
FULL_SHARD, fp32 AdamW, batch 8 x 128 per rank). Planned: ``plan_builtin`` at each world size.
The reference line is the model state 16·Ψ/N (4 B parameter + 4 B gradient + 8 B Adam state per
parameter, sharded N ways) plus the gathered window and the activations, which do not shrink
with N. Writes the PNG and a JSON of every figure next to it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from fullshard.app.models.gpt import build_model, count_params
from fullshard.app.models.planning import plan_builtin
from fullshard.plan import PlanConfig

MIB = 2**20


def measure(model: str, world: int) -> float:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fullshard.app.cli",
            "plan",
            "--model",
            model,
            "--devices",
            str(world),
            *["--batch", "8", "--seq", "128", "--check", "--json"],
        ],
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    res = json.loads(proc.stdout[proc.stdout.index("{") :])
    return max(res["measured"][p]["total"] for p in res["measured"]) / MIB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--measure", default="1,2,4")
    ap.add_argument("--plan", default="1,2,4,8")
    ap.add_argument("--out", default="docs/scaling.png")
    args = ap.parse_args()
    psi = count_params(build_model(args.model, 256, device="meta"))
    cfg = PlanConfig(precision="fp32", backend="gloo", batch=8, seq=128)
    planned, window_act = {}, {}
    for n in (int(x) for x in args.plan.split(",")):
        plan = plan_builtin(args.model, n, cfg, with_recommendation=False)
        planned[n] = max(p.total - p.other for p in plan.phases.values()) / MIB
        fwd = plan.phases["backward"]
        window_act[n] = (fwd.gathered_window + fwd.activations + fwd.comm_buffers) / MIB
    measured = {n: measure(args.model, n) for n in (int(x) for x in args.measure.split(","))}
    state = {n: 16 * psi / n / MIB for n in planned}

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ns = sorted(planned)
    ax.plot(ns, [state[n] for n in ns], "k--", label="16·Ψ/N (model state, sharded)")
    ax.plot(
        ns,
        [state[n] + window_act[n] for n in ns],
        "k:",
        label="16·Ψ/N + window + activations (not all at their peaks at once)",
    )
    ax.plot(ns, [planned[n] for n in ns], "o-", color="#1e88e5", label="fullshard plan (peak)")
    ax.plot(
        sorted(measured),
        [measured[n] for n in sorted(measured)],
        "s",
        color="#e53935",
        markersize=9,
        label="measured peak (live tensors)",
    )
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel("ranks (FULL_SHARD)")
    ax.set_ylabel("MiB per rank")
    ax.set_title(f"{args.model} ({psi / 1e6:.1f}M params), fp32 AdamW, batch 8×128 per rank")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=130)
    figures = {
        "params": psi,
        "planned_mib": planned,
        "measured_mib": measured,
        "state_16psi_over_n_mib": state,
        "window_activations_mib": window_act,
    }
    with open(args.out.rsplit(".", 1)[0] + ".json", "w") as f:
        json.dump(figures, f, indent=2)
    for n in ns:
        m = f"{measured[n]:.1f}" if n in measured else "-"
        print(
            f"N={n}: 16Ψ/N {state[n]:.1f} MiB, planned peak {planned[n]:.1f} MiB, measured {m} MiB"
        )


if __name__ == "__main__":
    main()
