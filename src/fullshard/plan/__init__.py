"""The memory planner (layer 10): predicts a sharded step's per-device memory and communication.

Pure library functions over a model description: :func:`plan_analytic` (a parameter count) and
:func:`plan_model` (a real model, built on the meta device if you like). The report and the
``fullshard plan`` command are in ``fullshard.app.plan_cli``; ``plan --check`` (measuring a real
run against the plan) in ``fullshard.app.plan_check``.
"""

from fullshard.plan.accounting import (
    GB,
    Plan,
    PlanConfig,
    Recommendation,
    UnitCost,
    build_plan,
    fmt_bytes,
    plan_analytic,
)
from fullshard.plan.model import LossStep, measure_activations, model_units, plan_model, recommend

__all__ = [
    "GB",
    "LossStep",
    "Plan",
    "PlanConfig",
    "Recommendation",
    "UnitCost",
    "build_plan",
    "fmt_bytes",
    "measure_activations",
    "model_units",
    "plan_analytic",
    "plan_model",
    "recommend",
]
