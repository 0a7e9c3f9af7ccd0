"""Who may read a share, across processes (local mode): TP/PP peers must give their
``replica``, and two live consumers of one (task, dp_rank, replica) are never both
accepted; a pool of worker processes sharing a ``consumer`` name never processes a row
twice; a fresh loader after a gap of steps acked by others gets the unfinished step and
ends (issue 20, items 3, 5 and 8). Embedded versions: tests/controller/test_live_claims.py."""

from __future__ import annotations

import multiprocessing as mp
import threading

import pytest

import tq_stream as tq
from tests.helpers.tq_fixtures import killed_consumer, local_stream, run_workers
from tests.helpers.tq_workers import ahead_pool_worker, pool_worker, values
from tq_stream.errors import ConfigError, LeaseError

__all__ = ["local_stream"]  # the module-scoped fixture, imported for pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def keys(prefix: str, n: int) -> list[str]:
    return [f"{prefix}_{i}" for i in range(n)]


def closed_pool(stream: tq.Stream, part: str, ks: list[str], batch_size: int) -> list[str]:
    """A closed partition of rows ``ks`` read by task "reward"; returns ``ks``."""
    stream.create_partition(part, consumers=["reward"])
    stream.writer(part).put(ks, {"x": values(ks)})
    stream.close_partition(part)
    stream.client().register_task(part, "reward", ["x"], batch_size=batch_size)
    return ks


def test_tp_peers_without_replica_are_refused(local_stream):
    """The replay: DP 2 x 2 replicas, no replica (both peers acked as replica 0 and
    nothing was ever freed). Now refused at once, naming the argument."""
    for rank in range(4):
        with pytest.raises(ConfigError, match=r"replica must be given .*replicas=2"):
            tq.StreamingDataset(local_stream, "peers", "t", ["x"], batch_size=2,
                                dp_rank=rank // 2, dp_size=2, replicas=2)


def test_two_live_loaders_of_one_replica_are_not_both_accepted(local_stream):
    """Two loaders (DataLoader workers each) both claim replica 0 of rank 0: one of
    them is refused with an error naming replica, and no step reaches both."""
    part = "dup"
    local_stream.create_partition(part, consumers=["t"])
    ks = keys("d", 32)
    local_stream.writer(part).put(ks, {"x": values(ks)})
    local_stream.close_partition(part)
    got: dict[int, list[int]] = {0: [], 1: []}
    errors: dict[int, Exception] = {}

    def run(i: int) -> None:
        ds = tq.StreamingDataset(local_stream, part, "t", ["x"], batch_size=2, replicas=2,
                                 replica=0, timeout=20)
        try:
            for batch in tq.StreamingDataLoader(ds, num_workers=2,
                                                multiprocessing_context="fork"):
                got[i].append(tq.batch_meta(batch).step)
                threading.Event().wait(0.2)  # "training"
        except (ConfigError, LeaseError) as exc:
            errors[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    assert not any(t.is_alive() for t in threads)
    assert len(errors) >= 1, got
    assert all("replica" in str(e) for e in errors.values()), errors
    assert not set(got[0]) & set(got[1]), got


def test_a_pool_of_processes_sharing_a_consumer_name_processes_each_row_once(local_stream):
    """The replay: two worker processes with consumer="reward" each take the next
    batch; they got the same rows (256 of 256 twice) and one crashed with "freed
    meanwhile". Now every row once, no error."""
    part = "pool"
    ks = closed_pool(local_stream, part, keys("p", 256), batch_size=8)
    results = run_workers(pool_worker, [(local_stream, part, "reward", "reward")] * 2)
    assert [err for _, err in results] == ["", ""], results
    a, b = (set(k) for k, _ in results)
    assert not a & b and sorted(a | b) == sorted(ks)
    assert local_stream.stats()[part]["rows"] == 0


def test_two_pool_processes_each_holding_a_share_both_reach_the_end(local_stream):
    """The replay: two worker processes (consumer="reward") each hold one batch and ask
    for the next before acking it, at the end of a closed partition: they waited for
    each other's share until their timeout. Now both get the end."""
    part = "ahead"
    ks = closed_pool(local_stream, part, keys("a", 4), batch_size=2)
    ready = mp.get_context("spawn").Barrier(2)
    results = run_workers(ahead_pool_worker,
                          [(local_stream, part, "reward", "reward", ready)] * 2)
    assert [(end, err) for _, end, err in results] == [(True, "")] * 2, results
    assert sorted(k for held, _, _ in results for k in held) == sorted(ks)
    assert local_stream.stats()[part]["rows"] == 0


def test_a_fresh_loader_after_a_gap_gets_the_unfinished_step_and_ends(local_stream):
    """The replay: a consumer process holds step 0 and is killed; steps 1-3 are acked by
    other calls; after the lease a fresh loader got step 0, then LeaseError for step 1.
    Now it gets step 0 and ends (with DataLoader workers too)."""
    for workers in (0, 2):
        part = f"gap{workers}"
        local_stream.create_partition(part, consumers=["t"])
        ks = keys(f"g{workers}", 16)
        local_stream.writer(part).put(ks, {"x": values(ks)})
        local_stream.close_partition(part)
        c = local_stream.client()
        c.register_task(part, "t", ["x"], batch_size=4, lease_timeout=1.0)
        held = killed_consumer(local_stream, part)
        for s in (1, 2, 3):
            c.ack(c.get_meta(part, "t", s))
        ds = tq.StreamingDataset(local_stream, part, "t", ["x"], batch_size=4, timeout=30,
                                 lease_timeout=1.0)
        loader = tq.StreamingDataLoader(ds, num_workers=workers,
                                        multiprocessing_context="fork" if workers else None)
        got = [tq.batch_meta(b) for b in loader]
        assert [m.step for m in got] == [0], workers
        assert sorted(got[0].keys) == sorted(held)
        assert local_stream.stats()[part]["rows"] == 0
