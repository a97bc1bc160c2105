"""The record lifecycle on Ray (``tr.run(runtime="ray")``, and requests served by a
``PipelineService(runtime="ray")``): random pipelines and faults, sometimes admission,
callers that cancel, a stop in flight, sometimes a stage actor killed mid-run, sometimes
elastic stages (``replicas: {min, max}``) scaling out and in while records flow. One Ray
session for the whole test session (``ray_session``); few examples, Ray runs are slow."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from .harness import fault_settings
from .runners import run_ray, run_service
from .strategies import scenarios

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def eager_autoscaling():
    """Elastic stages scale within these short runs (defaults: 1 s up, 10 s down)."""
    from tailrace.runtime.ray import autoscale as driver  # the scaling constants live there

    saved = driver.SCALE_TICK_S, driver.SCALE_UP_S, driver.SCALE_DOWN_S
    driver.SCALE_TICK_S, driver.SCALE_UP_S, driver.SCALE_DOWN_S = 0.02, 0.02, 0.1
    yield
    driver.SCALE_TICK_S, driver.SCALE_UP_S, driver.SCALE_DOWN_S = saved


@fault_settings("ray")
@given(data=st.data())
def test_ray_runs_keep_the_record_lifecycle(ray_session, data):
    sc = data.draw(scenarios("ray", max_n=16, max_steps=4), label="scenario")
    run_ray(sc, ray_session).check(sc)


@fault_settings("ray-service")
@given(data=st.data())
def test_served_requests_on_ray_keep_the_record_lifecycle(ray_session, data):
    policy = data.draw(st.sampled_from(["simultaneous", "fcfs", "slo"]), label="policy")
    sc = data.draw(scenarios("ray-service", policy=policy, max_n=12, max_steps=4),
                   label="scenario")
    run_service(sc, ray=ray_session).check(sc)
