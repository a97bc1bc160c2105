"""Engine pools: N replicas of one engine behind one batching, dispatching, retrying front.

``pool`` the pool and the process-wide pools by engine name; ``batching`` cross-caller
batches and ``dispatch`` which replica gets one (pure policies); ``state`` the pool's
bookkeeping; ``replicas`` the transports (a spawned process, or threads in this one),
``messages`` what they carry, ``engine`` what a replica does with its own engine (and
the replica process).
"""

from .batching import Batcher
from .dispatch import LeastOutstandingWork, RoundRobin, make_dispatch
from .pool import EnginePool, check_options, close_pools, get_pool, pool_statistics
from .state import PoolStatistics, ReplicaStatistics

__all__ = ["Batcher", "EnginePool", "LeastOutstandingWork", "PoolStatistics",
           "ReplicaStatistics", "RoundRobin", "check_options", "close_pools", "get_pool",
           "make_dispatch", "pool_statistics"]
