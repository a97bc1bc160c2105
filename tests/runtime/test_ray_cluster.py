"""Multi-node placement on Ray's own test cluster (``ray.cluster_utils.Cluster``: three
nodes, each with its own raylet, on this machine): ``strategy: spread`` puts a stage's
replicas on different nodes, and the run's output is the same as on one node.

The cluster cannot share the process with the session's single-node Ray, so this module
shuts that one down first and starts it again afterwards (``num_cpus=2``)."""

from collections import Counter

import pytest

import tailrace as tr
from tests.conftest import multi_node_cluster

pytestmark = pytest.mark.slow


def square(x):
    return x * x


def node_of(x):
    import ray

    return ray.get_runtime_context().get_node_id()


@pytest.fixture(scope="module")
def cluster():
    with multi_node_cluster() as c:
        yield c


def test_spread_places_replicas_on_different_nodes(cluster):
    import ray

    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(nodes) == 3
    p = tr.Pipeline("spread")
    (p.source(range(3000)).map(square, id="sq", replicas=3)
     .map(node_of, id="where", replicas=3).sink())
    result = tr.run(p, runtime="ray", placement={"*": {"strategy": "spread"}})
    assert len(result.outputs) == 3000 and not result.errors
    placed = result.stats["sq"].nodes
    assert len(placed) == 3 and set(placed) == nodes  # one replica per node
    # the records really ran there: every node appears among the operator's answers
    assert set(result.outputs) == nodes


def test_placement_declared_on_the_stage_contract(cluster, tmp_path):
    """The YAML/contract form: `placement:` on a stage, no run-time option."""
    import ray

    p = tr.Pipeline("spread-contract")
    (p.source(range(600)).map(node_of, id="where", replicas=3,
                              placement={"strategy": "spread"}).sink())
    result = tr.run(p, runtime="ray")
    assert len(result.outputs) == 600 and not result.errors
    assert set(result.outputs) == {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def test_pack_and_resources_on_a_cluster_give_the_same_output(cluster):
    p = tr.Pipeline("pack")
    p.source(range(2000)).map(square, id="sq", replicas=2).map(lambda x: x % 97).sink()
    result = tr.run(p, runtime="ray", placement={"sq": {"num_cpus": 1}})
    assert Counter(result.outputs) == Counter(x * x % 97 for x in range(2000))
    # each replica reserved one CPU: two hosts of their own
    assert len(result.stats["sq"].nodes) == 2
