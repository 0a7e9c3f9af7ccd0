"""The staleness bound holds when a batch reaches the training loop, although steps
are formed ahead (prefetch) under an older version (issue #10 item 2)."""

from __future__ import annotations

import threading

import torch

import tq_stream as tq
from tq_stream.errors import WaitTimeout

P = "train"


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
