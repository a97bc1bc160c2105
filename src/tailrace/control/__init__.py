"""The control plane: admission at pipeline ingress, engine pools, batching, dispatch.

``admission`` holds the request lifecycle and the policy interface, ``policies`` the
built-in policies and their registry, ``slo`` pipeline SLOs and the cost model, ``gate``
the thread-safe door the runtime awaits; ``pool`` engine pools of replica processes or
endpoints, with ``batching`` (cross-caller batches) and ``dispatch`` (routing).
"""

from .admission import (
    DEADLINE_EXPIRED,
    DEADLINE_UNMEETABLE,
    QUEUE_FULL,
    AdmissionPolicy,
    AdmissionRejected,
    AdmissionStatistics,
    Decision,
    Rejection,
    Request,
    Ticket,
    Verdict,
)
from .batching import Batcher
from .dispatch import LeastOutstandingWork, RoundRobin, make_dispatch
from .gate import AdmissionGate
from .policies import (
    POLICIES,
    FCFSPolicy,
    SimultaneousPolicy,
    SLOPolicy,
    make_policy,
    policy_options,
    register_policy,
)
from .pool import EnginePool, close_pools, get_pool
from .slo import PRIORITIES, CostModel, PipelineSLO

__all__ = [
    "AdmissionGate", "Batcher", "EnginePool", "LeastOutstandingWork", "RoundRobin",
    "close_pools", "get_pool", "make_dispatch",
    "DEADLINE_EXPIRED", "DEADLINE_UNMEETABLE", "POLICIES", "PRIORITIES", "QUEUE_FULL",
    "AdmissionPolicy", "AdmissionRejected", "AdmissionStatistics", "CostModel", "Decision",
    "FCFSPolicy", "PipelineSLO", "Rejection", "Request", "SLOPolicy", "SimultaneousPolicy",
    "Ticket", "Verdict", "make_policy", "policy_options", "register_policy",
]
