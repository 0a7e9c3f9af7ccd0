"""Ray mode on a two-node cluster on this machine: units spread one per node, a producer
pinned to one node, a consumer pinned to the other, every row delivered exactly once;
start and stop: a start that times out raises the timeout and kills what it started (a
retry works), a driver that ends without ``close()`` leaves no socket folder, the folder
of a killed actor is swept by the next start, several nodes need CURVE or an opt-in.

One module: the two-node cluster is a session fixture, set up once per module that
imports it."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile

import pytest
import torch
from tq_fixtures import ray_cluster, wait_until

import tq_stream as tq
from tq_stream.errors import AuthError, ConfigError, WaitTimeout

__all__ = ["ray_cluster"]  # the session-scoped fixture, imported for pytest

pytestmark = [pytest.mark.integration, pytest.mark.ray, pytest.mark.timeout(240)]

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
    names = _actor_names("tq_stream", 2)
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

    assert wait_until(lambda: all(_gone(n) for n in names), 30), "shutdown kills the actors"


# ------------------------------------------------------------ start and stop

CONFIG = tq.StreamConfig(timeout=60)


def _gone(name: str) -> bool:
    import ray

    try:
        ray.get_actor(name, namespace="tq_stream")
    except ValueError:
        return True
    return False


def _actor_names(name: str, units: int) -> list[str]:
    return [f"{name}_unit{i}" for i in range(units)] + [f"{name}_controller"]


def _folders() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "tq_ray_*")))


def _round_trip(stream: tq.Stream) -> bool:
    keys = ["r_0", "r_1"]
    x = torch.arange(2, dtype=torch.float32)[:, None]
    stream.writer("p").put(keys, {"x": x})
    return torch.equal(stream.kv.get_batch(keys, partition="p")["x"], x)


def test_a_start_that_times_out_raises_it_kills_its_actors_and_a_retry_works(ray_cluster):
    names = _actor_names("tq_slow", 2)
    with pytest.raises(WaitTimeout, match="start_timeout=0.001"):
        tq.init(mode="ray", storage_units=2, config=CONFIG, name="tq_slow",
                start_timeout=0.001, allow_insecure_tcp=True)
    assert wait_until(lambda: all(_gone(n) for n in names), 60), "the actors it started"
    stream = tq.init(mode="ray", storage_units=2, config=CONFIG, name="tq_slow",
                     allow_insecure_tcp=True)
    try:
        assert _round_trip(stream)
        joined = tq.connect(stream.address, config=CONFIG)  # not the owner
        try:
            with pytest.raises(AuthError, match="admin call"):
                joined.kv.clear(partition="p")
        finally:
            joined.close()
        assert stream.kv.clear(partition="p") == 2  # the owner may
    finally:
        stream.close()
    assert wait_until(lambda: all(_gone(n) for n in names), 60)


def test_several_nodes_without_curve_need_the_opt_in(ray_cluster):
    with pytest.raises(ConfigError, match="curve must be True on a Ray cluster of several"):
        tq.init(mode="ray", storage_units=1, config=CONFIG, name="tq_plain")
    assert _gone("tq_plain_controller") and _gone("tq_plain_unit0")


DRIVER = """
import sys
import ray
import torch
import tq_stream as tq

ray.init(address=sys.argv[1], namespace="tq_stream", log_to_driver=False)
stream = tq.init(mode="ray", storage_units=2, name="tq_exit", allow_insecure_tcp=True)
stream.writer("p").put(["a_0"], {"x": torch.ones(1, 2)})
print("\\n".join(i["local"] for i in stream._owner._infos), flush=True)
# ends without stream.close()
"""


def test_a_driver_that_ends_without_close_leaves_no_socket_folder(ray_cluster):
    import ray

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", DRIVER, ray.get_runtime_context().gcs_address],
                         capture_output=True, text=True, timeout=180, env=env, check=True)
    folders = {os.path.dirname(a[len("unix://"):]) for a in out.stdout.split()}
    assert len(folders) == 3 and all(f.startswith(tempfile.gettempdir()) for f in folders)
    assert wait_until(lambda: not folders & _folders(), 30), sorted(folders & _folders())
    assert wait_until(lambda: all(_gone(n) for n in _actor_names("tq_exit", 2)), 60)


def test_the_folder_of_a_killed_actor_is_swept_by_the_next_start(ray_cluster):
    import ray

    stream = tq.init(mode="ray", storage_units=2, config=CONFIG, name="tq_killed",
                     allow_insecure_tcp=True)
    infos = stream._owner._infos
    folders = {os.path.dirname(i["local"][len("unix://"):]) for i in infos}
    pids = [i["pid"] for i in infos]
    for name in _actor_names("tq_killed", 2):
        ray.kill(ray.get_actor(name, namespace="tq_stream"))  # no stop: folders stay
    stream._owner._actors = []  # already killed
    stream.close()
    assert wait_until(lambda: not any(os.path.exists(f"/proc/{p}") for p in pids), 60)
    assert folders <= _folders()
    again = tq.init(mode="ray", storage_units=2, config=CONFIG, name="tq_next",
                    allow_insecure_tcp=True)
    try:
        assert not folders & _folders()
        assert _round_trip(again)
    finally:
        again.close()
