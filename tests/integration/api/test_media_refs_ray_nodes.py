"""Media by reference across Ray nodes: on a two-node ``ray.cluster_utils.Cluster``,
each node its own host (``fault_kit.own_hosts``: tcp between nodes, no shared memory),
the driver (the agent loop, on the head node, the unit there too) puts an image and
hands its MediaRef to an inference-server actor pinned to the other node. The actor
joins by the handle's address, pins and resolves it in one transfer (one unit ``get``,
no ``spans``), is shown holding it in ``stats()``, and releases its pin; the rows of
the group naming the media are acked and the media is freed in the unit."""

from __future__ import annotations

import os
import socket

import pytest
import torch

import tq_stream as tq
from tests.controller.test_shared_fields import images
from tests.helpers.fault_kit import own_hosts
from tests.helpers.tq_fixtures import two_node_cluster_of
from tq_stream.errors import StateError

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.integration, pytest.mark.ray, pytest.mark.timeout(300)]
P = "vlm"
N = 4
CONFIG = tq.StreamConfig(timeout=60.0)


@pytest.fixture(scope="module")
def two_hosts():
    """Two nodes, each its own host; yields [head node id, worker node id]."""
    with two_node_cluster_of(own_hosts()) as (_cluster, nodes):
        yield nodes


def _server():
    """The inference-server actor class. Made here: Ray ships it by value."""

    class InferenceServer:
        def start(self, ref: tq.MediaRef) -> dict:
            """Join the deployment by the handle alone and pin the media."""
            import os
            import socket

            self.stream = tq.connect(ref.address, curve_server_key=ref.curve_server_key)
            self.pin = self.stream.media.pin(ref)
            return {"holder": f"{socket.gethostname()}:{os.getpid()}",
                    "node": ray.get_runtime_context().get_node_id()}

        def generate(self, ref: tq.MediaRef) -> dict:
            """Resolve ``ref``, counting the RPCs each resolve makes."""
            import collections

            from tq_stream.transport import zmq_client

            counter: collections.Counter[str] = collections.Counter()
            original = zmq_client.RpcClient.call

            def call(client, method, args=None, timeout=None):
                counter[method] += 1
                return original(client, method, args, timeout)

            zmq_client.RpcClient.call = call
            try:
                img = self.stream.resolve(ref)["image"]
            finally:
                zmq_client.RpcClient.call = original
            return {"image": img.numpy().tobytes(), "shape": list(img.shape),
                    "calls": dict(counter)}

        def done(self) -> None:
            self.stream.release(self.pin)
            self.stream.close()

    return InferenceServer


def unit_rows(stream: tq.Stream) -> int:
    return sum(u["partitions"].get(P, {}).get("rows", 0)
               for u in stream.deployment_stats()["units"])


def test_an_actor_on_another_node_resolves_a_handle_in_one_transfer(two_hosts):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    head, worker = two_hosts
    stream = tq.init(mode="ray", storage_units=1, nodes=[head], config=CONFIG,
                     name="tq_media_nodes", allow_insecure_tcp=True)
    try:
        assert stream.owner.unit_nodes == [head]
        stream.create_partition(P, consumers=["actor"])
        img = images(1, seed=50)[0]
        ref = stream.media.put(P, "g0", {"image": tq.MultiRagged.from_list(
            [img], fixed_dims=(0,))})
        server = ray.remote(num_cpus=0)(_server()).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(worker, soft=False)).remote()
        who = ray.get(server.start.remote(ref), timeout=120)
        assert who["node"] == worker
        media = stream.stats()[P]["media"]
        assert media["entries"] == 1 and media["bytes"] >= img.numel()
        me = f"{socket.gethostname()}:{os.getpid()}"
        assert media["pins"] == {me: 1, who["holder"]: 1}  # the agent loop's, the server's
        assert media["bytes_by_holder"] == {me: media["bytes"], who["holder"]: media["bytes"]}
        out = ray.get(server.generate.remote(ref), timeout=120)
        got = torch.frombuffer(bytearray(out["image"]), dtype=torch.uint8).reshape(
            out["shape"])
        assert torch.equal(got, img)
        assert out["calls"].get("get") == 1 and "spans" not in out["calls"], out["calls"]
        ray.get(server.done.remote(), timeout=60)
        keys = [f"g0_{j}" for j in range(N)]
        stream.writer(P).put(keys, {"r": torch.arange(N)}, tags=[{"uid": "g0"}] * N,
                             shared=["g0"] * N)  # the group names the media
        assert stream.stats()[P]["media"]["pins"] == {}  # handed to the rows
        client = stream.client()
        client.register_task(P, "actor", fields=["image", "r"], batch_size=N)
        meta = client.get_meta(P, "actor", timeout=30)
        assert all(torch.equal(i, img)
                   for i in client.get_data(meta, ragged="list")["image"])
        assert unit_rows(stream) == N + 1
        client.ack(meta)  # the group is consumed: its media is freed
        assert unit_rows(stream) == 0
        assert stream.stats()[P]["shared"]["entries"] == 0
        with pytest.raises(StateError, match="the last row naming it was freed"):
            stream.resolve(ref)
    finally:
        stream.close()
