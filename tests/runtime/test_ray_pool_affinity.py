"""An engine pool hosted by an engine actor on Ray routes by prefix and session as a local
one does (the actor runs the same pool code; the replicas' engine is a fake that reports
what it had cached)."""

from __future__ import annotations

import contextlib
import uuid

import pytest

from tailrace.engines import GenerationRequest
from tests.engines.test_pool import turn  # one conversation shape for both tests
from tests.runtime.ray_engine_fakes import actor_pool_statistics, cluster_engine, kill_engine


@pytest.fixture
def pool(ray_session):
    name = f"p{uuid.uuid4().hex[:8]}"
    spec = {"backend": "prefix", "model": "prefix", "replicas": 2, "isolation": "thread",
            "dispatch": "prefix_affinity", "max_wait_ms": 0}
    eng = cluster_engine(name, spec)
    yield eng, name, spec
    with contextlib.suppress(ValueError):
        kill_engine(name, spec)


def test_a_ray_hosted_pool_keeps_each_conversation_on_its_replica(pool):
    eng, name, spec = pool
    a1, b1 = eng.generate([turn("ann", 1), turn("bob", 1)])
    assert a1.extra["replica"] != b1.extra["replica"]  # least work spread the first turns
    for k in (2, 3):
        a, b = eng.generate([turn("ann", k), turn("bob", k)])
        assert (a.extra["replica"], b.extra["replica"]) == (a1.extra["replica"],
                                                             b1.extra["replica"])
        assert a.extra["cached_tokens"] > 100 and b.extra["cached_tokens"] > 100
    stats = actor_pool_statistics(name, spec)
    assert [r.requests for r in stats.replicas] == [3, 3]
    assert all(r.cached_tokens > 0 and 0 < r.cache_hit_ratio < 1 for r in stats.replicas)


def test_sessions_cross_the_actor_and_stick(pool):
    eng, _, _ = pool
    short = lambda s: GenerationRequest(  # noqa: E731 - no shared prefix to follow
        messages=({"role": "user", "content": f"hi from {s}"},), session=s)
    _, y = eng.generate([short("s1"), short("s2")])
    assert [eng.generate([short("s2")])[0].extra["replica"] for _ in range(3)] == \
        [y.extra["replica"]] * 3
