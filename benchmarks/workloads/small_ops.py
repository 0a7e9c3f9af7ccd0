"""Workload 2: one-row put and one-key get, sequential and concurrent: ops/s, p50/p99."""

from __future__ import annotations

import threading
import time

import torch
from tensordict import TensorDict

from benchmarks.workloads.common import Row, Shapes, percentiles


def _row(width: int) -> TensorDict:
    return TensorDict({f"f{i}": torch.randn(1, width) for i in range(3)}, batch_size=[1])


def _loop(fn, keys: list[str], lat: list[float]) -> None:
    for k in keys:
        t = time.perf_counter()
        fn(k)
        lat.append(time.perf_counter() - t)


def _measure(fn, keys: list[str], threads: int) -> tuple[float, list[float]]:
    lat: list[float] = []
    parts = [keys[i::threads] for i in range(threads)]
    workers = [threading.Thread(target=_loop, args=(fn, p, lat)) for p in parts]
    t = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return len(keys) / (time.perf_counter() - t), lat


def run(system, shapes: Shapes) -> list[Row]:
    rows: list[Row] = []
    td = _row(shapes.small_width)
    for threads in (1, shapes.small_threads):
        label = "sequential" if threads == 1 else f"{threads} concurrent"
        keys = [f"small-{threads}-{i}" for i in range(shapes.small_ops)]
        ops, lat = _measure(lambda k: system.put([k], td), keys, threads)
        p50, p99 = percentiles(lat)
        rows.append(Row("small ops", f"put 1 row, {label}", system.name, ops, "ops/s",
                        {"p50_ms": p50, "p99_ms": p99}))
        ops, lat = _measure(lambda k: system.get([k], None), keys, threads)
        p50, p99 = percentiles(lat)
        rows.append(Row("small ops", f"get 1 key, {label}", system.name, ops, "ops/s",
                        {"p50_ms": p50, "p99_ms": p99}))
        system.clear(keys)
    return rows
