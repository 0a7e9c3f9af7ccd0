"""Latency and rate of small operations: one-row puts, one-key gets, write→yield.

For each deployment mode (embedded, local with 2 storage units):

- ``put1``: ``writer.put([key], 3 fields x 128 float32)`` of a new row;
- ``get1``: ``stream.kv.get(key)`` of one such row (all 3 fields);
- each sequential (one thread) and with ``--threads`` concurrent threads;
- ``write→yield``: a producer puts single rows (one every ``--gap-ms``) and a
  ``StreamingDataLoader`` (batch_size=1) yields them; the latency is from just
  before the put to the batch arriving in the training loop.

Prints a markdown table (ops/s, p50 and p99 latency in ms); ``--json`` adds the raw
figures on one line, for scripts that compare builds. Run from the repository root:
``python -m benchmarks.bench_small_ops [--ops 2000] [--threads 16] [--modes local]``.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

import tq_stream as tq

FIELDS = ("a", "b", "c")
WIDTH = 128


def _row() -> dict[str, torch.Tensor]:
    return {f: torch.zeros(1, WIDTH) for f in FIELDS}


def _stats(lat_s: list[float], ops: int, wall_s: float) -> dict[str, float]:
    lat = np.asarray(lat_s) * 1e3
    return {"ops_s": ops / wall_s, "p50_ms": float(np.percentile(lat, 50)),
            "p99_ms": float(np.percentile(lat, 99)), "n": ops}


def _run(op: Callable[[int], object], ops: int, threads: int) -> dict[str, float]:
    """``op(i)`` for i in range(ops), split over ``threads`` threads; per-op latencies."""
    lats: list[list[float]] = [[] for _ in range(threads)]
    errors: list[BaseException] = []
    start = threading.Barrier(threads + 1)

    def work(t: int) -> None:
        mine = lats[t]
        try:
            start.wait(timeout=60)
            for i in range(t, ops, threads):
                t0 = time.perf_counter()
                op(i)
                mine.append(time.perf_counter() - t0)
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    pool = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(threads)]
    for th in pool:
        th.start()
    start.wait(timeout=60)
    t0 = time.perf_counter()
    for th in pool:
        th.join(timeout=600)
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return _stats([x for part in lats for x in part], ops, wall)


def bench_ops(stream: tq.Stream, ops: int, threads: int, tag: str) -> dict[str, dict]:
    row = _row()
    out: dict[str, dict] = {}
    for n_threads in (1, threads):
        part = f"{tag}-t{n_threads}"
        writer = stream.writer(part)
        for i in range(50):  # warm up: connections, slabs, schemas
            writer.put([f"warm{i}"], row)
            stream.kv.get(f"warm{i}", partition=part)
        out[f"put1 x{n_threads}"] = _run(lambda i, w=writer: w.put([f"k{i}"], row),
                                         ops, n_threads)
        out[f"get1 x{n_threads}"] = _run(
            lambda i, p=part: stream.kv.get(f"k{i}", partition=p), ops, n_threads)
    return out


def bench_yield(stream: tq.Stream, rows: int, gap_s: float, tag: str) -> dict[str, float]:
    """Write→yield latency of single rows to a waiting StreamingDataLoader."""
    part = f"{tag}-yield"
    writer = stream.writer(part)
    sent: dict[str, float] = {}
    errors: list[BaseException] = []

    def produce() -> None:
        try:
            for i in range(rows):
                time.sleep(gap_s)
                key = f"y{i}"
                sent[key] = time.perf_counter()
                writer.put([key], {"x": torch.zeros(1, WIDTH)})
            stream.close_partition(part)
        except BaseException as exc:
            errors.append(exc)

    ds = tq.StreamingDataset(stream, part, "t", ["x"], batch_size=1, timeout=30, prefetch=1)
    loader = tq.StreamingDataLoader(ds)
    producer = threading.Thread(target=produce, daemon=True)
    lat = []
    t0 = time.perf_counter()
    producer.start()
    for batch in loader:
        got = time.perf_counter()
        lat.append(got - sent[tq.batch_meta(batch).keys[0]])
    wall = time.perf_counter() - t0
    producer.join(timeout=60)
    if errors:
        raise errors[0]
    warm = lat[min(5, len(lat) - 1):]  # skip the first rows (connections, registration)
    return _stats(warm, len(warm), wall)


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, dict]:
    stream = tq.init() if mode == "embedded" else tq.init(mode=mode, storage_units=2)
    try:
        out = bench_ops(stream, args.ops, args.threads, mode)
        out["write→yield"] = bench_yield(stream, args.yield_rows, args.gap_ms / 1e3, mode)
        return out
    finally:
        stream.close()


def table(results: dict[str, dict[str, dict]]) -> str:
    lines = ["| mode | operation | ops/s | p50 ms | p99 ms |", "|---|---|---:|---:|---:|"]
    for mode, rows in results.items():
        for name, r in rows.items():
            rate = "" if name == "write→yield" else f"{r['ops_s']:.0f}"
            lines.append(f"| {mode} | {name} | {rate} | {r['p50_ms']:.3f} | "
                         f"{r['p99_ms']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="embedded,local")
    parser.add_argument("--ops", type=int, default=2000, help="operations per measurement")
    parser.add_argument("--threads", type=int, default=16, help="concurrent threads")
    parser.add_argument("--yield-rows", type=int, default=200)
    parser.add_argument("--gap-ms", type=float, default=5.0, help="between produced rows")
    parser.add_argument("--json", action="store_true", help="also print raw figures")
    args = parser.parse_args(argv)
    results = {m: run_mode(m, args) for m in args.modes.split(",")}
    print(table(results))
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
