"""Staleness scenarios shared by the embedded and the local-mode tests (issue 20 item 2):
a row is discarded only when it is stale against a version the trainer actually set,
prefetch never discards on a prediction, and the bound holds when a batch is yielded."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

import tq_stream as tq
from tq_stream.errors import WaitTimeout

BLOCKS = ((3, 16), (4, 16), (5, 16), (6, 8), (2, 8))  # (version, rows): 64 rows


def put_versions(stream: tq.Stream, part: str, blocks: Any = BLOCKS) -> int:
    keys, tags = [], []
    for v, n in blocks:
        tags += [{"version": v}] * n
        keys += [f"v{v}-{i}" for i in range(n)]
    stream.writer(part).put(keys, {"x": torch.zeros(len(keys), 2)}, tags=tags)
    return len(keys)


def closed_constant_version(stream: tq.Stream, part: str, num_workers: int = 0,
                            **loader: Any) -> tuple[list[int], dict[str, Any]]:
    """The replay: ``set_version(5)``, max_staleness=1, 64 rows at versions 3/4/5/6/2,
    the partition closed, the trainer never changes its version. Returns the versions
    of the rows trained and the task's stats."""
    trained = train_at_version_5(stream, part, BLOCKS, 20, 0.0, num_workers, **loader)
    return trained, stream.stats()[part]["tasks"]["actor"]


def train_at_version_5(stream: tq.Stream, part: str, blocks: Any, timeout: float,
                       step_seconds: float, num_workers: int = 0, pace: int | None = None,
                       **loader: Any) -> list[int]:
    """Rows of ``blocks`` in a closed partition, read 4 per step (prefetch 3,
    max_staleness=1) by a trainer at version 5 that never changes it and trains each
    step ``step_seconds``; with ``pace`` it declares a version change every ``pace``
    steps (``set_admission``), which steps formed ahead are predicted with. Returns the
    versions of the rows trained, in order."""
    stream.create_partition(part, consumers=["actor"])
    put_versions(stream, part, blocks)
    stream.close_partition(part)
    ds = tq.StreamingDataset(stream, part, "actor", ["x"], batch_size=4, prefetch=3,
                             timeout=timeout,
                             sampler=tq.samplers.StalenessSampler(max_staleness=1))
    dl = tq.StreamingDataLoader(ds, num_workers=num_workers, **loader)
    if pace is not None:
        ds.register()
        stream.set_admission(part, "actor", steps_per_version=pace)
    dl.set_version(5)
    trained: list[int] = []
    for batch in dl:
        trained += [t["version"] for t in tq.batch_meta(batch).tags]
        if step_seconds:
            time.sleep(step_seconds)  # the training step
    return trained


def every_n_steps(stream: tq.Stream, part: str, n: int, num_workers: int = 0,
                  admission: int | None = None, jump: int = 1, blocks: Any = None,
                  **loader: Any) -> tuple[list[int], list[int], dict[str, Any]]:
    """All 96 rows written at versions 0..5 (16 each; or ``blocks``) before training,
    the partition closed; the trainer starts at version 0 and bumps it by ``jump``
    every ``n`` steps (``n=0``: never; ``jump=2`` every step: faster than the one
    change per step a prefetch predicts, e.g. one version per minibatch). Returns the
    lags of the rows trained (version at yield - row version), the versions of all
    rows, and the task's stats."""
    stream.create_partition(part, consumers=["actor"])
    blocks = [(v, 16) for v in range(6)] if blocks is None else blocks
    put_versions(stream, part, blocks)
    stream.close_partition(part)
    ds = tq.StreamingDataset(stream, part, "actor", ["x"], batch_size=4, prefetch=3,
                             timeout=20,
                             sampler=tq.samplers.StalenessSampler(max_staleness=1))
    dl = tq.StreamingDataLoader(ds, num_workers=num_workers, **loader)
    if admission is not None:
        ds.register()
        stream.set_admission(part, "actor", admission)
    version = 0
    dl.set_version(version)
    lags: list[int] = []
    for step, batch in enumerate(dl):
        lags += [version - t["version"] for t in tq.batch_meta(batch).tags]
        if n and (step + 1) % n == 0:
            version += jump
            dl.set_version(version)
    return lags, [v for v, k in blocks for _ in range(k)], \
        stream.stats()[part]["tasks"]["actor"] | {"final_version": version}


def async_groups_constant_version(stream: tq.Stream, part: str, num_workers: int = 0,
                                  steps: int = 12, **loader: Any) -> list[int]:
    """An async run with groups: producers write groups of 4 rows tagged with the
    trainer's version (paced by admission), the trainer never changes its version.
    Every step must come (no WaitTimeout while complete groups within the bound are
    ready). Returns the lags of the rows trained."""
    stream.create_partition(part, consumers=["actor"])
    sampler = tq.samplers.StalenessSampler(tq.samplers.GroupSampler(group_size=4),
                                           max_staleness=1)
    ds = tq.StreamingDataset(stream, part, "actor", ["x"], batch_size=8, prefetch=3,
                             timeout=20, sampler=sampler)
    dl = tq.StreamingDataLoader(ds, num_workers=num_workers, **loader)
    dl.set_version(0)
    writer = stream.writer(part)
    stop = threading.Event()

    def produce() -> None:
        g = 0
        while not stop.is_set():
            try:
                writer.reserve(4, timeout=0.5)
            except WaitTimeout:
                continue
            keys = [f"g{g}-{i}" for i in range(4)]
            writer.put(keys, {"x": torch.zeros(4, 2)},
                       tags=[{"version": 0, "uid": g}] * 4)
            g += 1

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    lags: list[int] = []
    try:
        for step, batch in enumerate(dl):
            lags += [0 - t["version"] for t in tq.batch_meta(batch).tags]
            if step + 1 == steps:
                break
    finally:
        stop.set()
        producer.join(20)
    return lags


def held_for_turn(stream: tq.Stream, part: str, step_seconds: float, timeout: float,
                  num_workers: int = 0, **loader: Any) -> list[int]:
    """A step held for its turn while the trainer trains the ones before it: versions
    5, 6, 7 and 4 (4 rows each), the trainer at version 5 (never changed, though it
    declared one change per step), max_staleness=1, prefetch 3. Step 3 gets the
    version-4 rows, which are in the bound now but not at the version predicted for
    its turn (8): it waits for the trainer to reach it, about 3 training steps of
    ``step_seconds``. Returns the versions of the rows trained, in order."""
    return train_at_version_5(stream, part, [(5, 4), (6, 4), (7, 4), (4, 4)], timeout,
                              step_seconds, num_workers, pace=1, **loader)


def formed_by_a_reader_ahead(stream: tq.Stream, part: str, num_workers: int = 0,
                             **loader: Any) -> tuple[list[list[int]], dict[str, Any]]:
    """A step formed while the trainer's version is 0 and yielded after it set 1: a
    low-level reader of step 2 by number (DP lockstep control) forms steps 0-2 from
    rows at version 0 (max_staleness=0); the trainer trains step 0, sets version 1,
    and its next batch (step 1) must not hold version-0 rows. Rows at version 1 come
    once the trainer reads at version 1. Returns the versions of each batch trained
    (in order) and the task's stats."""
    stream.create_partition(part, consumers=["actor"])
    put_versions(stream, part, [(0, 6)])
    sampler = tq.samplers.StalenessSampler(max_staleness=0)
    ds = tq.StreamingDataset(stream, part, "actor", ["x"], batch_size=2, timeout=10,
                             sampler=sampler)
    dl = tq.StreamingDataLoader(ds, num_workers=num_workers, **loader)
    dl.set_version(0)
    reader = stream.client()
    reader.reading(part, "actor", 2)
    meta = reader.get_meta(part, "actor", 2, timeout=10)
    assert meta is not None and meta.step == 2
    reader.ack(meta)  # a gap the loader skips
    batches: list[list[int]] = []
    for step, batch in enumerate(dl):
        batches.append([t["version"] for t in tq.batch_meta(batch).tags])
        if step == 0:
            dl.set_version(1)  # one optimizer step: version 1 from the next batch on
            put_versions(stream, part, [(1, 4)])
            stream.close_partition(part)
    return batches, stream.stats()[part]["tasks"]["actor"]


def dp_rank_ahead(stream: tq.Stream, part: str) -> tuple[dict[int, list[int]], dict]:
    """DP 2: rank 0 trains 3 steps (setting versions 1, 2, 3) before rank 1 trains
    its first; rank 1 then trains the same steps at the versions they had (1 per
    step), setting each again. Rows at versions 0..3 (4 each), max_staleness=1.
    Returns the lags each rank saw (its own version at yield) and the stats."""
    stream.create_partition(part, consumers=["actor"])
    put_versions(stream, part, [(v, 4) for v in range(4)])
    stream.close_partition(part)
    loaders = []
    for rank in (0, 1):
        ds = tq.StreamingDataset(stream, part, "actor", ["x"], batch_size=1, dp_size=2,
                                 dp_rank=rank, timeout=10,
                                 sampler=tq.samplers.StalenessSampler(max_staleness=1))
        loaders.append(tq.StreamingDataLoader(ds))
    lags: dict[int, list[int]] = {0: [], 1: []}
    for rank, dl in enumerate(loaders):
        version = 0
        dl.set_version(version)
        for step, batch in enumerate(dl):
            lags[rank] += [version - t["version"] for t in tq.batch_meta(batch).tags]
            version += 1
            dl.set_version(version)
            if step == 2:
                break
    return lags, stream.stats()[part]["tasks"]["actor"]


def backlog_every_3_steps(stream: tq.Stream, part: str, prefetch: int, num_workers: int = 0,
                          **loader: Any) -> tuple[list[str], list[str], list[int],
                                                  dict[str, int]]:
    """60 rows at versions 0..4 (12 each) in a closed partition; the trainer at version
    1, one version more every 3 steps of 4 rows, max_staleness=1, no ``set_admission``:
    every row is within the bound at its turn. Returns the keys trained, the keys
    written, the lags at yield and the discards."""
    stream.create_partition(part, consumers=["actor"])
    keys = [f"k{i}" for i in range(60)]
    stream.writer(part).put(keys, {"x": torch.zeros(60, 1)},
                            tags=[{"version": i // 12} for i in range(60)])
    stream.close_partition(part)
    ds = tq.StreamingDataset(stream, part, "actor", ["x"], batch_size=4, prefetch=prefetch,
                             timeout=10, sampler=tq.samplers.StalenessSampler(max_staleness=1))
    dl = tq.StreamingDataLoader(ds, num_workers=num_workers, **loader)
    version = 1
    dl.set_version(version)
    trained: list[str] = []
    lags: list[int] = []
    for step, batch in enumerate(dl, 1):
        meta = tq.batch_meta(batch)
        trained += meta.keys
        lags += [version - t["version"] for t in meta.tags]
        if step % 3 == 0:
            version += 1
            dl.set_version(version)
    return trained, keys, lags, dict(stream.stats()[part]["tasks"]["actor"]["discarded"])
