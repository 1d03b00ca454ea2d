"""The programs of issue 34 under fullshard and under torch's FSDP2, side by side.

Each case runs in its own launch of 2 (or ``--world``) gloo ranks, float64, 3 AdamW steps,
against one process on the union of the ranks' data (``tests/conditional_programs.py``):

- ``moe``: an MoE with one module per expert, top-2 routing and a load-balancing loss; each
  rank's tokens reach only some experts (parameters some ranks did not use);
- ``moe accumulate``: the same with two micro-batches, the first without gradient sync;
- ``vlm``: a tiny Hugging Face LLaVA whose batches carry an image on rank 0 only in the first
  step; fullshard declares the vision encoder optional (``set_optional()``), FSDP2 has no such
  declaration;
- ``vlm undeclared``: the same without the declaration, the image at the second step.

A launch ends as: ``exact`` (the largest difference from one process), an error every rank
raised (its first line), a rank killed (gloo's abort), or a hang (past ``--deadline``).

    PYTHONPATH=src python scripts/conditional_vs_fsdp2.py [--world 2] [--out FILE.json]

``--cost``: what ``set_optional()`` costs a unit every rank runs (gathered memory, exposed
communication, step time), alternating launches with and without it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

CASES = ["moe", "moe accumulate", "vlm", "vlm undeclared"]


def _case(rank: int, world: int, impl: str, case: str) -> dict[str, Any]:
    import conditional_programs as cp

    if impl == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        cp.fully_shard = fully_shard  # type: ignore[assignment]
    some, every = [r == 0 for r in range(world)], [True] * world
    try:
        if case.startswith("moe"):
            micro = 2 if case == "moe accumulate" else 1
            out = cp.train(
                rank,
                world,
                lambda: cp.MoELM().double(),
                lambda m: cp.shard_moe(m, "plain", world),
                cp.moe_loss,  # type: ignore[arg-type]
                cp.moe_batches(3, micro, world),
            )
        else:
            optional = case == "vlm" and impl == "fullshard"
            images = [some, every, every] if case == "vlm" else [every, some, every]
            out = cp.train(
                rank,
                world,
                cp.tiny_llava,
                lambda m: cp.shard_vlm(m, optional),
                cp.vlm_loss,
                cp.vlm_batches(images),
            )
    except Exception as exc:
        return {"outcome": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    return {"outcome": f"exact to {max(out['diffs']):.1e}", "diffs": out["diffs"]}


def run(impl: str, case: str, world: int, deadline: float) -> str:
    from harness import RanksFailed, run_ranks

    try:
        res = run_ranks(_case, world, impl, case, timeout_s=deadline, pg_timeout_s=deadline)
    except RanksFailed as exc:
        text = str(exc)
        if "did not finish" in text:
            return f"hung (no rank finished within {deadline:.0f} s)"
        codes = sorted({line.split("code ")[-1] for line in text.splitlines() if "code" in line})
        return f"rank killed (exit code {', '.join(codes)}; gloo's abort)" if codes else text
    # the same error on every rank but for the rank it names first
    outcomes = [re.sub(r"rank \d+: ", "", r["outcome"], count=2) for r in res]
    if len(set(outcomes)) == 1:
        return outcomes[0] + (" (every rank)" if "Error" in outcomes[0] else "")
    return "; ".join(f"rank {r}: {o}" for r, o in enumerate(outcomes))


def _cost(rank: int, world: int, optional: bool, steps: int) -> dict[str, Any]:
    """What declaring a unit optional costs when every rank runs it: an encoder unit (a
    quarter of the model) before four blocks, trained ``steps`` steps after two of warm-up;
    the gathered-window peak (MemoryTracker), exposed communication per step (the timeline's
    host waits) and step time, all medians or peaks over the timed steps."""
    import time

    import torch
    from toy import Block

    from fullshard import fully_shard
    from fullshard.observe.memory import MemoryTracker
    from fullshard.observe.timeline import Recorder, exposed_seconds

    dim = 256
    torch.manual_seed(0)
    enc = torch.nn.Sequential(*(Block(dim, 4 * dim) for _ in range(4)))
    blocks = torch.nn.ModuleList(
        torch.nn.Sequential(*(Block(dim, 4 * dim) for _ in range(3))) for _ in range(4)
    )

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc, self.blocks = enc, blocks

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.enc(x)
            for b in self.blocks:
                h = b(h)
            return h

    model = Model()
    for b in blocks:
        fully_shard(b)
    fully_shard(enc)
    if optional:
        enc.set_optional()  # type: ignore[operator]
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, dim, generator=torch.Generator().manual_seed(rank))

    def step() -> float:
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0

    step(), step()
    rec, mem = Recorder().attach(model, opt), MemoryTracker().attach(model, opt)
    times = sorted(step() for _ in range(steps))
    rec.detach()
    mem.detach()
    return {
        "gathered_peak_bytes": max(p["gathered_window"] for p in mem.peaks.values()),
        "exposed_ms_per_step": 1e3 * exposed_seconds(rec.events) / steps,
        "step_ms_median": 1e3 * times[len(times) // 2],
        "encoder_bytes": sum(4 * p.numel() for p in enc.parameters()),  # DTensors: global
    }


def cost(world: int, rounds: int, steps: int) -> dict[str, Any]:
    """``_cost`` with and without ``set_optional()``, alternating launches (A B A B ...)."""
    from harness import run_ranks

    runs: dict[str, list[dict[str, Any]]] = {"normal": [], "optional": []}
    for _ in range(rounds):
        for name in runs:
            res = run_ranks(_cost, world, name == "optional", steps, timeout_s=600)
            runs[name].append(res[0])
    out: dict[str, Any] = {}
    for name, rs in runs.items():
        out[name] = {k: sorted(r[k] for r in rs)[len(rs) // 2] for k in rs[0]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--deadline", type=float, default=60.0)
    ap.add_argument("--out", default="")
    ap.add_argument("--cost", action="store_true", help="the cost of an optional unit instead")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    if args.cost:
        result = cost(args.world, args.rounds, args.steps)
        print(json.dumps(result, indent=1))
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"world": args.world, **result}, f, indent=1)
        return
    rows = []
    for case in CASES:
        row = {"case": case}
        for impl in ("fullshard", "fsdp2"):
            row[impl] = run(impl, case, args.world, args.deadline)
        rows.append(row)
        print(f"| {case} | {row['fullshard']} | {row['fsdp2']} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"world": args.world, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
