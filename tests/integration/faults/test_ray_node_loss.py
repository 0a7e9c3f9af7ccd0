"""A node removed from a three-node Ray cluster (``ray.cluster_utils.Cluster``, a
storage unit on each node) while a consumer streams (issue 20, item 11).

- The rows of the lost node's unit are counted lost, the consumer keeps getting
  batches from the other units within a bound, and the writer places new rows on the
  live units: the driver as the consumer, every node on this host (unix sockets).
- The same with the consumer a Ray actor on another node and each node its own host
  (``own_hosts``: tcp between nodes, no shared memory, as on a real cluster): a read
  from the lost unit got no reply until its whole timeout (zmq does not tell that a
  peer died); it stops once the controller declares the unit lost.
- The node of the controller (``tq.init`` called by an actor there) leaves: the
  consumer's wait ends with DeploymentGone naming the deployment, not its timeout.
"""

from __future__ import annotations

import time

import pytest

import tq_stream as tq
from tests.helpers.fault_kit import UNIT_TIMEOUT, Ledger, own_hosts, wait_until
from tests.helpers.fault_kit import three_nodes as three_node_cluster
from tests.helpers.fault_workers import values
from tq_stream.errors import DeploymentGone

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.integration, pytest.mark.ray, pytest.mark.timeout(300)]
P = "p"
CONFIG = tq.StreamConfig(timeout=20.0, lease_timeout=2.0)
BOUND = 60.0  # seconds a batch may take after the node is gone (liveness, not speed)
# Own hosts: a call's timeout well above BOUND, so a read that waits it out fails BOUND.
SLOW = tq.StreamConfig(timeout=120.0, lease_timeout=4.0)
HOSTS_BOUND = 45.0


@pytest.fixture  # each test removes a node: a fresh cluster each
def three_nodes():
    with three_node_cluster() as cluster:
        yield cluster


@pytest.fixture
def three_hosts():
    """Three nodes, each its own host for tq_stream (``fault_kit.own_hosts``)."""
    with three_node_cluster(own_hosts()) as cluster:
        yield cluster


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
        owner = stream.owner
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
        ctrl = stream.connection.controller()
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


# ------------------------------------------- a consumer actor, each node its own host


def _consumer():
    """The consumer actor class. Made here: Ray ships it by value (the workers cannot
    import this module)."""

    class Consumer:
        """Streams task "t" of ``P`` through a StreamingDataLoader in its own process."""

        def __init__(self, stream: tq.Stream, workers: int) -> None:
            ds = tq.StreamingDataset(stream, P, "t", ["x"], batch_size=4)
            self._batches = iter(tq.StreamingDataLoader(ds, num_workers=workers))

        def next(self) -> tuple[list[str] | None, float, str]:
            """The next batch's keys (None at the end or on an error), the seconds the
            loader took for it, and the error ("" if none)."""
            start = time.monotonic()
            try:
                batch = next(self._batches)
            except StopIteration:
                return None, time.monotonic() - start, ""
            except Exception as exc:  # noqa: BLE001 — reported to the test as text
                return None, time.monotonic() - start, f"{type(exc).__name__}: {exc}"
            keys = list(tq.batch_meta(batch).keys)
            ids = [float(k.rsplit("_", 1)[1]) for k in keys]
            assert batch["x"][:, 0].tolist() == ids, "a row came back with wrong bytes"
            return keys, time.monotonic() - start, ""

    return Consumer


def _on(node: str) -> dict:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}


def _leave(cluster, node_id: str, pids: list[int]) -> None:
    """Remove node ``node_id`` and kill ``pids``, its tq_stream processes: a node that
    leaves takes its processes along (here they would outlive their raylet a while)."""
    from tests.helpers.fault_kit import kill

    node = next(n for n in cluster.worker_nodes if n.node_id == node_id)
    cluster.remove_node(node, allow_graceful=False)
    for pid in pids:
        kill(pid)


@pytest.mark.parametrize(("when", "workers"), [("streaming", 1), ("before_first_batch", 0)])
def test_a_consumer_actor_on_another_host_goes_on_when_a_unit_s_node_leaves(three_hosts,
                                                                            when, workers):
    """A consumer actor on one worker node streams (a DataLoader worker or none); the
    other worker node, with a unit holding a third of the rows, leaves. Every later
    batch comes within HOSTS_BOUND (a read from the lost unit waited its whole call
    timeout, SLOW.timeout), the closed partition ends, no row comes twice and the rows
    not delivered lived on the lost unit and are counted lost."""
    cluster = three_hosts
    stream = tq.init(mode="ray", storage_units=3, config=SLOW, name="tq_hosts",
                     unit_timeout=2 * UNIT_TIMEOUT, allow_insecure_tcp=True)
    try:
        nodes = stream.owner.unit_nodes
        assert len(set(nodes)) == 3, nodes  # a unit on each node
        reader, lost = (n.node_id for n in cluster.worker_nodes)
        unit = nodes.index(lost)
        stream.create_partition(P, consumers=["t"])
        ledger = Ledger(stream, P)
        before = _put(ledger, "a", 96)
        assert unit in {ledger.unit_of[k] for k in before}  # the driver is a host of its own
        stream.close_partition(P)
        consumer = ray.remote(num_cpus=0)(_consumer()).options(**_on(reader)).remote(
            stream, workers)
        if when == "streaming":
            keys, _, error = ray.get(consumer.next.remote(), timeout=120)
            assert keys and not error, error
            ledger.delivered.update(keys)
        else:
            ray.get(consumer.__ray_ready__.remote(), timeout=120)
        _leave(cluster, lost, [stream.owner.pids[unit]])
        while True:
            keys, took, error = ray.get(consumer.next.remote(), timeout=2 * SLOW.timeout)
            assert not error, error
            assert took < HOSTS_BOUND, f"a batch took {took:.1f} s after the node left"
            if keys is None:
                break
            ledger.delivered.update(keys)
        missing = ledger.check("t", dead_unit=unit)
        assert missing and missing <= set(before)
    finally:
        stream.close()


def _owner():
    """The actor that calls tq.init (as a framework's driver actor does): the controller
    runs on its node. Made here: Ray ships it by value."""

    class Owner:
        def start(self, **options: object) -> tuple[tq.Stream, str, list[int]]:
            """The deployment's Stream, the controller's node and the pids on this node
            (this actor, the controller, its unit)."""
            import os

            self._stream = tq.init(**options)
            owner = self._stream.owner
            here = owner.controller_node
            pids = [os.getpid()] + [i["pid"] for i in owner._infos if i["node"] == here]
            return self._stream, here, pids

    return Owner


def test_the_controller_s_node_leaving_ends_a_consumer_s_wait_with_deployment_gone(
        three_hosts):
    """An actor on a worker node starts the deployment (its controller runs there); a
    consumer actor on the other worker node streams; the owner's node leaves. The
    consumer's loader raises DeploymentGone naming the deployment within HOSTS_BOUND
    (it waited out its calls' timeouts, then raised WaitTimeout), and so does a call of
    the driver's handle."""
    cluster = three_hosts
    reader, home = (n.node_id for n in cluster.worker_nodes)
    owner = ray.remote(num_cpus=0)(_owner()).options(**_on(home)).remote()
    stream, node, pids = ray.get(owner.start.remote(
        mode="ray", storage_units=3, config=SLOW, name="tq_owned",
        unit_timeout=2 * UNIT_TIMEOUT, allow_insecure_tcp=True), timeout=180)
    assert node == home
    stream.create_partition(P, consumers=["t"])
    _put(Ledger(stream, P), "a", 32)
    consumer = ray.remote(num_cpus=0)(_consumer()).options(**_on(reader)).remote(stream, 0)
    keys, _, error = ray.get(consumer.next.remote(), timeout=120)
    assert keys and not error, error
    _leave(cluster, home, pids)
    while True:  # batches fetched ahead come first
        keys, took, error = ray.get(consumer.next.remote(), timeout=2 * SLOW.timeout)
        assert took < HOSTS_BOUND, f"the consumer waited {took:.1f} s ({error or keys})"
        assert keys is not None or error, "the stream ended instead"
        if error:
            break
    assert error.startswith("DeploymentGone") and "tq_owned" in error, error
    with pytest.raises(DeploymentGone, match="tq_owned"):
        stream.stats()
    stream.close()
