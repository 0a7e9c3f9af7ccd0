"""Waiting consumers in local mode: write→wake latency and the controller's idle CPU.

- ``wake``: one consumer waits in ``get_meta`` for a step; the producer puts the row
  that completes it; the latency is from just before the put to ``get_meta`` returning.
  Two producers: one that sleeps 5 ms before each put, and one that is busy for those
  5 ms (a rollout worker computing its row). Either way every process of the chain was
  idle for 5 ms: on this machine code then runs several times slower than in a
  back-to-back loop (a numpy or torch call on one row: a few microseconds warm, tens
  cold), which is what the figure measures. The consumer is a thread of the producer's
  process (both rows), or its own process (``consumer process``), as a trainer is; in
  one process, the consumer's wake-up also waits for the producer's thread to finish
  its put (the GIL).
- ``idle``: 16 consumers wait in ``get_meta`` on an empty partition while nothing is
  written; the controller process's CPU time over the window, as a share of one core.
  For comparison in the same run, ``idle (0.2 s slices)`` waits the way the loader did
  before waits were one request: ``get_meta`` re-sent every 0.2 s.

Prints a markdown table; ``--json`` adds the raw figures. Run from the repository root:
``python -m benchmarks.bench_waits [--rounds 200] [--waiters 16] [--idle-s 5]``.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import struct
import threading
import time

import numpy as np
import psutil
import torch

import tq_stream as tq
from tq_stream.errors import WaitTimeout


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def bench_wake(stream: tq.Stream, rounds: int, busy: bool = False) -> dict[str, float]:
    """p50/p99 of write→wake for one waiting consumer (ms); the producer sleeps 5 ms
    before each put, or is ``busy`` for 5 ms."""
    part = "wake-busy" if busy else "wake"
    stream.create_partition(part, consumers=["t"])
    client = stream.client()
    client.register_task(part, "t", ["x"], batch_size=1)
    writer = stream.writer(part)
    writer.put(["warm"], {"x": torch.zeros(1, 4)})
    client.ack(client.get_meta(part, "t", 0))
    lat: list[float] = []
    sent: dict[int, float] = {}
    ready = threading.Event()
    errors: list[BaseException] = []

    def consume() -> None:
        try:
            for step in range(1, rounds + 1):
                ready.set()
                meta = client.get_meta(part, "t", step, timeout=30)
                lat.append(time.perf_counter() - sent[step])
                client.ack(meta)
        except BaseException as exc:  # reported below
            errors.append(exc)
            ready.set()

    th = threading.Thread(target=consume, daemon=True)
    th.start()
    for step in range(1, rounds + 1):
        ready.wait(30)
        ready.clear()
        (_busy if busy else time.sleep)(0.005)  # the consumer waits inside get_meta
        sent[step] = time.perf_counter()
        writer.put([f"k{step}"], {"x": torch.zeros(1, 4)})
    th.join(60)
    if errors:
        raise errors[0]
    ms = np.asarray(lat) * 1e3
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "n": len(ms)}


def bench_wake_process(stream: tq.Stream, rounds: int) -> dict[str, float]:
    """``bench_wake`` with the consumer in its own process, as a trainer is: the
    latency is from just before the put (here) to ``get_meta`` returning there (both
    read the same monotonic clock)."""
    part = "wake-process"
    stream.create_partition(part, consumers=["t"])
    stream.client().register_task(part, "t", ["x"], batch_size=1)
    writer = stream.writer(part)
    to_child_r, to_child_w = os.pipe()
    to_parent_r, to_parent_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the consumer: says it is about to wait, then when get_meta returned
        code = 1
        try:
            client = stream.client()
            for step in range(rounds + 1):
                os.write(to_parent_w, b"r")
                meta = client.get_meta(part, "t", step, timeout=30)
                os.write(to_parent_w, struct.pack("<d", time.perf_counter()))
                client.ack(meta)
            code = 0
        finally:
            os._exit(code)
    lat: list[float] = []
    try:
        for step in range(rounds + 1):
            if _read(to_parent_r, 1) != b"r":
                raise RuntimeError("the consumer process stopped")
            time.sleep(0.005)  # the consumer waits inside get_meta
            sent = time.perf_counter()
            writer.put([f"k{step}"], {"x": torch.zeros(1, 4)})
            (done,) = struct.unpack("<d", _read(to_parent_r, 8))
            if step:  # step 0 warms the child's connections
                lat.append(done - sent)
    finally:
        _, status = os.waitpid(pid, 0)
        for fd in (to_child_r, to_child_w, to_parent_r, to_parent_w):
            os.close(fd)
    if status:
        raise RuntimeError(f"the consumer process failed (status {status})")
    ms = np.asarray(lat) * 1e3
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "n": len(ms)}


def _read(fd: int, n: int) -> bytes:
    """``n`` bytes from a pipe (b"" if the writer closed it first)."""
    out = b""
    while len(out) < n:
        ready, _, _ = select.select([fd], [], [], 60.0)
        chunk = os.read(fd, n - len(out)) if ready else b""
        if not chunk:
            return out
        out += chunk
    return out


def bench_idle(stream: tq.Stream, waiters: int, seconds: float, slice_s: float | None,
               tag: str) -> dict[str, float]:
    """The controller's CPU (% of one core) while ``waiters`` consumers wait."""
    part = f"idle-{tag}"
    stream.create_partition(part)
    stream.client().register_task(part, "t", ["x"], batch_size=1)
    stop = threading.Event()

    def wait(rank: int) -> None:
        client = stream.client()
        while not stop.is_set():
            try:
                client.get_meta(part, "t", rank, timeout=slice_s or seconds + 30)
            except WaitTimeout:
                continue
            except Exception:
                return

    threads = [threading.Thread(target=wait, args=(r,), daemon=True) for r in range(waiters)]
    for th in threads:
        th.start()
    time.sleep(1.0)  # every waiter is inside its wait
    ctrl = psutil.Process(stream._owner.pids[-1])  # the controller starts last
    c0, t0 = ctrl.cpu_times(), time.monotonic()
    time.sleep(seconds)
    c1, t1 = ctrl.cpu_times(), time.monotonic()
    stop.set()
    stream.writer(part).put([f"end{r}" for r in range(waiters)],
                            {"x": torch.zeros(waiters, 4)})  # ends the unsliced waits
    for th in threads:
        th.join(slice_s or 10)
    cpu = (c1.user + c1.system) - (c0.user + c0.system)
    return {"cpu_pct": 100.0 * cpu / (t1 - t0), "waiters": waiters}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--waiters", type=int, default=16)
    parser.add_argument("--idle-s", type=float, default=5.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    stream = tq.init(mode="local", storage_units=2)
    try:
        out = {
            "write→wake": bench_wake(stream, args.rounds),
            "write→wake (busy producer)": bench_wake(stream, args.rounds, busy=True),
            "write→wake (consumer process)": bench_wake_process(stream, args.rounds),
            "idle": bench_idle(stream, args.waiters, args.idle_s, None, "one"),
            "idle (0.2 s slices)": bench_idle(stream, args.waiters, args.idle_s, 0.2, "sliced"),
        }
    finally:
        stream.close()
    print("| local mode | figure |\n|---|---:|")
    for name, what in (("write→wake", "a thread of the producer's process, producer idle "
                                      "before the put"),
                       ("write→wake (busy producer)", "a thread of the producer's process, "
                                                      "producer busy before the put"),
                       ("write→wake (consumer process)", "its own process, producer idle "
                                                         "before the put")):
        w = out[name]
        print(f"| write→wake, one waiting consumer in {what} | "
              f"p50 {w['p50_ms']:.2f} ms, p99 {w['p99_ms']:.2f} ms (n={w['n']}) |")
    for name in ("idle", "idle (0.2 s slices)"):
        print(f"| controller CPU, {args.waiters} consumers waiting, {name} | "
              f"{out[name]['cpu_pct']:.2f}% of a core |")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
