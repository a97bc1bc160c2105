"""The local (single-process, asyncio) runtime."""

from .channel import Channel
from .executor import MAX_MICROBATCH, LocalRun, collect_batch

__all__ = ["MAX_MICROBATCH", "Channel", "LocalRun", "collect_batch"]
