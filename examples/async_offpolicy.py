"""Asynchronous off-policy RL: producers run ahead of the trainer, within a bound.

Run from the repository root (CPU, a few seconds)::

    python -m examples.async_offpolicy

The trainer bumps its policy version after every optimizer step
(``loader.set_version``). Rows carry the version of the weights that produced them
(tag ``version``); ``StalenessSampler(max_staleness=1)`` discards rows more than one
version behind, with reason ``"stale"``. Producers call ``writer.reserve(n)`` before
generating: it blocks while the rows already in flight would be consumed too late,
so a producer that keeps its weights fresh wastes (almost) nothing. The second
producer here syncs its weights only every few batches (a slow weight transfer), so
some of its rows arrive too old and are discarded; ``stats()`` counts them by reason.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import threading
import time

import torch

import tq_stream as tq

BATCH, BATCHES_PER_PRODUCER = 8, 12
PART, TASK = "train", "trainer"


def producer(stream: tq.Stream, name: str, sync_every: int, trainer_version: mp.Value,
             written: mp.Queue) -> None:
    """Generates BATCH rows at a time; reloads the trainer's weights every
    ``sync_every`` batches (1 = always fresh)."""
    writer = stream.writer(PART)
    gen = torch.Generator().manual_seed(len(name))
    version = trainer_version.value
    for b in range(BATCHES_PER_PRODUCER):
        writer.reserve(BATCH, timeout=30)  # wait for room in the staleness window
        if b % sync_every == 0:
            version = trainer_version.value  # "load the latest weights"
        time.sleep(0.01)  # generation takes a while
        keys = [f"{name}_{b}_{i}" for i in range(BATCH)]
        writer.put(keys, {"obs": torch.randn(BATCH, 4, generator=gen)},
                   tags=[{"version": version}] * BATCH)
        written.put(len(keys))


def main() -> dict:
    stream = tq.init(mode="local", storage_units=1)
    stream.create_partition(PART, consumers=[TASK])
    ctx = mp.get_context("fork")
    trainer_version = ctx.Value("i", 0)
    written: mp.Queue = ctx.Queue()

    sampler = tq.samplers.StalenessSampler(max_staleness=1)
    ds = tq.StreamingDataset(stream, PART, TASK, ["obs"], batch_size=BATCH, sampler=sampler,
                             timeout=30, prefetch=1)
    loader = tq.StreamingDataLoader(ds)
    loader.set_version(0)  # before producers reserve: the window starts from version 0

    procs = [ctx.Process(target=producer, args=(stream, "fresh", 1, trainer_version, written)),
             ctx.Process(target=producer, args=(stream, "laggy", 4, trainer_version, written))]
    for p in procs:
        p.start()

    def close_when_done() -> None:  # the stream ends once both producers finished
        for p in procs:
            p.join(timeout=60)
        stream.close_partition(PART)

    closer = threading.Thread(target=close_when_done, daemon=True)
    closer.start()

    policy = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(policy.parameters(), lr=0.01)
    version, trained, lags = 0, [], []
    for batch in loader:
        loss = policy(batch["obs"]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        meta = tq.batch_meta(batch)
        lags += [version - t["version"] for t in meta.tags]  # staleness when trained
        trained += meta.keys
        version += 1
        loader.set_version(version)  # rows from weights older than version-1 go stale
        trainer_version.value = version  # "publish the weights" to the producers
    closer.join(timeout=60)

    produced = 0
    while not written.empty():
        produced += written.get()
    task = stream.stats()[PART]["tasks"][TASK]
    stream.close()
    result = {
        "produced": produced,
        "trained": len(trained),
        "duplicates": len(trained) - len(set(trained)),
        "discarded": task["discarded"],  # by reason, e.g. {"stale": 8}
        "lost": produced - len(set(trained)) - sum(task["discarded"].values()),
        "steps": version,
        "max_lag": max(lags),  # versions between a row's weights and its training step
    }
    print("RESULT " + json.dumps(result))
    return result


if __name__ == "__main__":
    main()
