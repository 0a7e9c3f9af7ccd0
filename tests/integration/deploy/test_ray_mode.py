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
import time
import urllib.request

import pytest
import torch

import tq_stream as tq
from tests.helpers.checkpoint_cases import save_under_load
from tests.helpers.tq_fixtures import ray_cluster, wait_until
from tq_stream.errors import AuthError, ConfigError, WaitTimeout
from tq_stream.transport.zeromq import generate_keys

__all__ = ["ray_cluster"]  # the module-scoped fixture, imported for pytest

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
        assert sorted(stream.owner.unit_nodes) == sorted(ray_cluster), "one unit per node"
        # This process shares the host with every actor: it calls them over unix sockets.
        assert stream.address.startswith("tcp://")
        assert stream.connection.controller().address.startswith("unix://")
        assert all(u.remote.client.transport.address.startswith("unix://")
                   for u in stream.connection.units())

        stream.create_partition("train", consumers=["learner"])

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


# Checkpoints on two nodes: each unit actor writes and reads its own file (here both nodes
# share this machine's filesystem, as shared storage would).
CONFIG = tq.StreamConfig(timeout=60)


@pytest.mark.timeout(240)
def test_units_on_two_nodes_save_and_restore_their_own_files(ray_cluster, tmp_path):
    path = str(tmp_path / "ckpt")
    with tq.init(mode="ray", storage_units=2, config=CONFIG,
                 allow_insecure_tcp=True) as stream:
        assert sorted(stream.owner.unit_nodes) == sorted(ray_cluster), "one unit per node"
        checked = save_under_load(stream, str(tmp_path), lambda p: tq.init(
            mode="ray", storage_units=2, config=CONFIG, restore=p, name="tq_restored",
            allow_insecure_tcp=True),
            saves=2)
        keys = [f"r{i}" for i in range(16)]
        x = torch.arange(32, dtype=torch.float32).reshape(16, 2)
        stream.writer("p").put(keys, {"x": x})
        stream.save(path)
    assert checked > 0
    assert len([n for n in os.listdir(path) if n.startswith("unit-")]) == 2
    with tq.init(mode="ray", storage_units=2, config=CONFIG, restore=path,
                 allow_insecure_tcp=True) as stream:
        assert torch.equal(stream.kv.get_batch(keys, ["x"], partition="p")["x"], x)


def test_batch_conventions_and_length_in_ray_mode(ray_cluster):
    # nested fields, fields-only batch keys with their meta, len() over the controller RPC
    from tensordict import TensorDict

    stream = tq.init(mode="ray", storage_units=2, config=tq.StreamConfig(timeout=60),
                     allow_insecure_tcp=True)
    try:
        n = 12
        td = TensorDict({"obs": TensorDict({"image": torch.arange(n * 2.0).reshape(n, 2),
                                            "state": torch.arange(n)}, [n])}, [n])
        stream.writer("nested").put([f"k{i}" for i in range(n)], td)
        ds = tq.StreamingDataset(stream, "nested", "t", ["obs.image", "obs.state"], 4)
        loader = tq.StreamingDataLoader(ds)
        with pytest.raises(TypeError, match="must be closed"):
            len(loader)
        stream.close_partition("nested")
        assert len(loader) == 3
        seen = []
        for batch in loader:
            assert list(batch.keys()) == ["obs"]
            idx = batch["obs", "state"].tolist()
            assert list(tq.batch_meta(batch).keys) == [f"k{i}" for i in idx]
            assert torch.equal(batch["obs", "image"], td["obs", "image"][idx])
            seen += idx
        assert sorted(seen) == list(range(n))
    finally:
        stream.close()


def test_metrics_and_processes_in_ray_mode(ray_cluster):
    """The owner's metrics endpoint and processes() reach the actors."""
    stream = tq.init(mode="ray", storage_units=2, config=tq.StreamConfig(timeout=60),
                     metrics_port=0, name="tq_observe", allow_insecure_tcp=True)
    try:
        stream.writer("ray").put([f"k{i}" for i in range(6)], {"x": torch.ones(6, 4)})
        procs = stream.processes()
        text = urllib.request.urlopen(f"http://{stream.metrics_endpoint}/metrics",
                                      timeout=30).read().decode()
        units = stream.deployment_stats()["units"]
    finally:
        stream.close()
    assert [(p.role, p.index) for p in procs] == [("controller", 0), ("unit", 0), ("unit", 1)]
    assert os.getpid() not in {p.pid for p in procs}  # actors: processes of their own
    assert [u["pid"] for u in units] == [p.pid for p in procs[1:]]
    assert sum(u["partitions"]["ray"]["rows"] for u in units) == 6
    assert 'tq_stream_rows_created_total{partition="ray"} 6.0' in text
    assert 'tq_stream_unit_up{unit="0"} 1.0' in text and 'tq_stream_unit_up{unit="1"} 1.0' in text
    assert f'tq_stream_info{{mode="ray",version="{tq.__version__}"}} 1.0' in text

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
print("\\n".join(i["local"] for i in stream.owner._infos), flush=True)
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
    infos = stream.owner._infos
    folders = {os.path.dirname(i["local"][len("unix://"):]) for i in infos}
    pids = [i["pid"] for i in infos]
    for name in _actor_names("tq_killed", 2):
        ray.kill(ray.get_actor(name, namespace="tq_stream"))  # no stop: folders stay
    stream.owner._actors = []  # already killed
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


def test_a_producer_killed_between_reserve_and_commit_does_not_block_the_end_in_ray_mode(
        ray_cluster):
    """A Ray task's put reserves its rows and hangs before storing the bytes; the task's
    process is killed: its session's heartbeat stops, the reserved rows are aborted after
    its lease (2 s), and the closed partition ends with the committed rows."""
    import ray

    def reserve_and_hang(stream: tq.Stream) -> None:
        import time

        from tq_stream.connection import placement

        placement.store = lambda *args, **kwargs: time.sleep(3600)
        stream.writer("dead").put(["d_0", "d_1"], {"x": torch.zeros(2, 1)})

    stream = tq.init(mode="ray", storage_units=1, allow_insecure_tcp=True,
                     config=tq.StreamConfig(timeout=60, lease_timeout=2.0))
    try:
        stream.create_partition("dead", consumers=["t"])
        stream.writer("dead").put([f"a_{i}" for i in range(4)], {"x": torch.ones(4, 1)})
        ref = ray.remote(num_cpus=0)(reserve_and_hang).remote(stream)
        assert wait_until(lambda: len(stream.kv.list(partition="dead")) == 6, 60), \
            "the task never reserved its rows"
        ray.cancel(ref, force=True)  # kills the task's worker process
        stream.close_partition("dead")
        ds = tq.StreamingDataset(stream, "dead", "t", ["x"], batch_size=2, timeout=30)
        keys = [k for b in tq.StreamingDataLoader(ds) for k in tq.batch_meta(b).keys]
        assert sorted(keys) == [f"a_{i}" for i in range(4)]
        assert stream.stats()["dead"]["rows"] == 0
    finally:
        stream.close()


def test_a_dead_tasks_step_comes_back_and_a_fresh_loader_after_a_gap_ends_in_ray_mode(
        ray_cluster):
    """Issue 20 item 8 in Ray mode: a Ray task takes step 0 and its process dies; steps
    1-3 are acked by the driver. A pool worker waiting for the next batch gets step 0
    once the lease (2 s) expired; a fresh loader (by step number) gets step 0, skips
    the acked steps and ends (it raised LeaseError for step 1)."""
    import ray

    def take_and_die(stream: tq.Stream, partition: str) -> None:
        stream.client().get_meta(partition, "t", 0, timeout=30)
        os._exit(1)  # the process dies holding the lease

    stream = tq.init(mode="ray", storage_units=2, allow_insecure_tcp=True,
                     config=tq.StreamConfig(timeout=60, lease_timeout=2.0))
    try:
        for part in ("pool", "gap"):
            stream.create_partition(part, consumers=["t"])
            keys = [f"{part}_{i}" for i in range(8)]
            stream.writer(part).put(keys, {"x": torch.ones(8, 1)})
            stream.close_partition(part)
            c = stream.client()
            c.register_task(part, "t", ["x"], batch_size=2, lease_timeout=2.0)
            ref = ray.remote(num_cpus=0, max_retries=0)(take_and_die).remote(stream, part)
            with pytest.raises(ray.exceptions.RayError):
                ray.get(ref, timeout=90)
            acked = []
            for s in (1, 2, 3):
                meta = c.get_meta(part, "t", s)
                acked += meta.keys
                c.ack(meta)
            rest = sorted(set(keys) - set(acked))
            if part == "pool":
                again = c.get_meta(part, "t", timeout=30)  # waits for the lease to lapse
                assert again.step == 0 and sorted(again.keys) == rest
                c.ack(again)
                assert c.get_meta(part, "t", timeout=10).end
            else:
                ds = tq.StreamingDataset(stream, part, "t", ["x"], batch_size=2,
                                         lease_timeout=2.0, timeout=30)
                got = [tq.batch_meta(b) for b in tq.StreamingDataLoader(ds)]
                assert [m.step for m in got] == [0] and sorted(got[0].keys) == rest
            assert stream.stats()[part]["rows"] == 0
    finally:
        stream.close()


def _curve_task():
    """The Ray task. Made here, not at module level: Ray workers cannot import a test
    module, so the function must be pickled by value."""

    def by_name() -> tuple[list[str], float]:
        """Joins by name (tq.connect()) and reads the one row."""
        started = time.monotonic()
        stream = tq.connect(config=tq.StreamConfig(timeout=60))
        try:
            client = stream.client()
            client.register_task("p", "t", ["x"], batch_size=1)
            meta = client.get_meta("p", "t", timeout=30)
            return list(meta.keys), time.monotonic() - started
        finally:
            stream.close()

    return by_name


def test_connect_by_name_and_key_mismatches_under_curve(ray_cluster):
    """Issue 20 item 10: inside a Ray task, tq.connect() by name works under CURVE (the
    deployment tells its public key); a key that does not match fails within seconds
    with an error naming curve_server_key instead of a call's whole timeout."""
    import ray

    stream = tq.init(mode="ray", storage_units=1, curve=True)
    try:
        stream.writer("p").put(["a"], {"x": torch.ones(1, 2)})
        keys, took = ray.get(ray.remote(num_cpus=0)(_curve_task()).remote(), timeout=120)
        assert keys == ["a"]
        assert took < 30.0, f"connect by name took {took:.1f} s"
        wrong, _ = generate_keys()
        for key in (wrong, None):  # another key, and none where CURVE is required
            started = time.monotonic()
            with pytest.raises(ConfigError, match="curve_server_key"):
                tq.connect(stream.address, config=tq.StreamConfig(timeout=60),
                           curve_server_key=key)
            assert time.monotonic() - started < 15.0
        with pytest.raises(ConfigError, match="curve_server_key"):
            tq.connect(curve_server_key=wrong)  # by name, with a key not the deployment's
        joined = tq.connect(stream.address, curve_server_key=stream.curve_server_key)
        assert joined.stats()["p"]["rows"] == 1
        joined.close()
    finally:
        stream.close()
