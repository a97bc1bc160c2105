"""Hypothesis profiles of the fault suite, chosen by ``TAILRACE_FAULT_PROFILE``.

- ``ci`` (default): deterministic (``derandomize``), no deadline; sized so the whole
  directory runs in under 3 minutes on two cores (``make test``).
- ``chaos``: random, many more examples, failures saved in the example database
  (``make chaos``, about 20 minutes).

Each profile has one child per target (``ci-local``, ``chaos-ray``, ...) that sets its
number of examples; tests use ``harness.fault_settings(target)``. The profiles are only
registered, never loaded, so Hypothesis tests elsewhere keep their own settings.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

PROFILES = ("ci", "chaos")
#: examples per test, per target; the serving test runs once per admission policy
EXAMPLES = {
    "ci": {"local": 800, "interrupt": 50, "service": 250, "ray": 25, "ray-service": 12,
           "cluster": 4, "pools": 60},
    "chaos": {"local": 7_000, "interrupt": 600, "service": 2_500, "ray": 300,
              "ray-service": 150, "cluster": 40, "pools": 1_000},
}

_common = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                      HealthCheck.filter_too_much])
settings.register_profile("ci", derandomize=True, database=None, **_common)
settings.register_profile("chaos", derandomize=False, **_common)
for _name in PROFILES:
    for _target, _n in EXAMPLES[_name].items():
        settings.register_profile(f"{_name}-{_target}", settings.get_profile(_name),
                                  max_examples=_n)

_chosen = os.environ.get("TAILRACE_FAULT_PROFILE", "ci")
if _chosen not in PROFILES:
    raise ValueError(f"TAILRACE_FAULT_PROFILE={_chosen!r}: choose one of {', '.join(PROFILES)}")


@pytest.fixture(autouse=True)
def scripted_backend(monkeypatch):
    """The escalate and tools steps' scripted engine backends, registered for each fault
    test and taken out after it (the process-wide backend table must not leak them to
    other tests)."""
    from tailrace.engines import BACKENDS

    from .harness import SCRIPTED, TOOLS

    monkeypatch.setitem(BACKENDS, SCRIPTED,
                        ("tests.fault.harness", "ScriptedEngine", ("generate",)))
    monkeypatch.setitem(BACKENDS, TOOLS,
                        ("tests.fault.harness", "ToolScriptedEngine", ("generate",)))
