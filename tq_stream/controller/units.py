"""UnitLogic: which storage units are alive, and what happens to a dead one's rows.

A storage unit's rows die with it (there is no replica). When a unit is declared
lost (``unit_lost``: its process died, its node left, or it missed its heartbeats),
the controller

- drops every row stored there: each task counts the rows it had not finished
  (neither acked nor discarded) as discarded with reason ``"unit_lost"``, and the
  loss is logged at WARNING;
- removes those rows from formed shares: a rank whose whole share was lost is
  told so with an empty batch (``get_meta`` returns no rows, ``end=False``) and a
  loader goes on with its next step instead of waiting;
- keeps the lost rows' keys (``lost.py``): a later put that only adds fields to
  such a row skips it instead of making it again half (the writer is told);
- places no new rows there (``_live_units``) until the unit is back
  (``unit_back``: a restarted or replacement unit, empty).

The controller hands ``Units`` the book (partitions, tasks, the condition, the
pending frees and the row removal, ``book.py``); the deployment (a monitor, the
owner) calls the controller's ``unit_lost`` / ``unit_back``, which hand over to it.
"""

from __future__ import annotations

import logging

import numpy as np

from tq_stream.controller.book import Book
from tq_stream.controller.partition import PartitionMeta
from tq_stream.controller.task import LEASED, NEW
from tq_stream.errors import ConfigError, StateError, check_positive

UNIT_LOST = "unit_lost"  # discard reason of rows whose storage unit died
logger = logging.getLogger(__name__)




class Units:
    """The storage units' liveness and the loss of a dead one's rows (module doc)."""

    def __init__(self, book: Book) -> None:
        self.n_units = book.n_units
        self.dead: set[int] = set()  # lost and not back
        self._book = book
        self._cond = book.cond

    def check(self, unit: object) -> int:
        """``unit`` if it is a unit index, else ConfigError naming ``unit``."""
        check_positive("unit", unit, allow_zero=True)
        assert isinstance(unit, int)
        if unit >= self.n_units:
            raise ConfigError(f"unit must be < {self.n_units}, got {unit}")
        return unit

    def live(self) -> np.ndarray:
        """Units new rows may be placed on (ascending)."""
        live = [u for u in range(self.n_units) if u not in self.dead]
        if not live:
            raise StateError(f"a storage unit must be alive to place rows, but all "
                             f"{self.n_units} are lost (waiting for a restart)")
        return np.asarray(live, dtype=np.int32)

    def lost(self, unit: int) -> dict[str, int]:
        """Storage unit ``unit`` is gone: drop its rows, place nothing there until
        ``back``. Returns rows dropped per partition (none if already lost)."""
        self.check(unit)
        with self._cond:
            if unit in self.dead:
                return {}
            self.dead.add(unit)
            dropped = self.drop_rows_of(unit)
            # Frees still pending there have nothing left to free.
            parts = self._book.parts
            for part_name, slots in self._book.frees.forget_unit(unit):
                if part_name in parts:
                    parts[part_name].give_slots(unit, slots)
        self.free_pending()
        logger.warning("storage unit %d is lost: dropped its rows %s; no new rows go "
                       "there until it is back", unit, dropped or "(none)")
        return dropped

    def back(self, unit: int) -> None:
        """A new, empty storage unit serves as ``unit``: rows may be placed there again."""
        self.check(unit)
        with self._cond:
            if unit in self.dead:
                self.dead.discard(unit)
                logger.warning("storage unit %d is back (empty)", unit)
            self._cond.notify_all()

    def drop_rows_of(self, unit: int) -> dict[str, int]:
        """Forget every row stored in ``unit`` (lock held); rows dropped per partition."""
        dropped: dict[str, int] = {}
        for name, part in self._book.parts.items():
            # Spare rows there are taken back too: there is nothing to free.
            spare = np.flatnonzero(part.spare & (part.unit[: part.size] == unit))
            for u, slots in part.release_spares(spare):
                part.give_slots(u, slots)
            rows = np.flatnonzero(part.used & (part.unit[: part.size] == unit))
            lost = self.lose_rows(part, rows, unit) if len(rows) else 0
            if lost:
                dropped[name] = lost
        self._cond.notify_all()
        return dropped

    def lose_rows(self, part: PartitionMeta, rows: np.ndarray, unit: int) -> int:
        """Rows whose bytes ``unit`` no longer holds (lock held), and the rows naming a
        shared entry among them (``with_namers``): each task counts those it had not
        finished as discarded ``unit_lost``; shares that held them shrink. Slots of
        ``unit`` (or of a lost unit) are reusable at once (nothing left to free); the
        others, on live units, are freed there with the next free (``free_pending``).
        A row no field was committed to is not lost, only undone: the put that placed
        it was not done, and puts it again (its commit finds the row gone). Returns
        the rows lost."""
        rows = part.shared.with_namers(rows)  # their shared entry is gone with them
        written = np.zeros(len(rows), dtype=bool)
        for i, r in enumerate(rows.tolist()):
            fields = frozenset(part.fields_of(r))
            written[i] = bool(fields) and not part.shared.entry[r]  # entries are no rows
            if written[i]:  # a later put of fields they lacked must not make them again
                part.lost.add(part.keys[r], int(part.unit[r]), fields)
        for task in self._book.tasks.get(part.name, {}).values():
            lost = int(np.isin(task.state[rows[written]], (NEW, LEASED)).sum())
            if lost:
                task.discards[UNIT_LOST] += lost
            for rec in task.steps.values():
                rec.lost.update(r for r, s in enumerate(rec.shares) if np.isin(s, rows).any())
        for u, slots in self._book.release_rows(part, rows):
            if u == unit or u in self.dead:
                part.give_slots(u, slots)
            else:  # a namer (or an entry no row names now) whose bytes a live unit holds
                self._book.frees.defer(part.name, u, slots)
        return int(written.sum())

    def free_pending(self) -> None:
        """Send the frees ``lose_rows`` left for live units (lock not held)."""
        self._book.free_slots("", [])


__all__ = ["UNIT_LOST", "Units"]
