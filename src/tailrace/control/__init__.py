"""The control plane: admission at pipeline ingress.

``admission`` holds the request lifecycle and the policy interface, ``policies`` the
built-in policies and their registry, ``slo`` pipeline SLOs and the cost model, ``gate``
the thread-safe door the runtime awaits. Engine pools live with the engines
(``tailrace.engines.pool``).
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
from .slo import PRIORITIES, CostModel, PipelineSLO

__all__ = [
    "AdmissionGate",
    "DEADLINE_EXPIRED", "DEADLINE_UNMEETABLE", "POLICIES", "PRIORITIES", "QUEUE_FULL",
    "AdmissionPolicy", "AdmissionRejected", "AdmissionStatistics", "CostModel", "Decision",
    "FCFSPolicy", "PipelineSLO", "Rejection", "Request", "SLOPolicy", "SimultaneousPolicy",
    "Ticket", "Verdict", "make_policy", "policy_options", "register_policy",
]
