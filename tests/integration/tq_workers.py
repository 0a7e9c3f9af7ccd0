"""Code that runs in spawned child processes of the integration tests.

Kept apart from the test modules, so a spawned child imports only this (plus
tq_stream), not pytest, hypothesis or the tests.
"""

from __future__ import annotations

import os
import signal
from multiprocessing.connection import Connection

import torch

import tq_stream as tq


def values(keys: list[str]) -> torch.Tensor:
    """A [n, 3] float row per key ``<prefix>_<int>``; its entries are that int."""
    ids = torch.tensor([float(k.rsplit("_", 1)[1]) for k in keys])
    return ids[:, None] * torch.ones(1, 3)


def produce(stream: tq.Stream, address: str, partition: str, n: int) -> None:
    """Write ``n`` rows through the unpickled handle and a connected one, then close."""
    joined = tq.connect(address, config=stream.config)
    half = n // 2
    for handle, ids in ((stream, range(half)), (joined, range(half, n))):
        keys = [f"c_{i}" for i in ids]
        handle.writer(partition).put(keys, {"x": values(keys)},
                                     tags=[{"pid": os.getpid()}] * len(keys))
    joined.close_partition(partition)
    joined.close()


def consume_and_die(stream: tq.Stream, partition: str, out: Connection) -> None:
    """Take step 0 of task "t", read its rows, report their keys, die by SIGKILL."""
    client = stream.client()
    meta = client.get_meta(partition, "t", step=0, timeout=30)
    client.get_data(meta)
    out.send(list(meta.keys))  # synchronous, unlike a Queue's feeder thread
    os.kill(os.getpid(), signal.SIGKILL)


def pool_worker(stream: tq.Stream, partition: str, task: str, consumer: str,
                out: Connection) -> None:
    """A stage worker of a pool: take the next batch (``step=None``) under the
    ``consumer`` name, read it, hold it a moment, ack it; until the end. Reports
    ``(keys, error)``: every key it processed, and the error that stopped it, if any."""
    client = tq.Client(stream, consumer=consumer)
    keys: list[str] = []
    try:
        while True:
            meta = client.get_meta(partition, task, timeout=30)
            if meta is None or meta.end:
                break
            client.get_data(meta)
            keys += meta.keys
            client.ack(meta)
        out.send((keys, ""))
    except Exception as exc:  # noqa: BLE001 — reported to the test
        out.send((keys, f"{type(exc).__name__}: {exc}"))
