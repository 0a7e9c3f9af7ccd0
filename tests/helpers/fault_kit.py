"""Helpers of the fault suite: a local deployment that notices dead units fast, the
probes of ``tests/helpers/tq_fixtures.py``, and the bookkeeping every fault test
checks (which rows were written, delivered, acked and lost).

The rule the tests hold the code to (README "Failures"): a storage unit's rows die
with it (counted ``unit_lost``); nothing else loses a row; no acked row is delivered
twice; a crashed consumer's unacked rows come back.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import tq_stream as tq  # noqa: E402
from tests.helpers.tq_fixtures import alive, kill, segments_of, start_local, wait_gone, wait_until  # noqa: E402

UNIT_TIMEOUT = 1.0  # seconds the controller waits for a silent unit in these tests
CONFIG = tq.StreamConfig(timeout=20.0, lease_timeout=2.0)

__all__ = ["CONFIG", "UNIT_TIMEOUT", "alive", "kill", "segments_of", "start_local",
           "wait_gone", "wait_until", "faulty_local", "check_no_leftovers", "Ledger",
           "own_hosts", "three_nodes"]


def faulty_local(storage_units: int = 2, **options: object) -> tq.Stream:
    """A local deployment whose controller declares a silent unit lost after
    ``UNIT_TIMEOUT`` seconds."""
    options.setdefault("unit_timeout", UNIT_TIMEOUT)
    return start_local(storage_units, config=CONFIG, **options)


def check_no_leftovers(stream: tq.Stream, pids: Sequence[int] = ()) -> None:
    """Close ``stream``; its servers (and ``pids``) are gone and left no segments or
    socket folder."""
    owner = stream.owner
    pids = list(pids) + list(owner.pids)
    folder = owner._ipc_dir
    stream.close()
    assert wait_gone(pids, 15.0) == [], "servers outlived close()"
    assert segments_of(pids) == [], "close() left shared-memory segments"
    assert not folder or not Path(folder).exists(), "close() left the socket folder"


class Ledger:
    """Rows written (with the unit each was placed on), delivered and lost."""

    def __init__(self, stream: tq.Stream, partition: str) -> None:
        self.stream, self.partition = stream, partition
        self.unit_of: dict[str, int] = {}
        self.delivered: Counter[str] = Counter()

    def put(self, keys: Sequence[str], data: object) -> None:
        self.stream.writer(self.partition).put(list(keys), data)
        meta = self.stream.kv.meta(list(keys), partition=self.partition)
        self.unit_of.update(zip(keys, meta.unit.tolist(), strict=True))

    def take(self, batches: Iterator) -> Iterator:
        for batch in batches:
            self.delivered.update(tq.batch_meta(batch).keys)
            yield batch

    def lost(self, task: str) -> int:
        stats = self.stream.stats()[self.partition]["tasks"][task]
        return int(stats["discarded"].get("unit_lost", 0))

    def check(self, task: str, dead_unit: int | None) -> set[str]:
        """No row delivered twice; every row not delivered lived on ``dead_unit`` and
        is counted lost. Returns the rows not delivered."""
        twice = [k for k, n in self.delivered.items() if n > 1]
        assert twice == [], f"rows delivered twice: {twice[:5]}"
        missing = set(self.unit_of) - set(self.delivered)
        assert {self.unit_of[k] for k in missing} <= ({dead_unit} if dead_unit is not None
                                                      else set()), missing
        assert len(missing) <= self.lost(task)
        return missing


def own_hosts() -> dict:
    """A Ray ``runtime_env`` under which every node of a one-machine test cluster is its
    own host for tq_stream, as on a real cluster: its clients call the servers of other
    nodes over tcp (not unix sockets, not shared memory), and the controller judges a
    unit of another node by its heartbeats alone. Each Ray worker process appends its
    node id to ``host_id()``; the driver keeps the machine's own (a host of its own)."""

    def node_is_a_host() -> None:  # made here: pickled by value for the workers
        import ray

        from tq_stream import hosts

        node = ray.get_runtime_context().get_node_id()
        machine = hosts.host_id()
        hosts.host_id = lambda: f"{machine}/{node}"

    return {"worker_process_setup_hook": node_is_a_host}


@contextlib.contextmanager
def three_nodes(runtime_env: dict | None = None) -> Iterator:
    """A three-node ``ray.cluster_utils.Cluster`` (one CPU each), Ray attached to it
    under ``runtime_env``; yields the cluster and shuts Ray and the cluster down."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, namespace="tq_stream", log_to_driver=False,
                 runtime_env=runtime_env)
        cluster.wait_for_nodes(timeout=60)
        assert len([n for n in ray.nodes() if n["Alive"]]) == 3
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
