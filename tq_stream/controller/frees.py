"""Freeing slots in storage units, and the frees to retry while a unit is down.

Freeing is the controller's business, never the caller's error: a unit that cannot be
reached keeps its slots unusable (no new row gets them) and the free is retried with the
next one, so an ack or clear succeeds as a whole. The frees to retry are kept one entry
per (unit, partition): bounded by the deployment's shape and never dropped (a dropped
free would keep its slots unusable for good).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

FreeFn = Callable[[int, str, np.ndarray], None]
Free = tuple[int, str, np.ndarray]  # (unit, partition, slots)
logger = logging.getLogger(__name__)


def no_free(unit: int, partition: str, slots: np.ndarray) -> None:
    """The free of a controller without storage units (metadata only)."""


def coalesce(frees: list[Free]) -> list[Free]:
    """``frees`` merged into one entry per (unit, partition)."""
    merged: dict[tuple[int, str], list[np.ndarray]] = {}
    for unit, partition, slots in frees:
        merged.setdefault((unit, partition), []).append(np.asarray(slots, dtype=np.int64))
    return [(u, p, parts[0] if len(parts) == 1 else np.concatenate(parts))
            for (u, p), parts in merged.items()]


class Frees:
    """Sends frees to the units through ``free``; keeps those that failed for the next
    call. ``lock`` is the controller's: it guards the list, never a unit call."""

    def __init__(self, free: FreeFn, lock: AbstractContextManager[Any]) -> None:
        self._free = free
        self._lock = lock
        self._pending: list[Free] = []

    def run(self, partition: str, freed: list[tuple[int, np.ndarray]],
            give: Callable[[int, str, np.ndarray], None]) -> None:
        """Free ``freed`` (unit, slots) of ``partition`` and every pending free; ``give``
        (called under the lock) makes the slots of each free that succeeded reusable."""
        with self._lock:
            todo = self._pending + [(u, partition, slots) for u, slots in freed]
            self._pending = []
        if not todo:
            return
        done, failed = [], []
        for unit, part_name, slots in todo:
            try:
                self._free(unit, part_name, slots)
                done.append((unit, part_name, slots))
            except Exception as exc:  # the unit is down: retried later
                logger.warning("freeing %d slots of partition %r on unit %d failed (%s); "
                               "retried later", len(slots), part_name, unit, exc)
                failed.append((unit, part_name, slots))
        with self._lock:
            self._pending = coalesce(self._pending + failed)
            for unit, part_name, slots in done:
                give(unit, part_name, slots)

    def defer(self, partition: str, unit: int, slots: np.ndarray) -> None:
        """Free ``slots`` of ``partition`` on ``unit`` with the next ``run`` (the caller
        holds the lock, so it may not call the unit now)."""
        self._pending = coalesce(self._pending + [(unit, partition, slots)])

    def forget_unit(self, unit: int) -> list[tuple[str, np.ndarray]]:
        """Drop the pending frees of ``unit`` (lost: nothing left to free there); returns
        their (partition, slots). The caller holds the lock."""
        mine = [(p, s) for u, p, s in self._pending if u == unit]
        self._pending = [f for f in self._pending if f[0] != unit]
        return mine
