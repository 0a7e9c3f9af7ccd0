"""A node removed from a three-node Ray cluster (``ray.cluster_utils.Cluster``, a
storage unit on each node) while a consumer streams (issue 20, item 11): the rows of
the lost node's unit are counted lost, the consumer keeps getting batches from the
other units within a bound, and the writer places new rows on the live units."""

from __future__ import annotations

import time

import pytest
from fault_kit import UNIT_TIMEOUT, Ledger, wait_until
from fault_workers import values

import tq_stream as tq

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.integration, pytest.mark.ray, pytest.mark.timeout(300)]
P = "p"
CONFIG = tq.StreamConfig(timeout=20.0, lease_timeout=2.0)
BOUND = 60.0  # seconds a batch may take after the node is gone (liveness, not speed)


@pytest.fixture  # each test removes a node: a fresh cluster each
def three_nodes():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, namespace="tq_stream", log_to_driver=False)
        cluster.wait_for_nodes(timeout=60)
        assert len([n for n in ray.nodes() if n["Alive"]]) == 3
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def _put(ledger: Ledger, prefix: str, n: int) -> list[str]:
    keys = [f"{prefix}_{i}" for i in range(n)]
    for lo in range(0, n, 8):
        ledger.put(keys[lo : lo + 8], {"x": values(keys[lo : lo + 8])})
    return keys


def _timed(batches, bound: float):
    """``batches``, failing when one takes longer than ``bound`` seconds."""
    while True:
        start = time.monotonic()
        try:
            batch = next(batches)
        except StopIteration:
            return
        took = time.monotonic() - start
        assert took < bound, f"a batch took {took:.1f} s after the node was removed"
        yield batch


@pytest.mark.parametrize("when", ["streaming", "before_first_batch"])
def test_a_removed_node_s_rows_are_lost_and_the_consumer_goes_on(three_nodes, when):
    """The node of a unit holding rows of the consumer's next step is removed, once the
    consumer has had a batch or before its first: the next batch comes within BOUND."""
    cluster = three_nodes
    stream = tq.init(mode="ray", storage_units=3, config=CONFIG, name="tq_node_loss",
                     unit_timeout=2 * UNIT_TIMEOUT, allow_insecure_tcp=True)
    try:
        owner = stream._owner
        head = cluster.head_node.node_id
        nodes = owner.unit_nodes
        assert len(set(nodes)) == 3, nodes  # a unit on each node
        stream.create_partition(P, consumers=["t"])
        ledger = Ledger(stream, P)
        before = _put(ledger, "a", 48)
        ds = tq.StreamingDataset(stream, P, "t", ["x"], batch_size=4)
        batches = ledger.take(iter(tq.StreamingDataLoader(ds)))
        if when == "streaming":
            next(batches)  # the task counts the rows lost from now on
        else:
            stream.client().register_task(P, "t", ["x"], batch_size=4,
                                          lease_timeout=CONFIG.lease_timeout)
        step = before[4:8] if when == "streaming" else before[:4]
        unit = next(ledger.unit_of[k] for k in step if nodes[ledger.unit_of[k]] != head)
        node = next(n for n in cluster.worker_nodes if n.node_id == nodes[unit])
        cluster.remove_node(node, allow_graceful=False)
        removed = time.monotonic()
        timed = _timed(batches, BOUND)
        next(timed)  # the next batch: rows of the other units
        print(f"node removed -> next batch: {time.monotonic() - removed:.1f} s")
        ctrl = stream._backend.controller()
        assert wait_until(lambda: ctrl.dead_units() == [unit], BOUND), "not declared lost"
        after = _put(ledger, "b", 32)  # the writer places on the live units
        assert unit not in {ledger.unit_of[k] for k in after}
        stream.close_partition(P)
        for _ in timed:
            pass
        missing = ledger.check("t", dead_unit=unit)
        assert missing and missing <= set(before) and not missing & set(after)
        # a row read but not acked when its unit died is delivered and counted lost
        assert len(missing) <= ledger.lost("t") <= len(missing) + 8
    finally:
        stream.close()
