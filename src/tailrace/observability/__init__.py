"""Statistics and rendering; imported by every layer, imports none of them."""

from .stats import Histogram, HistogramStats, RunStats, StageMeter, StageStats
from .table import format_stats

__all__ = ["Histogram", "HistogramStats", "RunStats", "StageMeter", "StageStats", "format_stats"]
