"""Leases of consumer actors on a three-node Ray cluster, each node its own host
(``fault_kit.own_hosts``: tcp between nodes, a unit on each node), issue 20:

- item 8: an actor holding step 0 is killed; other actors ack steps 1-3; a fresh
  loader gets step 0 once its lease expired, then the end of the closed partition
  (it raised LeaseError for step 1 after such a gap in embedded and local mode);
- item 13: a stalled consumer actor's stats (and ``tq-stream status``) name the field
  its rows lack, and a killed actor's lease looks dead (its heartbeat age grows past
  what a live holder's reaches, then status says "expired") until a restarted worker
  of its consumer name takes the share back.

One cluster for the module (no node leaves here)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

import tq_stream as tq
from tests.helpers.fault_kit import own_hosts, three_nodes, wait_until

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.integration, pytest.mark.ray, pytest.mark.timeout(240)]
LEASE = 8.0  # seconds; the heartbeat renews every LEASE / 4
CONFIG = tq.StreamConfig(timeout=60.0, lease_timeout=LEASE)


@pytest.fixture(scope="module")
def three_hosts():
    """Three nodes, each its own host; yields their node ids (the head's first)."""
    with three_nodes(own_hosts()) as cluster:
        yield [cluster.head_node.node_id] + [n.node_id for n in cluster.worker_nodes]


def _on(node: str) -> dict:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}


def _start(name: str) -> tq.Stream:
    stream = tq.init(mode="ray", storage_units=3, config=CONFIG, name=name,
                     allow_insecure_tcp=True)
    assert len(set(stream.owner.unit_nodes)) == 3  # a unit on each node
    return stream


def _reader():
    """The consumer actor class. Made here: Ray ships it by value (the workers cannot
    import this module)."""

    class Reader:
        """A consumer in its own process: low-level steps or a fresh loader."""

        def hold(self, stream: tq.Stream, partition: str, task: str, step: int | None,
                 consumer: str = "") -> list[str]:
            """Take ``step`` (None: the next batch for ``consumer``) and read it; the
            client (its session) is kept until the actor dies."""
            self._client = stream.client(consumer=consumer)
            meta = self._client.get_meta(partition, task, step, timeout=30)
            self._client.get_data(meta)
            return list(meta.keys)

        def ack(self, stream: tq.Stream, partition: str, task: str,
                steps: list[int]) -> list[str]:
            client, keys = stream.client(), []
            for step in steps:
                meta = client.get_meta(partition, task, step, timeout=30)
                client.get_data(meta)
                client.ack(meta)
                keys += meta.keys
            return keys

        def read(self, stream: tq.Stream, partition: str, task: str
                 ) -> tuple[list[tuple[int, list[str]]], str]:
            """A fresh loader to the end: each batch's (step, keys), and the error that
            ended it ("" at the end of the stream)."""
            ds = tq.StreamingDataset(stream, partition, task, ["x"], batch_size=4)
            got: list[tuple[int, list[str]]] = []
            try:
                for batch in tq.StreamingDataLoader(ds):
                    meta = tq.batch_meta(batch)
                    got.append((meta.step, list(meta.keys)))
            except Exception as exc:  # noqa: BLE001 — reported to the test as text
                return got, f"{type(exc).__name__}: {exc}"
            return got, ""

        def wait(self, stream: tq.Stream, partition: str, task: str) -> str:
            """The WaitTimeout of a get_meta that waits for rows not ready."""
            from tq_stream.errors import WaitTimeout

            try:
                stream.client().get_meta(partition, task, 0, timeout=2)
            except WaitTimeout as exc:
                return str(exc)
            return "got a batch"

    return Reader


def _actor(node: str):
    return ray.remote(num_cpus=0)(_reader()).options(**_on(node)).remote()


def test_a_killed_actor_s_step_comes_back_to_a_fresh_loader_after_a_gap(three_hosts):
    """Item 8: step 0's holder (an actor on one worker node) is killed; an actor on the
    other acks steps 1-3; a fresh loader there gets step 0 once the lease expired,
    with the same rows, then the end (not LeaseError for the acked step 1)."""
    _, b, c = three_hosts
    stream = _start("tq_gap")
    try:
        stream.create_partition("gap", consumers=["t"])
        keys = [f"a_{i}" for i in range(16)]
        for lo in (0, 8):
            stream.writer("gap").put(keys[lo : lo + 8],
                                     {"x": torch.arange(lo, lo + 8.0)[:, None]})
        units = set(stream.kv.meta(keys, partition="gap").unit.tolist())
        assert units == {0, 1, 2}  # rows on every node
        stream.close_partition("gap")
        stream.client().register_task("gap", "t", ["x"], batch_size=4, lease_timeout=LEASE)
        holder, other = _actor(b), _actor(c)
        held = ray.get(holder.hold.remote(stream, "gap", "t", 0), timeout=120)
        ray.kill(holder, no_restart=True)  # dies holding step 0
        acked = ray.get(other.ack.remote(stream, "gap", "t", [1, 2, 3]), timeout=120)
        assert sorted(held + acked) == sorted(keys)
        got, error = ray.get(other.read.remote(stream, "gap", "t"), timeout=180)
        assert not error, error
        assert got == [(0, held)]
        assert stream.stats()["gap"]["rows"] == 0  # every row acked and freed
    finally:
        stream.close()


def _lease(stream: tq.Stream) -> dict:
    (lease,) = stream.stats()["stall"]["tasks"]["s"]["leases"]
    return lease


def test_a_stalled_ray_consumer_s_stats_say_why_and_a_killed_actor_s_lease_looks_dead(
        three_hosts):
    """Item 13: task "t" needs field ``reward``, which 8 of 12 rows lack: the consumer
    actor's WaitTimeout, stats() and ``tq-stream status`` say so. The actor holds a
    share of task "s": its lease names its consumer and stays fresh while the actor
    lives; once the actor is killed, its heartbeat age grows past LEASE / 2 (a live
    holder renews every LEASE / 4), then status shows it expired, and a worker of the
    same consumer name on another node gets the same rows back."""
    _, b, c = three_hosts
    stream = _start("tq_stall")
    try:
        stream.create_partition("stall", consumers=["t", "s"])
        client = stream.client()
        client.register_task("stall", "t", ["x", "reward"], batch_size=8, lease_timeout=LEASE)
        client.register_task("stall", "s", ["x"], batch_size=2, lease_timeout=LEASE)
        keys = [f"k{i}" for i in range(12)]
        stream.writer("stall").put(keys, {"x": torch.zeros(12, 2)})
        stream.writer("stall").put(keys[:4], {"reward": torch.ones(4)})
        actor = _actor(b)
        said = ray.get(actor.wait.remote(stream, "stall", "t"), timeout=120)
        assert "8 rows not ready: 8 lack field 'reward'" in said, said
        t = stream.stats()["stall"]["tasks"]["t"]
        assert t["not_ready"] == {"rows": 8, "lack_fields": {"reward": 8}, "lack_tags": {}}
        held = ray.get(actor.hold.remote(stream, "stall", "s", 0, "worker-1"), timeout=120)
        assert len(held) == 2
        lease = _lease(stream)
        assert lease["consumer"] == "worker-1" and lease["rows"] == 2
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "COLUMNS": "250"}
        out = subprocess.run([sys.executable, "-m", "tq_stream", "status", stream.address,
                              "--once"], capture_output=True, text=True, env=env,
                             timeout=90, check=True).stdout
        assert "8 rows not ready: 8 lack field 'reward'" in out, out
        assert "worker-1" in out, out
        time.sleep(LEASE / 2)  # two renewals' time: a live holder's heartbeat stays fresh
        lease = _lease(stream)
        assert lease["age"] >= LEASE / 2 > lease["heartbeat_age"], lease
        ray.kill(actor, no_restart=True)
        assert wait_until(lambda: _lease(stream)["heartbeat_age"] >= LEASE / 2, LEASE), \
            "a dead holder's heartbeat age must grow"
        assert wait_until(lambda: _lease(stream)["expires_in"] < 0, 2 * LEASE)
        out = subprocess.run([sys.executable, "-m", "tq_stream", "status", stream.address,
                              "--once"], capture_output=True, text=True, env=env,
                             timeout=90, check=True).stdout
        row = next(line for line in out.splitlines() if "worker-1" in line)
        assert "expired" in row, out
        # a restarted worker of that name, on another node, takes the dead one's share
        again = ray.get(_actor(c).hold.remote(stream, "stall", "s", None, "worker-1"),
                        timeout=120)
        assert again == held
        lease = _lease(stream)
        assert lease["consumer"] == "worker-1" and lease["expires_in"] > 0
    finally:
        stream.close()
