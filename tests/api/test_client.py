"""The low-level client: the stage pattern, ack/release/renew/clear, DP shares."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

import tq_stream as tq
from tests.conftest import keys_of, put_rows
from tq_stream.errors import StateError, TQError, WaitTimeout

P = "train"


def test_old_logp_stage_pattern(stream):
    """Stage A reads input_ids and writes old_logp; stage B reads both."""
    keys = keys_of("s", 6)
    ids = torch.arange(24).reshape(6, 4)
    stream.create_partition(P, consumers=["old_logp", "actor"])
    stream.writer(P).put(keys, {"input_ids": ids})
    c = stream.client()
    c.register_task(P, "old_logp", ["input_ids"], batch_size=3)
    c.register_task(P, "actor", ["input_ids", "old_logp"], batch_size=2)
    with pytest.raises(WaitTimeout, match=r"\[.old_logp.\] were never written.*input_ids"):
        c.get_meta(P, "actor", step=0, timeout=0.05)  # nothing has old_logp yet
    for step in range(2):
        meta = c.get_meta(P, "old_logp", step)
        td = c.get_data(meta)
        assert set(td.keys()) == {"input_ids"}
        c.put_data(meta, {"old_logp": td["input_ids"].float().sum(-1, keepdim=True) / 10})
        assert c.ack(meta) == 3
    seen = []
    for step in range(3):
        meta = c.get_meta(P, "actor", step)
        td = c.get_data(meta)
        expect = td["input_ids"].float().sum(-1, keepdim=True) / 10
        assert torch.equal(td["old_logp"], expect)
        seen += meta.keys
        c.ack(meta)
    assert sorted(seen) == keys
    assert stream.stats()[P]["rows"] == 0  # acked by both tasks: freed


def test_put_data_to_freed_rows_is_refused(stream):
    stream.create_partition(P, consumers=["t"])
    put_rows(stream, keys_of("a", 2))
    c = stream.client()
    c.register_task(P, "t", ["x"], batch_size=2)
    meta = c.get_meta(P, "t", 0)
    c.ack(meta)  # the only task acked: rows freed
    with pytest.raises(StateError, match="freed meanwhile"):
        c.put_data(meta, {"y": torch.ones(2)})
    assert stream.kv.list(P) == []  # no half-written row was created


def test_get_data_of_cleared_rows_raises(stream):
    put_rows(stream, keys_of("a", 2))
    c = stream.client()
    c.register_task(P, "t", ["x"], batch_size=2)
    meta = c.get_meta(P, "t", 0)
    assert c.clear(meta) == 2
    put_rows(stream, ["b0", "b1"])  # may reuse the freed slots
    with pytest.raises(TQError):
        c.get_data(meta)


def test_release_hands_rows_out_again(stream):
    put_rows(stream, keys_of("a", 4))
    c = stream.client()
    c.register_task(P, "t", ["x"], batch_size=2)
    m0 = c.get_meta(P, "t", 0)
    c.release(m0)
    assert stream.stats()[P]["tasks"]["t"]["claimed"] == 0
    other = stream.client()
    assert other.get_meta(P, "t", None).keys == m0.keys  # the next reader: the same rows
    m1 = c.get_meta(P, "t", None)
    assert m1.step == 1 and not set(m1.keys) & set(m0.keys)
    st = stream.stats()[P]["tasks"]["t"]
    assert st["leased"] == 4 and st["available"] == 0 and st["redelivered"] == 2


def test_renew_and_clear_by_keys(stream, clock):
    stream.create_partition(P, consumers=["t"])
    put_rows(stream, keys_of("a", 3))
    c = stream.client()
    c.register_task(P, "t", ["x"], batch_size=3, lease_timeout=10.0)
    meta = c.get_meta(P, "t", 0)
    clock.advance(8)
    c.renew(meta)
    clock.advance(8)
    assert c.clear(["a0"], partition=P) == 1
    assert c.ack(meta) == 2  # the lease survived; the cleared row is simply gone
    assert stream.stats()[P]["rows"] == 0


def test_rows_spread_over_storage_units():
    with tq.init(storage_units=3) as s:
        keys = keys_of("k", 10)
        s.writer(P).put(keys, {"x": torch.arange(10.0), "r": [torch.ones(i) for i in range(10)],
                               "o": [f"v{i}" for i in range(10)]})
        assert all(u.nbytes() > 0 for u in s.connection.units())
        order = ["k7", "k0", "k5", "k9", "k1"]
        td = s.kv.get_batch(order, partition=P)
        assert td["x"].tolist() == [7.0, 0.0, 5.0, 9.0, 1.0]
        assert [t.shape[0] for t in td["r"].unbind()] == [7, 0, 5, 9, 1]
        assert td.get("o").tolist() == ["v7", "v0", "v5", "v9", "v1"]


def test_dp_shares_are_disjoint_and_replicas_identical(stream):
    stream.create_partition(P, consumers=["t"])
    put_rows(stream, keys_of("a", 8))
    c = stream.client()
    c.register_task(P, "t", ["x"], batch_size=2, dp_size=2, replicas=2)
    r0 = c.get_meta(P, "t", 0, dp_rank=0, replica=0)  # required with replicas=2
    r1 = c.get_meta(P, "t", 0, dp_rank=1, replica=0)
    r0b = c.get_meta(P, "t", 0, dp_rank=0, replica=1)  # the other replica of rank 0
    assert r0.keys == r0b.keys and not set(r0.keys) & set(r1.keys)
    assert c.ack(r0) == 0   # one replica of two: not acked yet
    assert c.ack(r0) == 0   # the same replica again: still one of two
    assert c.ack(r0b) == 2
    assert stream.stats()[P]["rows"] == 6


def test_a_returned_share_keeps_its_rows_for_its_rank(stream):
    """Rank 0 returns its share of step 0; it gets the same rows again, while rank 1 may
    run ahead, and at the end of the stream both ranks get the same number of batches."""
    put_rows(stream, keys_of("a", 8))
    c = stream.client()
    c.register_task(P, "t", ["x"], batch_size=2, dp_size=2)
    m0 = c.get_meta(P, "t", 0, dp_rank=0)
    c.ack(c.get_meta(P, "t", 0, dp_rank=1))
    c.release(m0)
    assert not set(c.get_meta(P, "t", 1, dp_rank=1).keys) & set(m0.keys)
    stream.close_partition(P)
    counts, nxt = {0: 0, 1: 1}, {0: 0, 1: 1}
    for _ in range(5):
        for rank in (0, 1):
            meta = c.get_meta(P, "t", nxt[rank], dp_rank=rank, timeout=1.0)
            if not meta.end:
                if (rank, nxt[rank]) == (0, 0):
                    assert meta.keys == m0.keys
                counts[rank] += 1
                nxt[rank] += 1
                c.ack(meta)
    assert counts == {0: 2, 1: 2} and nxt == {0: 2, 1: 2}
    st = stream.stats()[P]["tasks"]["t"]
    assert st["acked"] == 8 and st["ended"]


def test_expired_share_is_refilled_for_its_rank(stream, clock):
    put_rows(stream, keys_of("a", 4))
    c = stream.client()
    c.register_task(P, "t", ["x"], batch_size=1, dp_size=2, lease_timeout=5.0)
    dead = c.get_meta(P, "t", 0, dp_rank=0)
    c.ack(c.get_meta(P, "t", 0, dp_rank=1))
    clock.advance(6)
    again = c.get_meta(P, "t", 0, dp_rank=0)  # rank 0 restarted: same rows again
    assert again.keys == dead.keys
    c.ack(again)
    s0, s1 = c.get_meta(P, "t", 1, dp_rank=0), c.get_meta(P, "t", 1, dp_rank=1)
    assert len(s0) == len(s1) == 1
    assert not np.isin(s0.index, s1.index).any()


def test_async_put(stream):
    async def produce():
        w = stream.writer(P)
        await asyncio.gather(*(w.aput([f"a{i}"], {"x": torch.full((1, 2), float(i))})
                               for i in range(4)))

    asyncio.run(produce())
    td = stream.kv.get_batch([f"a{i}" for i in range(4)], partition=P)
    assert td["x"][:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
