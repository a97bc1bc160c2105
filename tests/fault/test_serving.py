"""The record lifecycle through ``PipelineService`` under each admission policy: every
request answered exactly once (never a timeout), callers cancelling mid-record,
admission rejections, a stop with requests in flight; tickets back to 0 once idle."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from .harness import fault_settings
from .runners import run_service
from .strategies import scenarios


@pytest.mark.parametrize("policy", ["simultaneous", "fcfs", "slo"])
@fault_settings("service")
@given(data=st.data())
def test_served_requests_keep_the_record_lifecycle(policy, data):
    sc = data.draw(scenarios("service", policy=policy), label="scenario")
    run_service(sc).check(sc)


@pytest.mark.parametrize("policy", ["simultaneous", "fcfs"])
@fault_settings("service")
@given(data=st.data())
def test_requests_on_the_services_own_loop_keep_the_record_lifecycle(policy, data):
    # as under ``tailrace serve``: the pipeline runs on its callers' loop (start(loop))
    sc = data.draw(scenarios("service", policy=policy), label="scenario")
    run_service(sc, here=True).check(sc)
