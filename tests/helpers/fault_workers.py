"""Code run by the fault suite's child processes (imports tq_stream only)."""

from __future__ import annotations

import json
import os
from multiprocessing.connection import Connection

import torch

import tq_stream as tq


def values(keys: list[str]) -> torch.Tensor:
    """A [n, 3] float row per key ``<prefix>_<int>``; its entries are that int."""
    ids = torch.tensor([float(k.rsplit("_", 1)[1]) for k in keys])
    return ids[:, None] * torch.ones(1, 3)


def train(stream: tq.Stream, partition: str, state_path: str, save_every: int,
          out: Connection, stop_after: int) -> None:
    """A trainer: a loader of task "t" (batches of 4), restored from ``state_path`` if
    it exists, saving its state there every ``save_every`` batches. Reports each
    batch's keys (and whether its values match) on ``out``; after ``stop_after``
    batches it reports "waiting" and blocks (the test kills it); at the end "done"."""
    ds = tq.StreamingDataset(stream, partition, "t", ["x"], batch_size=4)
    loader = tq.StreamingDataLoader(ds)
    if os.path.exists(state_path):
        with open(state_path) as f:
            loader.load_state_dict(json.load(f))
    for n, batch in enumerate(loader, 1):
        keys = list(tq.batch_meta(batch).keys)
        out.send(("batch", keys, bool(torch.equal(batch["x"], values(keys)))))
        if n % save_every == 0:
            tmp = state_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(loader.state_dict(), f)
            os.replace(tmp, state_path)
        if n == stop_after:
            out.send(("waiting", None, True))
            out.recv()  # blocks until the test kills this process
    out.send(("done", None, True))


def produce_forever(stream: tq.Stream, partition: str, out: Connection) -> None:
    """Write rows ``p_0, p_1, ...`` in puts of 8, reporting each committed put."""
    i = 0
    while True:
        keys = [f"p_{j}" for j in range(i, i + 8)]
        stream.writer(partition).put(keys, {"x": values(keys)})
        out.send(keys)
        i += 8


def put_and_hang(stream: tq.Stream, partition: str, out: Connection) -> None:
    """A producer stopped between ``reserve`` and ``commit``: its put of ``dead_0..7``
    reserves the rows, reports "reserved" and never stores the bytes (the test kills
    this process meanwhile)."""
    from tq_stream.connection import placement

    def hang(*args: object, **kwargs: object) -> None:
        out.send("reserved")
        out.recv()  # blocks until the test kills this process

    placement.store = hang  # type: ignore[assignment]
    keys = [f"dead_{j}" for j in range(8)]
    stream.writer(partition).put(keys, {"x": values(keys)})
