"""Book: the metadata every part of the controller works on, under one condition.

It holds the partitions (``PartitionMeta``) and, per partition, its tasks
(``TaskState``), the condition whose lock guards them all (its waits are woken
whenever rows are committed, acked, released or cleared), the rows reserved and
not committed (``reservations.py``), the frees retried in storage (``frees.py``)
and the ack journal when one is set (``deploy/ack_journal.py``), and the clock
every part reads wall-clock time from (``clock``: leases, reservations, write
times; waits are bounded by ``time.monotonic``). It keeps the
rules every part shares: a partition must exist (or is made), a task must be
registered, rows removed leave every task and share, and a row is freed once
each declared consumer of its partition acked or discarded it.

A restore replaces the maps' contents (``replace``), never the maps, so each
part may keep them; the media pins it replaces whole (no part keeps them).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np

from tq_stream.controller.frees import Frees
from tq_stream.controller.media_pins import MediaPins
from tq_stream.controller.partition import PartitionMeta
from tq_stream.controller.reservations import Reservations, abort_due
from tq_stream.controller.spill_hints import SpillHints, done_fields
from tq_stream.controller.task import TaskState
from tq_stream.errors import ClosedError, KeyConflictError, check_name

Freed = list[tuple[int, np.ndarray]]  # (unit, slots) to free in storage


class Journal(Protocol):
    """What the controller's parts record in the ack journal (``deploy/ack_journal.py``)."""

    def formed(self, partition: str, task: str, step: int, shares: list[np.ndarray],
               generations: list[np.ndarray]) -> None: ...

    def share_set(self, partition: str, task: str, step: int, rank: int, rows: np.ndarray,
                  generation: np.ndarray) -> None: ...

    def ended(self, partition: str, task: str, step: int) -> None: ...

    def discarded(self, partition: str, task: str, reason: str, rows: np.ndarray,
                  generation: np.ndarray) -> None: ...

    def acked(self, partition: str, task: str, step: int, dp_rank: int, replica: int,
              rows: np.ndarray, generation: np.ndarray) -> None: ...


class Book:
    """Partitions, their tasks and what guards them (see the module docstring)."""

    def __init__(self, n_units: int, cond: threading.Condition, reservations: Reservations,
                 frees: Frees, spill_hints: SpillHints,
                 clock: Callable[[], float] = time.time) -> None:
        self.n_units = n_units
        # wall-clock seconds of leases, reservations, write times (waits use monotonic)
        self.clock = clock
        self.cond = cond
        self.parts: dict[str, PartitionMeta] = {}
        self.tasks: dict[str, dict[str, TaskState]] = {}
        self.reservations = reservations
        self.pins = MediaPins()  # media held by handles of live sessions (media_pins.py)
        self.frees = frees
        self.spill_hints = spill_hints  # fields units may spill (spill_hints.py)
        self.journal: Journal | None = None  # records delivery changes if set
        self.closed = False

    def check_open(self) -> None:
        if self.closed:
            raise ClosedError("controller is closed (its stream was closed)")

    def part(self, partition: str, create: bool = False, by_put: bool = False) -> PartitionMeta:
        """Partition ``partition`` (made if ``create``; ``by_put``: made by a put, see
        ``Writes.abort``); KeyConflictError if it does not exist."""
        self.check_open()
        part = self.parts.get(partition)
        if part is None:
            if not create:
                raise KeyConflictError(
                    f"partition must exist, got {partition!r} (known: {sorted(self.parts)})"
                )
            check_name("partition", partition)
            part = self.parts[partition] = PartitionMeta(partition, None, self.n_units)
            part.by_put = by_put  # made by a put (see abort)
            self.tasks[partition] = {}
        elif create and not by_put:
            part.by_put = False  # named explicitly: kept even while empty
        return part

    def task(self, partition: str, task: str) -> tuple[PartitionMeta, TaskState]:
        """The partition and the registered ``task`` on it (KeyConflictError if not)."""
        part = self.part(partition)
        state = self.tasks[partition].get(task)
        if state is None or state.restored is not None:
            again = " again after the restore" if state is not None else ""
            raise KeyConflictError(
                f"task must be registered on partition {partition!r}{again} first "
                f"(register_task), got {task!r}"
            )
        return part, state

    def grow_tasks(self, part: PartitionMeta) -> None:
        for task in self.tasks[part.name].values():
            task.grow(part.size)

    def release_rows(self, part: PartitionMeta, rows: np.ndarray) -> Freed:
        """Remove ``rows`` from every task and share and from the partition; returns the
        slots to free in storage."""
        if len(rows) == 0:
            return []
        for task in self.tasks[part.name].values():
            task.forget_row(rows)
            for rec in task.steps.values():
                rec.shares = [s[~np.isin(s, rows)] for s in rec.shares]
        freed = part.release(rows)
        self.reservations.settle(part.name, rows)
        self.cond.notify_all()
        return freed

    def finish_rows(self, part: PartitionMeta, rows: np.ndarray) -> Freed:
        """Free rows that every declared consumer of the partition acked or discarded;
        a partition without declared consumers keeps its rows until cleared."""
        if len(rows) == 0 or part.consumers is None:
            return []
        tasks = self.tasks[part.name]
        if part.spills:  # fields no declared reader needs may spill (spill_hints.py)
            self.spill_hints.add(part.name, done_fields(part, tasks, rows))
        for name in part.consumers:
            task = tasks.get(name)
            if task is None:
                return []  # a declared consumer has not even registered yet
            rows = task.finished_rows(rows)
        return self.release_rows(part, rows)

    def free_slots(self, partition: str, freed: Freed) -> None:
        """Free slots in storage, then make them reusable (``frees.py``); tell units
        which fields may spill (``spill_hints.py``). Lock not held."""
        self.spill_hints.send()
        self.frees.run(partition, freed, self._give_slots)

    def _give_slots(self, unit: int, partition: str, slots: np.ndarray) -> None:
        part = self.parts.get(partition)
        if part is not None:
            part.give_slots(unit, slots)

    def abort_reservations(self, session: str | None = None) -> int:
        """Abort the reservations due (or every one of ``session``), lock held
        (``reservations.abort_due``); returns the rows removed."""
        return self.expire_pins() + abort_due(
            self.reservations, self.parts, lambda part, rows: self.free_slots(
                part.name, self.undo_rows(part, rows)), self.clock(), session)

    def expire_pins(self) -> int:
        """End the media pins whose session lapsed and free the entries nothing holds
        now, lock held (``MediaPins.expire``); returns how many entries were freed."""
        now = self.clock()
        if self.pins.soonest() > now:
            return 0
        freed = 0
        for part, rows in self.pins.expire(self.parts, now):
            self.free_slots(part.name, self.release_rows(part, np.asarray(rows, np.int64)))
            freed += len(rows)
        return freed

    def undo_rows(self, part: PartitionMeta, rows: np.ndarray) -> Freed:
        """``release_rows`` of rows an aborted put placed (no field committed): shared
        fields only they claimed are shared fields no more (``SharedTable.forget``)."""
        claims = part.shared.claims(rows)
        freed = self.release_rows(part, rows)
        part.shared.forget(claims)
        return freed

    def replace(self, parts: dict[str, PartitionMeta],
                tasks: dict[str, dict[str, TaskState]], pins: MediaPins) -> None:
        """A restore: the maps' contents become ``parts`` and ``tasks``, the pins
        ``pins``."""
        self.pins = pins
        self.parts.clear()
        self.parts.update(parts)
        self.tasks.clear()
        self.tasks.update(tasks)
