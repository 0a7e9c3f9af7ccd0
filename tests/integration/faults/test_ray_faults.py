"""Faults on a simulated two-node Ray cluster (``ray.cluster_utils.Cluster``): a storage
unit actor killed mid-stream (lost; re-created with ``restart_units``), a consumer actor
killed while it holds a share, the controller actor killed (restarted from its
checkpoint), and a worker node removed (its unit re-created on the live node; last:
the cluster keeps one node)."""

from __future__ import annotations

import os
import time

import pytest
import torch

import tq_stream as tq
from tests.helpers.fault_kit import UNIT_TIMEOUT, Ledger, kill, wait_until
from tests.helpers.fault_workers import values
from tests.helpers.tq_fixtures import two_node_cluster_of
from tq_stream.deploy.ray_actor import controller_info
from tq_stream.errors import ConfigError

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.integration, pytest.mark.ray, pytest.mark.timeout(240)]
P = "p"
CONFIG = tq.StreamConfig(timeout=20.0, lease_timeout=2.0)


@pytest.fixture(scope="module")
def ray_cluster():
    """This module's own cluster, stopped before other modules start theirs (Ray allows
    one connection per driver)."""
    with two_node_cluster_of() as (cluster, nodes):
        yield cluster, nodes


RECOVERY = 180.0  # seconds a re-created actor may take (a new worker imports torch)


def _start(**options: object) -> tq.Stream:
    return tq.init(mode="ray", storage_units=2, config=CONFIG, name="tq_faults",
                   unit_timeout=2 * UNIT_TIMEOUT,
                   allow_insecure_tcp=True,  # two nodes of a test cluster, no CURVE
                   **options)


def _checked(batches):
    for batch in batches:
        keys = list(tq.batch_meta(batch).keys)
        assert torch.equal(batch["x"], values(keys)), "a row came back with wrong bytes"
        yield batch


def _put(ledger: Ledger, prefix: str, n: int) -> list[str]:
    keys = [f"{prefix}_{i}" for i in range(n)]
    for lo in range(0, n, 8):
        ledger.put(keys[lo : lo + 8], {"x": values(keys[lo : lo + 8])})
    return keys


def test_a_killed_unit_actor_is_lost_and_the_stream_goes_on(ray_cluster):

    stream = _start()
    try:
        assert len(set(stream.owner.unit_nodes)) == 2  # one unit per node
        stream.create_partition(P, consumers=["t"])
        ledger = Ledger(stream, P)
        _put(ledger, "a", 32)
        ds = tq.StreamingDataset(stream, P, "t", ["x"], batch_size=4)
        batches = ledger.take(tq.StreamingDataLoader(ds))
        for _ in range(2):
            next(batches)
        ray.kill(stream.owner.actors()[1], no_restart=True)
        ctrl = stream.connection.controller()
        assert wait_until(lambda: ctrl.dead_units() == [1], 20 * UNIT_TIMEOUT)
        after = _put(ledger, "b", 16)
        assert {ledger.unit_of[k] for k in after} == {0}  # nothing placed on the dead unit
        stream.close_partition(P)
        for batch in batches:
            keys = list(tq.batch_meta(batch).keys)
            assert torch.equal(batch["x"], values(keys))
        missing = ledger.check("t", dead_unit=1)
        assert missing and not missing & set(after)
    finally:
        stream.close()


def test_a_killed_consumer_actor_s_share_goes_to_the_next_reader(ray_cluster):
    class Consumer:
        def take(self, stream: tq.Stream) -> list[str]:
            client = stream.client()
            meta = client.get_meta(P, "t", step=0, timeout=30)
            client.get_data(meta)
            self._keep = (stream, client)  # the session stays open until the kill
            return list(meta.keys)

    stream = _start()
    try:
        stream.create_partition(P, consumers=["t"])
        ledger = Ledger(stream, P)
        _put(ledger, "a", 8)
        client = stream.client()
        client.register_task(P, "t", ["x"], batch_size=4, lease_timeout=CONFIG.lease_timeout)
        actor = ray.remote(num_cpus=0)(Consumer).remote()
        held = ray.get(actor.take.remote(stream), timeout=120)
        ray.kill(actor, no_restart=True)
        stream.close_partition(P)
        ds = tq.StreamingDataset(stream, P, "t", ["x"], batch_size=4)
        got = [list(tq.batch_meta(b).keys) for b in ledger.take(tq.StreamingDataLoader(ds))]
        assert got[0] == held  # the dead consumer's share, unchanged, comes first
        ledger.check("t", dead_unit=None)
        assert set(ledger.delivered) == set(ledger.unit_of)
        assert stream.stats()[P]["tasks"]["t"]["acked"] == 8
    finally:
        stream.close()


def _replaced(stream: tq.Stream, unit: int, old_pid: int) -> bool:
    """Unit ``unit`` serves from a new actor and the controller takes rows there again."""
    return stream.owner.pids[unit] != old_pid and \
        stream.connection.controller().dead_units() == []


def test_a_killed_unit_actor_is_re_created_and_takes_rows_again(ray_cluster):
    """restart_units=True: a unit actor that dies (SIGKILL) is re-created under the same
    unit index at a new address; new rows go there (also from a producer actor that knew
    the old address) and are delivered, only the old unit's rows are lost."""

    class Producer:  # defined here: Ray ships it by value (the workers lack this module)
        """Keeps the Stream it was given: its unit clients predate the move."""

        def put(self, stream: tq.Stream | None, keys: list[str], x: torch.Tensor) -> list:
            self._stream = stream or self._stream
            for lo in range(0, len(keys), 8):
                self._stream.writer(P).put(keys[lo : lo + 8], {"x": x[lo : lo + 8]})
            return self._stream.kv.meta(keys, partition=P).unit.tolist()

    stream = _start(restart_units=True)
    try:
        stream.create_partition(P, consumers=["t"])
        ledger = Ledger(stream, P)
        producer = ray.remote(num_cpus=0)(Producer).remote()

        def produce(keys: list[str], first: bool = False) -> list[str]:
            units = ray.get(producer.put.remote(stream if first else None, keys,
                                                values(keys)), timeout=RECOVERY)
            ledger.unit_of.update(zip(keys, units, strict=True))
            return keys

        before = _put(ledger, "a", 32) + produce([f"c_{i}" for i in range(16)], first=True)
        assert {ledger.unit_of[k] for k in before} == {0, 1}
        ds = tq.StreamingDataset(stream, P, "t", ["x"], batch_size=4)
        batches = ledger.take(_checked(tq.StreamingDataLoader(ds)))
        for _ in range(2):
            next(batches)
        with pytest.raises(ConfigError, match=r"i must be a unit index in \[0, 2\), got 2"):
            stream.owner.restart_unit(2)
        old_pid, old_address = stream.owner.pids[1], stream.owner.unit_infos[1]["address"]
        kill(old_pid)
        assert wait_until(lambda: _replaced(stream, 1, old_pid), RECOVERY), "not re-created"
        assert stream.owner.unit_infos[1]["address"] != old_address
        after = _put(ledger, "b", 32)
        assert 1 in {ledger.unit_of[k] for k in after}  # the new unit takes rows
        moved = produce([f"d_{i}" for i in range(32)])
        assert 1 in {ledger.unit_of[k] for k in moved}  # the producer found it too
        stream.close_partition(P)
        for _ in batches:
            pass
        missing = ledger.check("t", dead_unit=1)
        assert missing <= set(before) and not missing & set(after + moved)
        assert set(after + moved) <= set(ledger.delivered)
    finally:
        stream.close()


def test_restart_controller_needs_a_checkpoint_in_ray_mode(ray_cluster):
    with pytest.raises(ConfigError, match="restart_controller=True needs checkpoint_interval"):
        _start(restart_controller=True)


def test_a_killed_controller_actor_restarts_from_its_checkpoint(ray_cluster):
    """checkpoint_interval + restart_controller: a controller actor that dies is
    re-created at the same address (pinned to the driver's node, where its checkpoint
    file is) from its last checkpoint, with the driver's annotations; it re-attaches the
    units and a loader carries on through its retries. Only acks before the checkpoint
    are asserted on."""
    stream = _start(checkpoint_interval=0.5, restart_controller=True,
                    annotations={"note": "kept"})
    try:
        owner = stream.owner
        assert owner.controller_node == ray.get_runtime_context().get_node_id()
        stream.create_partition(P, consumers=["t"])
        ledger = Ledger(stream, P)
        _put(ledger, "a", 32)
        ds = tq.StreamingDataset(stream, P, "t", ["x"], batch_size=4, prefetch=1)
        loader = tq.StreamingDataLoader(ds)
        batches = ledger.take(_checked(loader))
        for _ in range(2):
            next(batches)
        loader.ack()
        acked = set(ledger.delivered)
        _await_checkpoint(owner.checkpoint_path)
        old = owner.pids[-1]
        kill(old)
        assert wait_until(lambda: owner.restarts, RECOVERY), "the controller was not restarted"
        info = owner.restarts[0]
        assert owner.pids[-1] != old and info["recovery"]["rows_lost"] == 0
        assert controller_info("tq_faults", "tq_stream")["annotations"] == {"note": "kept"}
        after = _put(ledger, "b", 16)  # producers carry on
        stream.close_partition(P)
        later = [list(tq.batch_meta(b).keys) for b in batches]
        assert not acked & {k for keys in later for k in keys}  # acked before: not again
        ledger.check("t", dead_unit=None)
        assert set(ledger.delivered) == set(ledger.unit_of)  # every checkpointed row
        assert set(after) <= set(ledger.delivered)
        print("Ray controller restart:", info)
    finally:
        stream.close()


def _await_checkpoint(path: str) -> None:
    """Wait until the controller wrote a checkpoint after this call."""
    mark = os.stat(path).st_mtime_ns if os.path.exists(path) else 0
    assert wait_until(lambda: os.path.exists(path) and os.stat(path).st_mtime_ns != mark,
                      30.0), "no checkpoint written"


def test_a_removed_node_s_unit_is_re_created_on_the_live_node(ray_cluster):
    """restart_units=True: the node of unit 1 is removed from the cluster; the unit is
    re-created on the remaining node and takes new rows. Runs last: the cluster keeps
    one node."""
    cluster, (head, worker) = ray_cluster
    stream = _start(restart_units=True)
    try:
        owner = stream.owner
        assert owner.controller_node == head  # the driver's node: the controller stays
        unit = owner.unit_nodes.index(worker)
        stream.create_partition(P, consumers=["t"])
        ledger = Ledger(stream, P)
        before = _put(ledger, "a", 32)
        ds = tq.StreamingDataset(stream, P, "t", ["x"], batch_size=4)
        batches = ledger.take(_checked(tq.StreamingDataLoader(ds)))
        next(batches)  # the task counts the rows lost from now on
        old_pid = owner.pids[unit]
        node = next(n for n in cluster.worker_nodes if n.node_id == worker)
        removed = time.monotonic()
        cluster.remove_node(node, allow_graceful=False)
        assert wait_until(lambda: _replaced(stream, unit, old_pid), RECOVERY), \
            "not re-created"
        print(f"node removed -> unit re-created: {time.monotonic() - removed:.1f} s")
        assert owner.unit_nodes[unit] == head
        after = _put(ledger, "b", 32)
        assert unit in {ledger.unit_of[k] for k in after}
        stream.close_partition(P)
        for _ in batches:
            pass
        missing = ledger.check("t", dead_unit=unit)
        assert missing <= set(before) and not missing & set(after)
        assert set(after) <= set(ledger.delivered)
    finally:
        stream.close()
