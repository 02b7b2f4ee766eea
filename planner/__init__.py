"""rematd's planner: cost model, solvers and the adaptive controller.

Pure Python with no third-party imports, so that the service, the client and
any tool can run the same planner anywhere.
"""

from rematd.planner.controller import Controller, ControllerConfig
from rematd.planner.cost import peak_in_order, peak_of, predict_overhead_ratio, predict_peak_bytes
from rematd.planner.model import BlockCost, ModeCost, Option, Profile, Size, Term
from rematd.planner.plan import Plan, ShapePlan, blocks_of
from rematd.planner.risk import oom_risk
from rematd.planner.session import PlannerSession
from rematd.planner.solvers import (
    Choice,
    checkpoint_every_of,
    every_k_blocks,
    frequency_of,
    solve,
    solve_min_recompute,
)
from rematd.planner.steps import AllocatorFigures, ModeSeconds, StepObservation
from rematd.planner.units import MODE_LETTERS, MODES_BY_LABEL, MODES_BY_LETTER, Mode, Shape, letters

__all__ = [
    "MODES_BY_LABEL",
    "MODES_BY_LETTER",
    "MODE_LETTERS",
    "AllocatorFigures",
    "BlockCost",
    "Choice",
    "Controller",
    "ControllerConfig",
    "Mode",
    "ModeCost",
    "ModeSeconds",
    "Option",
    "Plan",
    "PlannerSession",
    "Profile",
    "Shape",
    "ShapePlan",
    "Size",
    "StepObservation",
    "Term",
    "blocks_of",
    "checkpoint_every_of",
    "every_k_blocks",
    "frequency_of",
    "letters",
    "oom_risk",
    "peak_in_order",
    "peak_of",
    "predict_overhead_ratio",
    "predict_peak_bytes",
    "solve",
    "solve_min_recompute",
]
