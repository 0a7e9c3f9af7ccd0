"""Shapes, timing helpers and the result row shared by the workloads."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Shapes:
    """Workload sizes; ``full()`` is the issue's fixed shapes, ``quick()`` a smoke test."""

    bulk_rows: int = 1024
    bulk_fields: int = 9
    bulk_width: int = 8192
    small_width: int = 128
    small_ops: int = 500
    small_threads: int = 16
    stream_rows: int = 4096
    stream_seq: int = 1024
    scale_rows: tuple[int, ...] = (10_000, 100_000, 1_000_000)
    scale_fields: int = 20
    repeats: int = 3

    @staticmethod
    def full() -> Shapes:
        return Shapes()

    @staticmethod
    def quick() -> Shapes:
        return Shapes(bulk_rows=64, bulk_fields=3, bulk_width=1024, small_ops=50,
                      small_threads=4, stream_rows=256, stream_seq=64,
                      scale_rows=(10_000,), scale_fields=4, repeats=1)


@dataclass
class Row:
    """One line of a results table."""

    workload: str
    case: str
    system: str
    value: float
    unit: str
    extra: dict[str, Any] = field(default_factory=dict)


def best_time(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """The fastest of ``repeats`` timed calls (after ``warmup`` untimed ones), seconds."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def percentiles(samples_s: list[float]) -> tuple[float, float]:
    """p50 and p99 in milliseconds."""
    if not samples_s:
        return float("nan"), float("nan")
    arr = np.asarray(samples_s) * 1e3
    return float(np.percentile(arr, 50)), float(np.percentile(arr, 99))


def in_rounds(names: list[str], measure: Callable[[str], list[Row]], rounds: int,
              label: str) -> list[list[Row]]:
    """``measure(name)`` of every name, ``rounds`` times over (all names once per round):
    on a shared, noisy machine a ratio is only meaningful within one round, and the
    rounds show whether it holds."""
    import sys

    out = []
    for k in range(rounds):
        rows: list[Row] = []
        for name in names:
            print(f"## {label} round {k + 1}/{rounds}: {name}", file=sys.stderr, flush=True)
            rows += measure(name)
        out.append(rows)
    return out
