"""Reservations: rows a producer reserved and has not committed yet, tied to its session.

A put creates its rows in ``reserve``, stores their bytes in the units, then
``commit``s them. Until the commit the rows are *pending*: they hold capacity,
and a closed partition does not end while a task could still receive them. A
producer that dies in between would keep them pending for good, so every row a
``reserve`` creates is held under the producer's session:

- the session's heartbeat (``renew(partition, task="", session=...)``, sent by the
  producer process's LeaseKeeper) keeps its reservations alive ``lease`` seconds
  at a time;
- a reservation not renewed for ``lease`` seconds (its process died), or whose
  session was cancelled (``cancel(session)``, e.g. ``Stream.close``), is aborted:
  its rows are removed and their slots freed in the units (a dead producer may
  have stored part of the bytes), exactly as the producer's own ``abort`` would;
- a live but stuck producer: a reservation lives at most ``timeout + lease``
  seconds after its ``reserve`` (``timeout`` is the put's own timeout), however
  often its session renews. A put that has not committed by then would have
  failed on its own timeouts; its late ``commit`` raises StateError (rows
  cleared meanwhile) and nothing of it becomes visible.

Slot grants need no undoing: a grant is a unit's high-water mark of placed
slots, and the freed slots are placed again, under it, for later rows.

Only the rows a reserve *created* are held (fields written to existing rows
block nothing). ``Reservations`` is plain bookkeeping, guarded by the
controller's lock; ``abort_due`` aborts, with the row removal the Controller hands it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from tq_stream.config import DEFAULT_LEASE_TIMEOUT as DEFAULT_WRITE_LEASE
from tq_stream.controller.partition import PartitionMeta

WRITER_TASK = ""  # renew(task=WRITER_TASK, session=s): the heartbeat of producer session s
RESTORED_LEASE = 60.0  # seconds a restored controller holds rows reserved before its restart
logger = logging.getLogger(__name__)


@dataclass
class Reservation:
    """Rows ``index`` (of generations ``generation``) reserved by one put of ``session``."""

    index: np.ndarray
    generation: np.ndarray
    session: str
    lease: float
    expiry: float  # aborted after this (wall-clock seconds) unless renewed
    deadline: float  # aborted after this, renewed or not (a stuck producer)


class Reservations:
    """The uncommitted reservations of every partition (see module doc)."""

    def __init__(self) -> None:
        self._parts: dict[str, list[Reservation]] = {}

    def __len__(self) -> int:
        return sum(len(held) for held in self._parts.values())

    def add(self, partition: str, index: np.ndarray, generation: np.ndarray, session: str,
            lease: float, timeout: float, now: float) -> None:
        """Hold new rows ``index`` for ``session``: aborted ``lease`` seconds after the
        last renewal, and ``timeout + lease`` seconds from ``now`` at the latest."""
        if len(index):
            self._parts.setdefault(partition, []).append(Reservation(
                np.array(index, dtype=np.int64), np.array(generation, dtype=np.int64),
                session, lease, now + lease, now + timeout + lease))

    def settle(self, partition: str, index: np.ndarray) -> None:
        """Rows ``index`` were committed, aborted or removed: no longer held."""
        held = self._parts.get(partition)
        if not held or not len(index):
            return
        keep = []
        for r in held:
            if len(r.index) == len(index) and np.array_equal(r.index, index):
                continue  # the usual commit: exactly the rows its reserve created
            mask = ~np.isin(r.index, index)
            if mask.all():
                keep.append(r)
            elif mask.any():
                r.index, r.generation = r.index[mask], r.generation[mask]
                keep.append(r)
        if keep:
            self._parts[partition] = keep
        else:
            del self._parts[partition]

    def renew(self, partition: str, session: str, now: float) -> int:
        """The heartbeat of ``session``: extend its reservations on ``partition`` (never
        past their deadline; one already due stays due). Returns how many rows it
        holds there."""
        n = 0
        for r in self._parts.get(partition, ()):
            if r.session == session and min(r.expiry, r.deadline) > now:  # not yet due
                r.expiry = min(r.deadline, now + r.lease)
                n += len(r.index)
        return n

    def take_due(self, now: float, session: str | None = None) -> list[tuple[str, Reservation]]:
        """Remove and return the reservations that expired by ``now`` (or, with
        ``session``, every reservation of that session)."""
        out: list[tuple[str, Reservation]] = []
        for partition in list(self._parts):
            keep = []
            for r in self._parts[partition]:
                due = r.session == session if session is not None else \
                    min(r.expiry, r.deadline) <= now
                if due:
                    out.append((partition, r))
                else:
                    keep.append(r)
            if keep:
                self._parts[partition] = keep
            else:
                del self._parts[partition]
        return out

    def held_by(self, session: str) -> bool:
        return any(r.session == session for held in self._parts.values() for r in held)

    def soonest(self) -> float:
        """When the next reservation expires (``inf`` if none is held)."""
        return min((min(r.expiry, r.deadline) for held in self._parts.values() for r in held),
                   default=float("inf"))

    def forget(self, partition: str) -> None:
        self._parts.pop(partition, None)




def abort_due(res: Reservations, parts: Mapping[str, PartitionMeta],
              remove: Callable[[PartitionMeta, np.ndarray], None], now: float,
              session: str | None = None) -> int:
    """Abort the reservations that expired (or every one of ``session``), lock held:
    ``remove(part, rows)`` removes their rows that still exist and frees their slots.
    Returns how many rows were removed."""
    if not len(res) or (session is None and res.soonest() > now):
        return 0
    removed = 0
    for partition, r in res.take_due(now, session):
        part = parts.get(partition)
        if part is None:
            continue
        rows = r.index[part.used[r.index] & (part.generation[r.index] == r.generation)]
        remove(part, rows)
        removed += len(rows)
        if len(rows):
            logger.warning(
                "aborted %d rows of partition %r that producer session %r reserved and "
                "never committed (%s)", len(rows), partition, r.session or "(none)",
                "session ended" if session is not None else "its heartbeat stopped or "
                "its put outlived timeout + lease")
    return removed


def hold_restored(res: Reservations, parts: Mapping[str, PartitionMeta], now: float) -> None:
    """After a restore: rows with no field written were reserved by puts in flight
    when the checkpoint was taken; their producers' sessions are unknown, so they
    are held for ``RESTORED_LEASE`` seconds (a commit in that time still lands)."""
    for name, part in parts.items():
        written = np.zeros(part.size, dtype=bool)
        for r in part.ready.values():
            written |= r[: part.size]
        rows = np.flatnonzero(part.used & ~written)
        res.add(name, rows, part.generation[rows], "", RESTORED_LEASE, 0.0, now)


__all__ = ["DEFAULT_WRITE_LEASE", "WRITER_TASK", "Reservation", "Reservations", "abort_due",
           "hold_restored"]
