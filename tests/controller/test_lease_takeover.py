"""A reader whose lease lapsed and went to another reader cannot write or ack through its
old BatchMeta: its late work is refused with LeaseTakenOver and the other reader's result
stands (a worker paused past its lease, found by a README-only user: its put_data
overwrote the result of the worker that took the rows over, after that one acked).
Embedded mode; tests/integration/controller/test_paused_worker.py replays it with SIGSTOP."""

from __future__ import annotations

import gc
import time

import pytest
import torch

import tq_stream as tq
from tests.conftest import keys_of, put_rows
from tq_stream.connection import placement
from tq_stream.errors import LeaseError, LeaseTakenOver

P = "train"
LEASE = 0.3


def task(stream: tq.Stream, n: int = 4) -> list[str]:
    """``n`` rows read by "reward" (writes ``r``), then by "train"; returns their keys."""
    ks = keys_of("k", n)
    stream.create_partition(P, consumers=["reward", "train"])
    put_rows(stream, ks)
    c = stream.client()
    c.register_task(P, "reward", ["x"], batch_size=n, lease_timeout=LEASE)
    c.register_task(P, "train", ["x", "r"], batch_size=n)
    return ks


def lapse(client: tq.Client) -> None:
    """The client's process stops renewing (paused): its lease runs out."""
    for hold in client._holds.values():
        hold.close()
    time.sleep(LEASE * 2.5)


def trained_r(stream: tq.Stream) -> list[float]:
    c = stream.client()
    meta = c.get_meta(P, "train", timeout=2)
    return c.get_data(meta)["r"].tolist()


def test_a_paused_worker_s_late_write_and_ack_are_refused(stream):
    task(stream)
    a, b = stream.client(), stream.client()
    old = a.get_meta(P, "reward")
    lapse(a)
    new = b.get_meta(P, "reward")
    assert new.keys == old.keys  # the lapsed share went to the next reader
    b.put_data(new, {"r": torch.full((4,), 2.0)})
    assert b.ack(new) == 4
    with pytest.raises(LeaseTakenOver, match=r"session='.*step 0 of task 'reward'.*lapsed"):
        a.put_data(old, {"r": torch.full((4,), 1.0)})
    with pytest.raises(LeaseTakenOver, match=r"acks, got session="):
        a.ack(old)
    assert trained_r(stream) == [2.0] * 4  # the live reader's result stands
    st = stream.stats()[P]["tasks"]["reward"]
    assert (st["acked"], st["expired"], st["redelivered"]) == (4, 4, 4)


def test_refused_while_the_new_reader_still_works_and_after_a_cancel(stream):
    task(stream)
    a, b = stream.client(), stream.client()
    old = a.get_meta(P, "reward")
    a.cancel()  # its claims end now, as when its loader stops
    new = b.get_meta(P, "reward")
    with pytest.raises(LeaseTakenOver):
        a.put_data(old, {"r": torch.full((4,), 1.0)})  # b holds it: a's write is refused
    with pytest.raises(LeaseTakenOver):
        a.ack(old)
    b.put_data(new, {"r": torch.full((4,), 2.0)})
    assert b.ack(new) == 4
    assert trained_r(stream) == [2.0] * 4


def test_a_lapsed_lease_nobody_took_still_accepts_its_late_work(stream):
    """No other reader came: the late result is the only one, and it counts."""
    task(stream)
    a = stream.client()
    old = a.get_meta(P, "reward")
    lapse(a)
    a.put_data(old, {"r": torch.full((4,), 1.0)})
    assert a.ack(old) == 4
    assert trained_r(stream) == [1.0] * 4


def test_a_write_that_began_before_the_takeover_does_not_commit(stream, monkeypatch):
    """Paused between its reserve and its commit while another reader takes over: the
    commit is refused, so nothing of the late write becomes visible."""
    task(stream)
    a, b = stream.client(), stream.client()
    old = a.get_meta(P, "reward")
    store = placement.store
    taken: list[tq.BatchMeta] = []

    def paused_store(*args, **kwargs):
        if not taken:  # a's store: another reader takes the share meanwhile
            a.cancel()
            taken.append(b.get_meta(P, "reward"))
        return store(*args, **kwargs)

    monkeypatch.setattr(placement, "store", paused_store)
    with pytest.raises(LeaseTakenOver):
        a.put_data(old, {"r": torch.full((4,), 1.0)})
    monkeypatch.setattr(placement, "store", store)
    b.put_data(taken[0], {"r": torch.full((4,), 2.0)})
    assert b.ack(taken[0]) == 4
    assert trained_r(stream) == [2.0] * 4


def test_a_loader_whose_batch_was_taken_over_raises_once(stream):
    """A trainer frozen past its lease: the batch went to another reader of its rank. The
    loader's ack says so once, then the loop goes on with the next batch."""
    ks = keys_of("k", 8)
    put_rows(stream, ks)
    stream.close_partition(P)
    loader = tq.StreamingDataLoader(tq.StreamingDataset(stream, P, "t", ["x"], batch_size=4,
                                                       lease_timeout=LEASE))
    it = iter(loader)
    next(it)
    tq.Client(stream.connection, session=loader.dataset.session).cancel()  # its claims lapse
    other = stream.client().get_meta(P, "t", 0)  # a restarted peer took step 0
    with pytest.raises(LeaseTakenOver):
        next(it)
    del it
    gc.collect()
    assert stream.client().ack(other) == 4
    rest = [b["x"].shape[0] for b in loader]  # the next iteration: step 1 only
    assert rest == [4]
    assert stream.stats()[P]["tasks"]["t"]["acked"] == 8


def test_a_takeover_is_a_lease_error(stream):
    assert issubclass(LeaseTakenOver, LeaseError)
