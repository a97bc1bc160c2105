"""tailrace: LLM inference pipelines as compiled dataflows under tail-latency SLOs.

    import tailrace as tr
    p = tr.Pipeline("double")
    p.source(range(10)).map(lambda x: 2 * x).sink(out := [])
    result = tr.run(p)
"""

from .api import BatchSpec, Contract, ErrorRecord, Pipeline, StageSpec, Stream
from .compiler import Plan, compile_pipeline
from .errors import InputError, PlanError, RunInterrupted, StageTimeout, TailraceError
from .observability import RunStats, StageStats, format_stats
from .operators import Operator
from .runtime import RunResult, run

__version__ = "0.1.0"

__all__ = [
    "BatchSpec", "Contract", "ErrorRecord", "InputError", "Operator", "Pipeline", "Plan",
    "PlanError", "RunInterrupted", "RunResult", "RunStats", "StageSpec", "StageStats",
    "StageTimeout", "Stream", "TailraceError", "compile_pipeline", "format_stats", "run",
]
