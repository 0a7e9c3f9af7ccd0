"""TaskState: one consumer task's view of a partition.

Per row: ``state`` (NEW → LEASED → ACKED, or DISCARDED; LEASED → NEW again on
release or lease expiry) and ``acks`` (how many ranks of the row's DP group
acked it). Per step: a ``StepRecord`` with one share of rows per DP rank.

Invariants: a row is LEASED iff it belongs to exactly one open share; the
ready queue holds exactly the rows that are NEW and have every field of the
task written; an ACKED or DISCARDED row never becomes NEW again.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tq_stream.controller.fifo import ReadyQueue
from tq_stream.samplers.base import Sampler

NEW, LEASED, ACKED, DISCARDED = 0, 1, 2, 3


@dataclass
class StepRecord:
    """The rows of one step; ``shares[r] is None`` once rank r's share was
    returned (it is refilled on the next request)."""

    shares: list[np.ndarray | None]
    expiry: float
    end: bool = False
    done: list[bool] = field(default_factory=list)

    def open_rows(self) -> np.ndarray:
        parts = [s for s, d in zip(self.shares, self.done, strict=True) if s is not None and not d]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class TaskConfig:
    """What every rank of a task must agree on."""

    fields: tuple[str, ...]
    batch_size: int
    dp_size: int
    replicas: int
    lease_timeout: float
    drop_last: bool


class TaskState:
    """Consumption of one partition by one task (see module docstring)."""

    def __init__(self, name: str, config: TaskConfig, sampler: Sampler, size: int) -> None:
        self.name = name
        self.config = config
        self.sampler = sampler
        self.state = np.zeros(size, dtype=np.int8)
        self.acks = np.zeros(size, dtype=np.int16)
        self.queue = ReadyQueue(size)
        self.steps: dict[int, StepRecord] = {}
        self.next_step = 0
        self.ended = False
        self.version: int | None = None
        self.steps_per_version = 1
        self.discards: Counter[str] = Counter()
        self.handed_out = 0
        self.acked = 0
        # (sampler class name, sampler state) of a task restored from a checkpoint and
        # not yet registered again by its consumer; None once registered.
        self.restored: tuple[str, Any] | None = None

    def grow(self, size: int) -> None:
        extra = size - self.state.shape[0]
        if extra > 0:
            self.state = np.concatenate([self.state, np.zeros(extra, np.int8)])
            self.acks = np.concatenate([self.acks, np.zeros(extra, np.int16)])
            self.queue.grow(size)

    def offer(self, rows: np.ndarray, ready: np.ndarray) -> None:
        """Rows whose fields changed: those now ready and NEW become available."""
        fresh = rows[ready & (self.state[rows] == NEW) & ~self.queue.avail[rows]]
        self.queue.push(fresh)

    def lease(self, step: int, shares: list[np.ndarray], now: float) -> StepRecord:
        rows = np.concatenate(shares)
        self.queue.remove(rows)
        self.state[rows] = LEASED
        self.handed_out += len(rows)
        rec = StepRecord(list(shares), now + self.config.lease_timeout,
                         done=[False] * len(shares))
        self.steps[step] = rec
        return rec

    def discard(self, reason: str, rows: np.ndarray) -> np.ndarray:
        rows = rows[(self.state[rows] == NEW)]
        self.queue.remove(rows)
        self.state[rows] = DISCARDED
        self.discards[reason] += len(rows)
        return rows

    def give_back(self, rows: np.ndarray) -> None:
        """LEASED rows go back to the front of the ready queue."""
        rows = rows[self.state[rows] == LEASED]
        self.state[rows] = NEW
        self.acks[rows] = 0
        self.queue.push(rows, front=True)

    def expire(self, now: float) -> int:
        """Return the rows of every step whose lease has expired; count them."""
        n = 0
        for rec in self.steps.values():
            if rec.expiry < now and not rec.end:
                for r, share in enumerate(rec.shares):
                    if share is not None and not rec.done[r]:
                        self.give_back(share)
                        n += len(share)
                        rec.shares[r] = None
                rec.expiry = float("inf")
        return n

    def forget_row(self, rows: np.ndarray) -> None:
        """Rows freed from the partition (cleared): drop them from this task."""
        self.queue.remove(rows)
        self.state[rows] = NEW
        self.acks[rows] = 0

    def finished_rows(self, rows: np.ndarray) -> np.ndarray:
        return rows[self.state[rows] >= ACKED]

    def leased_count(self) -> int:
        return sum(len(s) for rec in self.steps.values() for s, d in
                   zip(rec.shares, rec.done, strict=True) if s is not None and not d)

    def stats(self) -> dict[str, Any]:
        return {
            "fields": list(self.config.fields),
            "available": int(self.queue.count),
            "leased": self.leased_count(),
            "handed_out": self.handed_out,
            "acked": self.acked,
            "discarded": dict(self.discards),
            "next_step": self.next_step,
            "version": self.version,
            "ended": self.ended,
            "at": time.time(),
        }
