"""The staleness bound holds when a batch reaches the training loop, although steps
are formed ahead (prefetch) under an older version (issue #10 item 2)."""

from __future__ import annotations

import threading

import pytest
import torch

import tq_stream as tq
from tq_stream.errors import WaitTimeout

P = "train"
JUMPS = [(v, 8) for v in range(12)]  # rows at versions 0..11 for a trainer jumping 2


def test_no_yielded_batch_is_staler_than_the_bound(stream):
    stream.create_partition(P, consumers=["actor"])
    ds = tq.StreamingDataset(stream, P, "actor", ["x"], batch_size=4, prefetch=3, timeout=10,
                             sampler=tq.samplers.StalenessSampler(max_staleness=1))
    loader = tq.StreamingDataLoader(ds)
    version = {"now": 0}
    loader.set_version(0)  # before the first batch: the producers are paced from the start
    writer = stream.writer(P)
    stop = threading.Event()

    def produce() -> None:  # rows carry the version that generated them
        i = 0
        while not stop.is_set() and i < 400:
            try:
                writer.reserve(4, timeout=0.5)
            except WaitTimeout:
                continue  # the window is full (the trainer may have stopped): look again
            v = version["now"]
            keys = [f"k{i + j}" for j in range(4)]
            writer.put(keys, {"x": torch.zeros(4, 2)}, tags=[{"version": v}] * 4)
            i += 4
        stream.close_partition(P)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    lags = []
    for step, batch in enumerate(loader):
        lags += [version["now"] - t["version"] for t in tq.batch_meta(batch).tags]
        version["now"] += 1  # one optimizer step, one new policy version
        loader.set_version(version["now"])
        if step == 30:
            break
    stop.set()
    producer.join(20)
    assert len(lags) > 40 and max(lags) <= 1, sorted(set(lags))


def test_steps_formed_ahead_respect_the_bound_at_their_turn(stream):
    """Rows all written at version 0: prefetched steps formed at version 0 would reach the
    trainer at versions 2 and 3; they must be formed for the version of their turn."""
    stream.create_partition(P, consumers=["actor"])
    stream.writer(P).put([f"k{i}" for i in range(32)], {"x": torch.zeros(32, 2)},
                         tags=[{"version": 0}] * 32)
    stream.close_partition(P)
    ds = tq.StreamingDataset(stream, P, "actor", ["x"], batch_size=4, prefetch=3, timeout=10,
                             sampler=tq.samplers.StalenessSampler(max_staleness=1))
    loader = tq.StreamingDataLoader(ds)
    loader.set_version(0)
    version, lags = 0, []
    for batch in loader:
        lags += [version - t["version"] for t in tq.batch_meta(batch).tags]
        version += 1
        loader.set_version(version)
    assert lags and max(lags) <= 1, sorted(set(lags))
    st = stream.stats()[P]["tasks"]["actor"]
    assert st["discarded"].get("stale", 0) == 32 - len(lags)  # the rest: counted stale


def test_a_step_formed_by_a_reader_ahead_is_reformed_for_the_version_at_yield(stream):
    """Replay: a reader of step 2 by number formed steps 0-2 at version 0; the
    trainer set version 1 after step 0, and step 1 came with version-0 rows
    (max_staleness=0). Now step 1's share is re-formed at its turn: its rows stale
    against version 1 (a version the trainer set) are discarded, and it is completed
    from ready rows within the bound."""
    from tests.helpers.staleness_cases import formed_by_a_reader_ahead

    batches, st = formed_by_a_reader_ahead(stream, P)
    assert batches == [[0, 0], [1, 1], [1, 1]], batches
    assert st["discarded"] == {"stale": 2}, st["discarded"]


def test_a_trainer_jumping_versions_gets_no_stale_prefetched_batch(stream):
    """Replay: a trainer that bumps its version by 2 every step (one version per
    minibatch) got prefetched steps formed for a predicted version 1 higher: rows 2
    versions old at yield. Now each such batch is checked at yield and re-formed."""
    from tests.helpers.staleness_cases import every_n_steps

    lags, versions, st = every_n_steps(stream, P, 1, jump=2, blocks=JUMPS)
    assert lags and max(lags) <= 1, sorted(set(lags))
    stale = st["discarded"].get("stale", 0)
    assert len(lags) + stale == len(versions)  # nothing lost, nothing twice
    assert stale <= sum(v < st["final_version"] - 1 for v in versions)
    assert st["redelivered"] == 0  # the loader asking again at yield is no redelivery


def test_a_dp_rank_behind_its_peer_gets_its_shares_at_its_own_steps_versions(stream):
    """A DP rank 3 steps behind its peer: the versions the peer set for later steps
    do not apply to the steps the lagging rank reads (nor does its setting them
    again roll the task's version back)."""
    from tests.helpers.staleness_cases import dp_rank_ahead

    lags, st = dp_rank_ahead(stream, P)
    assert len(lags[0]) == len(lags[1]) == 3, lags
    assert max(lags[0] + lags[1]) <= 1, lags
    assert st["version"] == 3, st["version"]
    # only the 2 version-1 rows left over are stale against version 3
    assert st["discarded"].get("stale", 0) <= 2, st["discarded"]


def _formed_ahead_at_version_0(stream, replicas: int = 1, timeout: float = 10):
    """6 rows at version 0, steps 0-2 formed by a reader of step 2 (acked by every
    replica); loaders of each replica at version 0 (max_staleness=0, batch_size 2)."""
    stream.create_partition(P, consumers=["actor"])
    stream.writer(P).put([f"a{i}" for i in range(6)], {"x": torch.zeros(6, 2)},
                         tags=[{"version": 0}] * 6)
    loaders = []
    for k in range(replicas):
        ds = tq.StreamingDataset(stream, P, "actor", ["x"], batch_size=2, timeout=timeout,
                                 replicas=replicas, replica=k if replicas > 1 else None,
                                 sampler=tq.samplers.StalenessSampler(max_staleness=0))
        loaders.append(tq.StreamingDataLoader(ds))
        loaders[-1].set_version(0)
    reader = stream.client()
    reader.reading(P, "actor", 2)
    for k in range(replicas):
        reader.ack(reader.get_meta(P, "actor", 2, timeout=10, replica=k))
    return loaders


def test_tp_peers_get_the_same_reformed_share(stream):
    """Replicas 0 and 1 of one rank hold step 1 formed at version 0 (prefetched);
    both set version 1: the first to yield it has it formed again, the other gets
    that same share: identical rows, all within the bound."""
    loaders = _formed_ahead_at_version_0(stream, replicas=2)
    its = [iter(dl) for dl in loaders]
    first = [tq.batch_meta(next(it)) for it in its]
    assert first[0].keys == first[1].keys and first[0].step == 0
    stream.writer(P).put([f"b{i}" for i in range(4)], {"x": torch.zeros(4, 2)},
                         tags=[{"version": 1}] * 4)
    stream.close_partition(P)
    for dl in loaders:
        dl.set_version(1)
    for want_step in (1, 3):
        got = [tq.batch_meta(next(it)) for it in its]
        assert got[0].step == got[1].step == want_step, [m.step for m in got]
        assert got[0].keys == got[1].keys, [m.keys for m in got]
        assert [t["version"] for t in got[0].tags] == [1, 1], got[0].tags
    for it in its:
        assert next(it, None) is None
    st = stream.stats()[P]["tasks"]["actor"]
    assert st["discarded"] == {"stale": 2} and st["acked"] == 8, st


def test_a_share_waiting_for_replacement_rows_says_which_versions(stream):
    """Step 1's rows went stale at version 1 and no row within the bound is ready:
    the loader waits, and its WaitTimeout names both versions."""
    (dl,) = _formed_ahead_at_version_0(stream, timeout=1.0)
    it = iter(dl)
    assert tq.batch_meta(next(it)).step == 0
    dl.set_version(1)
    with pytest.raises(WaitTimeout) as err:
        next(it)
    text = str(err.value)
    assert "step 1's share for rank 0 was formed for version 0" in text, text
    assert "2 of its 2 rows are stale at version 1" in text, text


def test_the_holder_asking_again_for_an_unchanged_share_is_no_redelivery(stream):
    """A loader checks a batch at its yield by asking for its step again, under the
    session that holds the claim; a share still within the bound comes back as it was,
    and that is not counted as a redelivery (an operator reads ``redelivered`` as rows
    handed out twice)."""
    stream.create_partition(P, consumers=["actor"])
    c = stream.client()
    c.register_task(P, "actor", ["x"], batch_size=2,
                    sampler=tq.samplers.StalenessSampler(max_staleness=1))
    c.set_version(P, "actor", 0)
    stream.writer(P).put(["a", "b"], {"x": torch.zeros(2, 1)}, tags=[{"version": 0}] * 2)
    first = c.get_meta(P, "actor", step=0)
    c.set_version(P, "actor", 1)
    again = c.get_meta(P, "actor", step=0)
    assert (first.turn, again.turn, again.keys) == (0, 1, first.keys)
    st = stream.stats()[P]["tasks"]["actor"]
    assert (st["handed_out"], st["redelivered"]) == (2, 0)
    other = stream.client()  # another session, after the first one's lease went
    c.cancel()
    assert other.get_meta(P, "actor", step=0).keys == first.keys
    assert stream.stats()[P]["tasks"]["actor"]["redelivered"] == 2
