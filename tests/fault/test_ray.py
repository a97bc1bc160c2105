"""The record lifecycle on Ray (``tr.run(runtime="ray")``): random pipelines and faults,
sometimes admission, sometimes a stage actor killed mid-run. One Ray session for the
whole test session (``ray_session``); few examples, Ray runs are slow."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from .harness import fault_settings
from .runners import run_ray
from .strategies import scenarios

pytestmark = pytest.mark.slow


@fault_settings("ray")
@given(data=st.data())
def test_ray_runs_keep_the_record_lifecycle(ray_session, data):
    sc = data.draw(scenarios("ray", max_n=16, max_steps=4), label="scenario")
    run_ray(sc, ray_session).check(sc)
