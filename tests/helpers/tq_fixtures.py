"""Fixtures of the out-of-process tests: local deployments, process and segment probes,
and one two-node Ray cluster per session (started only if a Ray test runs).

Test modules import the fixtures they use from here (``from tq_fixtures import
local_stream``): a ``conftest.py`` in this folder would shadow ``tests/conftest.py``,
which core tests import by its module name ``conftest``.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

import tq_stream as tq
from tq_stream.backends.shm import PREFIX, SHM_DIR, ShmUnit

# Integration tests wait on real processes: generous per-call timeouts, bounded tests.
CONFIG = tq.StreamConfig(timeout=30.0)


def start_local(storage_units: int = 2, config: tq.StreamConfig = CONFIG,
                **options: object) -> tq.Stream:
    """A local deployment; the caller closes it (or uses ``local_stream``)."""
    return tq.init(mode="local", storage_units=storage_units, config=config, **options)


@pytest.fixture(scope="module")
def local_stream() -> Iterator[tq.Stream]:
    """One local deployment (2 units, shared memory) per test module; each test uses its
    own partitions. At teardown its servers are gone and left no segments."""
    stream = start_local()
    pids = list(stream.owner.pids)
    try:
        yield stream
    finally:
        pids += stream.owner.pids  # units restarted by a test included
        stream.close()
        assert wait_gone(pids, 10.0) == [], "servers outlived close()"
        assert segments_of(pids) == [], "close() left shared-memory segments"


@pytest.fixture
def unit() -> Iterator[ShmUnit]:
    """A shared-memory unit in this process; at teardown it left no segments."""
    me = os.getpid()
    before = set(segments_of([me]))
    u = ShmUnit()
    try:
        yield u
    finally:
        u.close()
        assert set(segments_of([me])) <= before, "ShmUnit.close left segments behind"


def segments_of(pids: Sequence[int]) -> list[str]:
    """Shared-memory segments owned by ``pids`` (other runs' segments are ignored)."""
    prefixes = tuple(f"{PREFIX}{p}_" for p in pids)
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefixes))
    except OSError:
        return []


def alive(pid: int) -> bool:
    """True if ``pid`` runs (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_until(cond: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    """Poll ``cond`` until it holds or ``timeout`` passes (tests only: processes dying
    and segments disappearing have no event to wait on)."""
    deadline = time.monotonic() + timeout
    while True:
        if cond():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def wait_gone(pids: Sequence[int], timeout: float) -> list[int]:
    """The pids of ``pids`` still alive after waiting up to ``timeout``."""
    wait_until(lambda: not any(alive(p) for p in pids), timeout)
    return [p for p in pids if alive(p)]


def kill(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


# ---------------------------------------------------------------------------- Ray


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[list[str]]:
    """Two one-CPU Ray nodes on this machine for the module that takes it (stopped
    before the next module, which may start its own); yields their node ids."""
    with two_node_cluster() as nodes:
        yield nodes


@contextlib.contextmanager
def two_node_cluster() -> Iterator[list[str]]:
    """Two one-CPU Ray nodes on this machine, connected and stopped at the end; yields
    their node ids. One at a time: a module that needs its own (its tests kill
    actors) uses this instead of ``ray_cluster``.

    Both nodes use this host's own IP, not 127.0.0.1: on Linux ``ray.init`` rewrites a
    loopback bootstrap address to the node IP, so a cluster bound to 127.0.0.1 cannot be
    joined. Packets to the host's own IP never leave the machine either.
    """
    with two_node_cluster_of() as (_cluster, nodes):
        yield nodes


@contextlib.contextmanager
def two_node_cluster_of(runtime_env: dict | None = None) -> Iterator[tuple[Any, list[str]]]:
    """``two_node_cluster`` that also yields the ``Cluster`` (to remove a node): yields
    (cluster, [head node id, worker node id]); Ray attached under ``runtime_env``."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, namespace="tq_stream", log_to_driver=False,
                 runtime_env=runtime_env)
        cluster.wait_for_nodes(timeout=60)
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        assert len(nodes) == 2, nodes
        head = cluster.head_node.node_id
        yield cluster, sorted(nodes, key=lambda n: n != head)
    finally:
        ray.shutdown()
        cluster.shutdown()


def killed_consumer(stream: tq.Stream, partition: str) -> list[str]:
    """Run ``tq_workers.consume_and_die`` in a spawned process: it takes step 0 of task
    "t", reports its keys and dies by SIGKILL holding the lease. Returns those keys."""
    from tests.helpers.tq_workers import consume_and_die

    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=consume_and_die, args=(stream, partition, send))
    child.start()
    send.close()
    try:
        assert recv.poll(75), "the consumer never reported its batch"
        held = recv.recv()
        child.join(10)
        assert child.exitcode == -signal.SIGKILL
    finally:
        if child.is_alive():
            kill(child.pid)
            child.join(5)
    return held


def run_workers(target: Callable[..., None], arg_lists: Sequence[tuple],
                report_s: float = 90.0) -> list[Any]:
    """Run ``target(*args, send)`` in a spawned process per ``args``; their reports (each
    sends one), in order. A process still alive after its report is killed."""
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for args in arg_lists:
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=target, args=(*args, send))
        p.start()
        send.close()
        pipes.append(recv)
        procs.append(p)
    try:
        results = []
        for recv in pipes:
            assert recv.poll(report_s), "a worker never reported"
            results.append(recv.recv())
    finally:
        for p in procs:
            p.join(20)
            if p.is_alive():
                p.kill()
    return results
