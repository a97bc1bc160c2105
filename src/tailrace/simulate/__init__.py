"""Capacity planning on a virtual clock: ``tailrace profile`` measures a pipeline's
stages and engines, ``tailrace simulate`` runs its compiled plan under the real admission
policy, engine pools and engine scheduler with durations drawn from the profile
(docs/simulate.md).
"""

from .events import Loop
from .profile import EngineProfile, LinearModel, Profile, ProfileError, StageProfile, load_profile
from .simulator import Config, Simulation
from .workload import Arrival, WorkloadError, parse_rates, poisson, read_trace

__all__ = ["Arrival", "Config", "EngineProfile", "LinearModel", "Loop", "Profile",
           "ProfileError", "Simulation", "StageProfile", "WorkloadError", "load_profile",
           "parse_rates", "poisson", "read_trace"]
