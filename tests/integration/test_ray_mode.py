"""Ray mode on a two-node cluster on this machine: units spread one per node, a producer
pinned to one node, a consumer pinned to the other, every row delivered exactly once."""

from __future__ import annotations

import pytest
import torch
from tq_fixtures import ray_cluster, wait_until

import tq_stream as tq

__all__ = ["ray_cluster"]  # the session-scoped fixture, imported for pytest

pytestmark = [pytest.mark.integration, pytest.mark.ray, pytest.mark.timeout(180)]

N = 48


def _tasks():
    """The producer and consumer Ray tasks. Made here, not at module level: Ray workers
    cannot import a test module, so the functions must be pickled by value."""

    def produce(stream: tq.Stream, n: int) -> int:
        """Writes through the Stream handle it received (pickled)."""
        import ray

        node = ray.get_runtime_context().get_node_id()
        w = stream.writer("train")
        for lo in range(0, n, 8):
            keys = [f"k_{i}" for i in range(lo, lo + 8)]
            x = torch.arange(lo, lo + 8, dtype=torch.float32)[:, None]
            w.put(keys, {"x": x, "o": keys}, tags=[{"node": node}] * 8)
        stream.close_partition("train")
        return n

    def consume() -> tuple[str, list[str], bool]:
        """Joins by name (tq.connect()) and reads through a StreamingDataLoader."""
        import ray

        stream = tq.connect(config=tq.StreamConfig(timeout=60))
        ds = tq.StreamingDataset(stream, "train", "learner", ["x", "o"], batch_size=5)
        keys, ok = [], True
        for batch in tq.StreamingDataLoader(ds):
            meta = tq.batch_meta(batch)
            ok &= batch["x"].flatten().tolist() == [float(k[2:]) for k in meta.keys]
            ok &= batch["o"].tolist() == list(meta.keys)
            keys += meta.keys
        stream.close()
        return ray.get_runtime_context().get_node_id(), keys, ok

    return produce, consume


def test_producer_and_consumer_on_different_nodes(ray_cluster):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node_a, node_b = ray_cluster
    produce, consume = _tasks()
    stream = tq.init(mode="ray", storage_units=2, config=tq.StreamConfig(timeout=60),
                     allow_insecure_tcp=True)  # two nodes, no CURVE: an explicit opt-in
    names = [f"tq_stream_unit{i}" for i in range(2)] + ["tq_stream_controller"]
    try:
        assert sorted(stream._owner.unit_nodes) == sorted(ray_cluster), "one unit per node"
        # This process shares the host with every actor: it calls them over unix sockets.
        assert stream.address.startswith("tcp://")
        assert stream._backend.controller()._rpc.address.startswith("unix://")
        assert all(u._remote._rpc.address.startswith("unix://")
                   for u in stream._backend.units())

        def on(node: str) -> dict:
            return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}

        produced = ray.remote(num_cpus=0)(produce).options(**on(node_a)).remote(stream, N)
        consumed = ray.remote(num_cpus=0)(consume).options(**on(node_b)).remote()
        assert ray.get(produced, timeout=120) == N
        node, keys, ok = ray.get(consumed, timeout=120)
        assert node == node_b and ok
        assert sorted(keys) == sorted(f"k_{i}" for i in range(N)), "exactly once"
        stats = stream.stats()["train"]
        assert stats["tasks"]["learner"]["acked"] == N and stats["rows"] == 0
    finally:
        stream.close()

    def gone(name: str) -> bool:
        try:
            ray.get_actor(name, namespace="tq_stream")
        except ValueError:
            return True
        return False

    assert wait_until(lambda: all(gone(n) for n in names), 30), "shutdown kills the actors"
