"""Code that runs in spawned child processes of the integration tests.

Kept apart from the test modules, so a spawned child imports only this (plus
tq_stream), not pytest, hypothesis or the tests.
"""

from __future__ import annotations

import os
import signal
import time
from multiprocessing.connection import Connection
from typing import Any

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
    client = tq.Client(stream.connection, consumer=consumer)
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


def ahead_pool_worker(stream: tq.Stream, partition: str, task: str, consumer: str,
                      ready: Any, out: Connection) -> None:
    """A pool worker that fetches one batch ahead: take a batch, wait until every worker
    holds one (``ready``, a Barrier), ask for the next, then ack the first. Reports
    ``(keys of the first, the next one's end flag, error)``."""
    client = tq.Client(stream.connection, consumer=consumer)
    keys: list[str] = []
    try:
        meta = client.get_meta(partition, task, timeout=30)
        keys = list(meta.keys)
        ready.wait(60)
        nxt = client.get_meta(partition, task, timeout=20)
        client.ack(meta)
        out.send((keys, bool(nxt.end), ""))
    except Exception as exc:  # noqa: BLE001 — reported to the test
        out.send((keys, False, f"{type(exc).__name__}: {exc}"))


def deleted_shm_mapped() -> int:
    """Mappings of /dev/shm segments their unit unlinked, in this process."""
    with open("/proc/self/maps") as f:
        return sum("/dev/shm/" in line and "(deleted)" in line for line in f)


def _fds_but_live_segments() -> int:
    """Open fds, less those of live /dev/shm segments (a mapping each: their number
    follows the slabs, which grow until the partition is full)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        n += not link.startswith("/dev/shm/") or link.endswith("(deleted)")
    return n


def _usage() -> tuple[float, int, int]:
    """(RSS in MB, fds but live segments', unlinked /dev/shm segments still mapped)."""
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    return rss, _fds_but_live_segments(), deleted_shm_mapped()


def soak_produce(stream: tq.Stream, partition: str, p: int, out: Any, stop: Any) -> None:
    """Put 8 rows of 256 tokens at a time until ``stop``; report usage every second."""
    w = stream.writer(partition)
    i, last = 0, 0.0
    try:
        while not stop.is_set():
            keys = [f"p{p}_{i * 8 + j}" for j in range(8)]
            w.put(keys, {"input_ids": torch.arange(8 * 256).view(8, 256)}, timeout=60)
            i += 1
            if time.monotonic() - last >= 1.0:
                last = time.monotonic()
                out.put(("producer", p, last, i * 8, *_usage()))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out.put(("error", f"producer {p}", repr(exc)))


def soak_consume(stream: tq.Stream, partition: str, rank: int, out: Any, stop: Any) -> None:
    """Rank ``rank`` of 2 reads batches of 32 through a loader until ``stop``; reports
    every batch's arrival and its usage every second."""
    ds = tq.StreamingDataset(stream, partition, "actor", ["input_ids"], batch_size=32,
                             dp_rank=rank, dp_size=2, timeout=60)
    rows, last = 0, 0.0
    try:
        for batch in tq.StreamingDataLoader(ds):
            rows += len(batch)
            now = time.monotonic()
            if now - last >= 1.0:
                last = now
                out.put(("consumer", rank, now, rows, *_usage()))
            else:
                out.put(("batch", rank, now, rows))
            if stop.is_set():
                return
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out.put(("error", f"consumer {rank}", repr(exc)))


def gloo_rank(rank: int, world: int, init_file: str, stream: tq.Stream, partition: str,
              replica_of: str, out: Connection) -> None:
    """One trainer rank of DP 2 x 2 replicas over gloo (rank ``r`` is DP rank ``r // 2``),
    its loader with 2 DataLoader workers. ``replica_of`` is ``"peer"`` (``replica=r % 2``,
    as the README says) or ``"zero"`` (every peer claims replica 0). Reports ``(steps,
    keys, error)``: what it trained, and the error that stopped it, if any."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    steps: list[int] = []
    keys: list[str] = []
    error = ""
    try:
        ds = tq.StreamingDataset(stream, partition, "t", ["x"], batch_size=4,
                                 dp_rank=rank // 2, dp_size=2, replicas=2,
                                 replica=rank % 2 if replica_of == "peer" else 0,
                                 timeout=30)
        for batch in tq.StreamingDataLoader(ds, num_workers=2):
            meta = tq.batch_meta(batch)
            steps.append(meta.step)
            keys += meta.keys
            time.sleep(0.05)  # "training"
    except Exception as exc:  # noqa: BLE001 — reported to the test
        error = f"{type(exc).__name__}: {exc}"
    out.send((steps, keys, error))
    dist.destroy_process_group()


def paused_reward_worker(stream: tq.Stream, partition: str, go: Any, out: Connection) -> None:
    """A reward worker that is paused (SIGSTOP, by the test) while it holds a batch:
    reports the keys it got, then, once ``go`` is set, writes ``r`` = 1 through its old
    meta and acks it, reporting each outcome (``"ok"`` or the error's class name)."""
    client = stream.client()
    meta = client.get_meta(partition, "reward", timeout=30)
    out.send(list(meta.keys))
    go.wait(60)
    outcomes = []
    for call in (lambda: client.put_data(meta, {"r": torch.ones(len(meta))}),
                 lambda: client.ack(meta)):
        try:
            call()
            outcomes.append("ok")
        except Exception as exc:  # noqa: BLE001 — reported to the test
            outcomes.append(type(exc).__name__)
    out.send(outcomes)
