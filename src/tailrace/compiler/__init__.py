"""Pipeline -> Plan: validation, fusion, bounded edges, rendering."""

from .plan import (
    ABANDON_CAP,
    CALLS_IN_FLIGHT,
    DEFAULT_QUEUE,
    MAX_MICROBATCH,
    MAX_PUSH,
    PUSHES_IN_FLIGHT,
    Edge,
    Execution,
    Plan,
    PlanOp,
    PlanStage,
    compile_pipeline,
)
from .render import FORMATS, render

__all__ = ["ABANDON_CAP", "CALLS_IN_FLIGHT", "DEFAULT_QUEUE", "FORMATS", "MAX_MICROBATCH",
           "MAX_PUSH", "PUSHES_IN_FLIGHT", "Edge", "Execution", "Plan", "PlanOp", "PlanStage",
           "compile_pipeline", "render"]
