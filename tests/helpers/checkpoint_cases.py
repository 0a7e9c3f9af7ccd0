"""Checkpoint cases shared by the embedded tests and their local-mode variants.

``save_under_load`` saves while producers write and a consumer acks, then restores
every checkpoint and checks each restored row's bytes are the ones written for its key.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

import tq_stream as tq
from tq_stream.errors import WaitTimeout

P = "load"
WIDTH = 8


def row_values(keys: list[str]) -> torch.Tensor:
    """Rows derived from their keys: every element of a row names its key."""
    ids = torch.tensor([float(int(k.split("_")[1]) * 1000 + int(k.split("_")[2]))
                        for k in keys])
    return ids[:, None] + torch.arange(WIDTH, dtype=torch.float32) / 100


def save_under_load(stream: tq.Stream, folder: str, restore: Callable[[str], tq.Stream],
                    saves: int = 4, producers: int = 2, rows_per_put: int = 6) -> int:
    """Save ``saves`` checkpoints while rows stream; returns how many rows were checked."""
    stream.create_partition(P)
    client = stream.client()
    client.register_task(P, "actor", ["x"], batch_size=4)
    stop = threading.Event()
    errors: list[BaseException] = []

    def produce(p: int) -> None:
        try:
            i = 0
            while not stop.is_set():
                keys = [f"k_{p}_{i + j}" for j in range(rows_per_put)]
                stream.writer(P).put(keys, {"x": row_values(keys)})
                i += rows_per_put
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    def consume() -> None:
        step = 0
        try:
            while not stop.is_set():
                try:
                    meta = client.get_meta(P, "actor", step, timeout=0.5)
                except WaitTimeout:
                    continue
                got = client.get_data(meta)["x"]
                assert torch.equal(got, row_values(meta.keys)), "a consumer read wrong bytes"
                client.ack(meta)
                step += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
    threads.append(threading.Thread(target=consume))
    for t in threads:
        t.start()
    paths = []
    try:
        deadline = time.monotonic() + 30
        while stream.stats()[P]["tasks"]["actor"]["acked"] < 8 * rows_per_put:
            assert time.monotonic() < deadline and not errors, errors  # rows must flow
            time.sleep(0.01)
        for s in range(saves):
            path = f"{folder}/ckpt{s}"
            stream.save(path)
            paths.append(path)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors
    checked = 0
    for path in paths:
        with restore(path) as restored:
            rows = restored.kv.list(partition=P)
            keys = [r["key"] for r in rows]
            assert all("x" in r["fields"] for r in rows), f"{path}: a put in flight restored"
            if keys:
                got = restored.kv.get_batch(keys, ["x"], partition=P)["x"]
                assert torch.equal(got, row_values(keys)), f"{path}: wrong bytes restored"
            checked += len(keys)
            stats = restored.stats()[P]
            assert stats["rows"] == len(rows)
    return checked
