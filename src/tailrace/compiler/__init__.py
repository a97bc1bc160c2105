"""Pipeline -> Plan: validation, fusion, bounded edges, rendering."""

from .plan import DEFAULT_QUEUE, Edge, Plan, PlanOp, PlanStage, compile_pipeline
from .render import FORMATS, render

__all__ = ["DEFAULT_QUEUE", "FORMATS", "Edge", "Plan", "PlanOp", "PlanStage",
           "compile_pipeline", "render"]
