"""Faults on a simulated two-node Ray cluster (``ray.cluster_utils.Cluster``): a storage
unit actor killed mid-stream, and a consumer actor killed while it holds a share."""

from __future__ import annotations

import pytest
import torch
from fault_kit import UNIT_TIMEOUT, Ledger, wait_until
from fault_workers import values
from tq_fixtures import two_node_cluster

import tq_stream as tq

pytestmark = [pytest.mark.integration, pytest.mark.ray, pytest.mark.timeout(240)]
P = "p"
CONFIG = tq.StreamConfig(timeout=20.0, lease_timeout=2.0)


@pytest.fixture(scope="module")
def ray_cluster():
    """This module's own cluster, stopped before other modules start theirs (Ray allows
    one connection per driver)."""
    with two_node_cluster() as nodes:
        yield nodes


def _start() -> tq.Stream:
    return tq.init(mode="ray", storage_units=2, config=CONFIG, name="tq_faults",
                   unit_timeout=2 * UNIT_TIMEOUT,
                   allow_insecure_tcp=True)  # two nodes of a test cluster, no CURVE


def _put(ledger: Ledger, prefix: str, n: int) -> list[str]:
    keys = [f"{prefix}_{i}" for i in range(n)]
    for lo in range(0, n, 8):
        ledger.put(keys[lo : lo + 8], {"x": values(keys[lo : lo + 8])})
    return keys


def test_a_killed_unit_actor_is_lost_and_the_stream_goes_on(ray_cluster):
    import ray

    stream = _start()
    try:
        assert len(set(stream._owner.unit_nodes)) == 2  # one unit per node
        stream.create_partition(P, consumers=["t"])
        ledger = Ledger(stream, P)
        _put(ledger, "a", 32)
        ds = tq.StreamingDataset(stream, P, "t", ["x"], batch_size=4)
        batches = ledger.take(tq.StreamingDataLoader(ds))
        for _ in range(2):
            next(batches)
        ray.kill(stream._owner._actors[1], no_restart=True)
        ctrl = stream._backend.controller()
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
    import ray

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
