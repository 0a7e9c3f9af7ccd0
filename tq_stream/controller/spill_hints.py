"""Which fields of live rows no declared reader needs any more, told to their units.

A partition created with a ``memory_budget`` (``PartitionMeta.spills``) has its units told,
after acks and discards, which slots' fields every declared consumer that reads the field
has finished while the row still lives (another consumer has not): the unit moves them
to disk (``StorageUnit.may_spill``), so what is still to be read keeps the memory. The
controller knows readers and acks; units know bytes: this is the one message between.

Hints are advice: one that fails is dropped (the rows stay in memory, where they are
still read correctly), never retried, so a dead unit costs nothing but a log line.
Pending hints are kept one entry per (unit, partition, field), so they stay bounded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from tq_stream.controller.partition import PartitionMeta
from tq_stream.controller.task import TaskState

SpillFn = Callable[[int, str, np.ndarray, list[str]], None]
logger = logging.getLogger(__name__)


def no_spill(unit: int, partition: str, slots: np.ndarray, fields: list[str]) -> None:
    """The hint of a controller without storage units (metadata only)."""


def done_fields(part: PartitionMeta, tasks: Mapping[str, TaskState],
                rows: np.ndarray) -> dict[tuple[int, str], np.ndarray]:
    """``{(unit, field): slots}`` of ``rows`` whose field every declared consumer reading
    it finished, of rows some consumer has not (those are freed instead)."""
    if not part.spills or part.consumers is None or len(rows) == 0:
        return {}
    done: dict[str, np.ndarray] = {}
    readers: dict[str, np.ndarray] = {}
    for name in part.consumers:
        task = tasks.get(name)
        if task is None:
            return {}  # a declared consumer that has not registered may read any field
        done[name] = np.isin(rows, task.finished_rows(rows))
        for field in task.config.fields:
            have = readers.get(field)
            readers[field] = done[name] if have is None else have & done[name]
    everyone = np.logical_and.reduce(list(done.values()))
    out: dict[tuple[int, str], np.ndarray] = {}
    for field, mask in readers.items():
        picked = rows[mask & ~everyone]
        units = part.unit[picked]
        for unit in np.unique(units).tolist():
            out[unit, field] = part.slot[picked[units == unit]]
    return out


class SpillHints:
    """Hints waiting to be sent (``lock``: the controller's; never held for a call)."""

    def __init__(self, spill: SpillFn, lock: AbstractContextManager[Any]) -> None:
        self._spill = spill
        self._lock = lock
        self._pending: dict[tuple[int, str, str], list[np.ndarray]] = {}

    def add(self, partition: str, hints: dict[tuple[int, str], np.ndarray]) -> None:
        """Queue ``hints`` (lock held)."""
        for (unit, field), slots in hints.items():
            self._pending.setdefault((unit, partition, field), []).append(slots)

    def send(self) -> None:
        """Send every pending hint, one call per (unit, partition, field) (lock not
        held)."""
        if not self._pending:  # nearly always (an unlocked look: a miss waits a call)
            return
        with self._lock:
            pending, self._pending = self._pending, {}
        for (unit, partition, field), parts in pending.items():
            slots = np.unique(np.concatenate(parts))
            try:
                self._spill(unit, partition, slots, [field])
            except Exception as exc:  # advice only: the rows stay in memory
                logger.info("telling storage unit %d that %d slots of partition %r may "
                            "spill failed (%s)", unit, len(slots), partition, exc)
