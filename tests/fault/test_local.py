"""The record lifecycle on the local runtime (``tr.run``), under random faults: every
record ends exactly once, every ticket is released once, channels stay within their
bounds, nothing is left running (see docs/architecture.md)."""

from hypothesis import given

from .harness import fault_settings
from .runners import run_in_child, run_local
from .strategies import scenarios


@fault_settings("local")
@given(sc=scenarios("local"))
def test_local_runs_keep_the_record_lifecycle(sc):
    run_local(sc).check(sc)


@fault_settings("interrupt")
@given(sc=scenarios("local", interrupt=True))
def test_an_interrupted_run_duplicates_nothing_and_leaks_nothing(sc):
    """Ctrl-C while an operator works (in a child process): ``RunInterrupted``; no record
    ended twice, every ticket back, no thread left."""
    run_in_child(sc).check(sc)
