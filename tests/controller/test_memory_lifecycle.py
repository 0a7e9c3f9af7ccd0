"""Memory comes back: rows acked by every task, or cleared, free their storage."""

from __future__ import annotations

import torch

import tq_stream as tq
from tests.conftest import keys_of

P = "train"


def nbytes(stream: tq.Stream) -> int:
    return sum(u.nbytes() for u in stream.connection.units())


def put_round(stream: tq.Stream, r: int, n: int = 16) -> list[str]:
    keys = keys_of(f"r{r}_", n)
    stream.writer(P).put(keys, {
        "x": torch.randn(n, 8),
        "r": [torch.ones(1 + (i * 7 + r) % 50) for i in range(n)],
        "s": [f"{r}-{i}" for i in range(n)],
    }, tags=[{"round": r}] * n)
    stream.writer(P).put(keys, {"reward": torch.ones(n)})
    return keys


def test_long_run_returns_to_baseline():
    with tq.init(storage_units=2) as stream:
        stream.create_partition(P, consumers=["old_logp", "actor"])
        client = stream.client()
        client.register_task(P, "old_logp", ["x"], batch_size=8)
        client.register_task(P, "actor", ["x", "r", "reward"], batch_size=4, dp_size=2)
        steps = {"old_logp": 0, "actor": 0}
        sizes = set()
        for r in range(50):
            put_round(stream, r)
            assert nbytes(stream) > 0
            for _ in range(2):
                meta = client.get_meta(P, "old_logp", steps["old_logp"])
                client.get_data(meta)
                client.ack(meta)
                steps["old_logp"] += 1
            for _ in range(2):
                for rank in (0, 1):
                    meta = client.get_meta(P, "actor", steps["actor"], dp_rank=rank)
                    client.get_data(meta)
                    client.ack(meta)
                steps["actor"] += 1
            assert stream.stats()[P]["rows"] == 0
            assert nbytes(stream) == 0
            sizes.add(stream.connection.controller().book.parts[P].size)
        assert max(sizes) <= 64  # row indexes are reused, metadata does not grow
        for task in ("old_logp", "actor"):
            st = stream.stats()[P]["tasks"][task]
            assert st["acked"] == 800 and st["leased"] == 0 and st["available"] == 0


def test_loader_run_frees_everything():
    with tq.init() as stream:
        stream.create_partition(P, consumers=["actor"])
        ds = tq.StreamingDataset(stream, P, "actor", ["x", "r"], batch_size=8, timeout=5.0)
        loader = tq.StreamingDataLoader(ds)
        it = iter(loader)
        for r in range(20):
            put_round(stream, r)
            next(it)
            next(it)
        stream.close_partition(P)
        assert list(it) == []
        assert stream.stats()[P]["rows"] == 0 and nbytes(stream) == 0


def test_rows_stay_until_every_task_acked():
    with tq.init() as stream:
        stream.create_partition(P, consumers=["a", "b"])
        client = stream.client()
        client.register_task(P, "a", ["x"], batch_size=16)
        client.register_task(P, "b", ["x"], batch_size=16)
        put_round(stream, 0)
        client.ack(client.get_meta(P, "a", 0))
        assert stream.stats()[P]["rows"] == 16 and nbytes(stream) > 0
        client.ack(client.get_meta(P, "b", 0))
        assert stream.stats()[P]["rows"] == 0 and nbytes(stream) == 0


def test_clear_frees_memory():
    with tq.init() as stream:
        client = stream.client()
        client.register_task(P, "a", ["x"], batch_size=4)
        keys = put_round(stream, 0)
        leased = client.get_meta(P, "a", 0)
        assert client.clear(keys[:8], partition=P) == 8
        assert stream.stats()[P]["rows"] == 8 and nbytes(stream) > 0
        stream.kv.clear(partition=P)
        assert stream.stats()[P]["rows"] == 0 and nbytes(stream) == 0
        assert stream.stats()[P]["tasks"]["a"]["available"] == 0
        assert client.ack(leased) == 0  # its rows are gone; the ack is harmless


def test_loader_keeps_no_trained_batch():
    """A loader's dataset does not hold on to every batch it yielded (issue 20 item 6:
    each consumer grew ~1.8 KB per row, every step's BatchMeta still reachable)."""
    import gc
    import weakref

    with tq.init() as stream:
        stream.create_partition(P, consumers=["actor"])
        ds = tq.StreamingDataset(stream, P, "actor", ["x"], batch_size=8, timeout=5.0)
        it = iter(tq.StreamingDataLoader(ds))
        metas = []
        for r in range(30):
            put_round(stream, r, n=8)
            metas.append(weakref.ref(tq.batch_meta(next(it))))
        gc.collect()
        alive = sum(ref() is not None for ref in metas)
        assert alive <= 2, f"{alive} of 30 trained batches still reachable"
        it.close()
