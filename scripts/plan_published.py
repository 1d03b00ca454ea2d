"""`fullshard plan` against published torchtitan runs: predicted vs published memory and speed.

Each run of ``tests/plan_runs/published.json`` (torchtitan's December 2024 H100 tables 1-5 and
runs recorded in its history) is planned from its model's ``config.json`` in
``tests/plan_runs/<model>/`` exactly as ``fullshard plan --model hf:DIR ... --json`` would, and
printed as the Markdown table of docs/plan.md: published and predicted reserved memory (GiB, what
torchtitan logs: ``torch.cuda.max_memory_reserved``) and tokens/s per GPU, with the errors.

    .venv/bin/python scripts/plan_published.py            # the table
    .venv/bin/python scripts/plan_published.py --json     # every plan's figures
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

RUNS = Path(__file__).resolve().parents[1] / "tests" / "plan_runs"
GIB = 2**30


def command(run: dict[str, Any]) -> list[str]:
    """The ``fullshard plan`` arguments that describe ``run``."""
    argv = [
        "plan",
        "--model",
        f"hf:{RUNS / run['model']}",
        "--devices",
        str(run["devices"]),
        "--batch",
        str(run["batch"]),
        "--seq",
        str(run["seq"]),
        "--precision",
        "bf16",
        "--activation-checkpointing",
        run["activation_checkpointing"],
        "--gpu",
        run["gpu"],
        "--strategy",
        run.get("strategy", "full_shard"),
    ]
    for flag in ("tp", "pp", "cp"):
        if run.get(flag, 1) > 1:
            argv += [f"--{flag}", str(run[flag])]
    if run.get("pp_schedule"):
        argv += ["--pp-schedule", run["pp_schedule"]]
    if run.get("compile"):
        argv += ["--compile", run["compile"]]
    argv += [f"--{f.replace('_', '-')}" for f in ("float8", "async_tp") if run.get(f)]
    return argv


def predict(run: dict[str, Any]) -> dict[str, Any]:
    """The plan of ``run`` as ``fullshard plan ... --json`` prints it (without the
    recommendation, which plans every other configuration too)."""
    from fullshard.app.cli import build_parser
    from fullshard.app.commands.plan import make_plan, plan_config

    args = build_parser(only="plan").parse_args(command(run))
    plan = make_plan(
        args.devices, plan_config(args, analytic=False), model=args.model, with_recommendation=False
    )
    return plan.to_dict()


# The three runs whose figures set the GPU presets' efficiencies (and which one each sets):
# fullshard.plan.hardware.GPU_EFFICIENCY holds what --calibrate here prints.
CALIBRATION = {
    "T1 FSDP": ("matmul", "allocator"),
    "T1 FSDP+compile+float8": ("matmul_fp8",),
    "T2 FSDP 8, CP 1": ("attention",),
}


def _timing_inputs(run: dict[str, Any]) -> tuple[Any, list[Any], int, Any]:
    """What the step-time model reads for ``run``: its shape, units, world and config."""
    from fullshard.app.cli import build_parser
    from fullshard.app.commands.plan import plan_config
    from fullshard.app.models.gpt import build_model, output_vocab_size, unit_types_of
    from fullshard.app.models.planning import tp_local_shapes
    from fullshard.plan.model import model_units
    from fullshard.plan.transformer import shape_of

    args = build_parser(only="plan").parse_args(command(run))
    cfg = plan_config(args, analytic=False)
    from fullshard.app.models.planning import model_vocab

    model = build_model(args.model, model_vocab(args.model), device="meta")
    local = tp_local_shapes(model, cfg.tp) if cfg.tp > 1 else None
    group = cfg.shard_group(cfg.dp_world(args.devices))
    units = model_units(model, unit_types_of(model), group, None, local)
    return shape_of(model, output_vocab_size(model)), units, args.devices, cfg


def calibrate(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Solve the efficiencies of :data:`CALIBRATION` so that each calibration run's predicted
    tokens/s is its published figure (a fixed point: each run depends a little on the others'
    constants), and the allocator factor so that the first's reserved memory is."""
    from dataclasses import replace

    from fullshard.plan.hardware import GPU_EFFICIENCY
    from fullshard.plan.steptime import step_time

    by_id = {r["id"]: r for r in runs}
    inputs = {rid: _timing_inputs(by_id[rid]) for rid in CALIBRATION}
    eff = GPU_EFFICIENCY
    for _ in range(30):
        for rid, fields in CALIBRATION.items():
            shape, units, world, cfg = inputs[rid]
            target = by_id[rid]["tokens_per_s_per_device"]
            name = fields[0]
            for _ in range(40):  # tokens/s grows with the efficiency: a multiplicative search
                hw = replace(cfg.hardware, efficiency=eff)
                tps = step_time(shape, units, world, replace(cfg, hardware=hw), hw)
                ratio = target / tps.tokens_per_s_per_device
                if abs(ratio - 1) < 1e-5:
                    break
                eff = replace(eff, **{name: getattr(eff, name) * ratio**1.5})
    first = next(iter(CALIBRATION))
    live = predict(by_id[first])["peak_bytes"]
    eff = replace(eff, allocator=by_id[first]["memory_gib"] * GIB / live)
    return {k: float(f"{v:.4g}") for k, v in vars(eff).items()}


def error(predicted: float, published: float | None) -> str:
    return "" if not published else f"{100 * (predicted - published) / published:+.0f}%"


def table(runs: list[dict[str, Any]], plans: list[dict[str, Any]]) -> str:
    head = (
        "| run | published GiB | predicted GiB | error | published tokens/s | "
        "predicted tokens/s | error |\n|---|--:|--:|--:|--:|--:|--:|"
    )
    rows = [head]
    for run, plan in zip(runs, plans, strict=True):
        mem = plan["peak_reserved_bytes"] / GIB
        tps = plan["tokens_per_s_per_device"]
        star = " (calibration)" if run["id"] in CALIBRATION else ""
        pub_mem = run["memory_gib"]
        rows.append(
            f"| {run['id']}{star} | {pub_mem if pub_mem else '-'} | {mem:.1f} | "
            f"{error(mem, pub_mem)} | {run['tokens_per_s_per_device']:,} | {tps:,.0f} | "
            f"{error(tps, run['tokens_per_s_per_device'])} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="every plan's figures as JSON")
    parser.add_argument("--only", help="runs whose id contains this")
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="solve the GPU efficiencies on the calibration runs and print them",
    )
    args = parser.parse_args(argv)
    runs = json.loads((RUNS / "published.json").read_text(encoding="utf-8"))
    if args.calibrate:
        print(json.dumps(calibrate(runs), indent=1))
        return 0
    runs = [r for r in runs if not args.only or args.only in r["id"]]
    plans = [predict(r) for r in runs]
    if args.json:
        print(
            json.dumps(
                [{**r, "plan": p} for r, p in zip(runs, plans, strict=True)], indent=1, default=str
            )
        )
    else:
        print(table(runs, plans))
    return 0


if __name__ == "__main__":
    sys.exit(main())
