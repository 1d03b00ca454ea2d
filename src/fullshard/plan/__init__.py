"""The memory planner (layer 10): predicts a sharded step's per-device memory and communication.

Pure library functions over a model description: :func:`plan_analytic` (a parameter count) and
:func:`plan_model` (a real model, built on the meta device if you like); with a
:class:`Hardware` (a preset, a JSON description, or this machine calibrated) they also predict
the step time (:func:`step_time`). The report and the
``fullshard plan`` command are in ``fullshard.app.commands.plan``; ``plan --check`` (measuring a real
run against the plan) in ``fullshard.app.commands.plan_check``.
"""

# Names load on first use (PEP 562), like ``fullshard`` itself: ``import fullshard.plan.config``
# (the launcher's plan validation) need not import ``plan.model`` and the engine modules it uses.

from __future__ import annotations

from typing import TYPE_CHECKING

from fullshard._lazy import lazy_exports

if TYPE_CHECKING:  # the real imports, for type checkers and IDEs
    from fullshard.plan.accounting import Plan, Recommendation, build_plan, fmt_bytes
    from fullshard.plan.analytic import plan_analytic
    from fullshard.plan.config import GB, PlanConfig, UnitCost
    from fullshard.plan.hardware import PRESETS, Efficiency, Hardware, load_hardware
    from fullshard.plan.model import LossStep, measure_activations, model_units, plan_model
    from fullshard.plan.recommendation import recommend
    from fullshard.plan.steptime import StepTime, step_time
    from fullshard.plan.transformer import TransformerShape, shape_of

__all__ = [
    "GB",
    "PRESETS",
    "Efficiency",
    "Hardware",
    "LossStep",
    "Plan",
    "PlanConfig",
    "Recommendation",
    "StepTime",
    "TransformerShape",
    "UnitCost",
    "build_plan",
    "fmt_bytes",
    "load_hardware",
    "measure_activations",
    "model_units",
    "plan_analytic",
    "plan_model",
    "recommend",
    "shape_of",
    "step_time",
]

# public name -> the module that defines it (the TYPE_CHECKING imports above, as data)
_SOURCES = {
    **dict.fromkeys(
        ["Plan", "Recommendation", "build_plan", "fmt_bytes"], "fullshard.plan.accounting"
    ),
    **dict.fromkeys(["GB", "PlanConfig", "UnitCost"], "fullshard.plan.config"),
    "plan_analytic": "fullshard.plan.analytic",
    **dict.fromkeys(
        ["PRESETS", "Efficiency", "Hardware", "load_hardware"], "fullshard.plan.hardware"
    ),
    **dict.fromkeys(["StepTime", "step_time"], "fullshard.plan.steptime"),
    **dict.fromkeys(["TransformerShape", "shape_of"], "fullshard.plan.transformer"),
    **dict.fromkeys(
        ["LossStep", "measure_activations", "model_units", "plan_model"],
        "fullshard.plan.model",
    ),
    "recommend": "fullshard.plan.recommendation",
}


__getattr__, __dir__ = lazy_exports(__name__, globals(), _SOURCES)
