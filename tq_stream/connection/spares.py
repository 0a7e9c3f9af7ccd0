"""SparePool: spare rows the controller placed for this process's next small puts.

A put of new keys normally takes three calls: ``reserve`` (place the rows), the
bytes to the storage units, ``commit``. With spare rows (placed in a unit and slot,
no key yet; see ``tq_stream.controller.spares``) it takes two: the bytes go to the
spare slots, then ``commit_new`` names the keys, after checking all that
``reserve`` would have. On the unit's host the bytes need no call at all: they are
copied straight into its shared memory (``SameHostUnit``), so a put is one call.
A put ``commit_new`` cannot take as it is (a key exists, a schema needs
converting, the partition is full) leaves nothing visible: its bytes are freed
and the writer puts again through ``reserve``.

Spare rows are refilled, in batches, by the calls a put makes anyway (``reserve``
and ``commit_new`` take a ``spare`` count; see ``SparePool.wanted``) and returned
when the stream is closed. A spare row whose bytes may still be in flight (a call
timed out) is never used again: a late write would land in a row that is live by
then.

Invariants: a spare row is either in the pool or held by exactly one put; a row
in the pool holds no bytes in its unit (so returning it needs no free); a pool
belongs to the process that filled it (a forked child starts with none).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import numpy as np

from tq_stream.backends.base import occupancy
from tq_stream.columns import Column, coerce
from tq_stream.connection import placement
from tq_stream.convert import schemas_of
from tq_stream.errors import StateError, TQError, WaitTimeout
from tq_stream.forksafe import ForkSafeLock
from tq_stream.messages.puts import Rows
from tq_stream.schemas import FieldSchema

_FIELDS = ("index", "unit", "slot", "generation")  # of each spare row, from the controller
_ROWS = (*_FIELDS, "token")  # and its occupancy token (``occupancy``), computed once here


def _clean(exc: BaseException) -> bool:
    """True if a failed call surely has no effect still in flight (so its spare rows may
    be used again): the far side answered with an error, or nothing was sent."""
    return isinstance(exc, TQError) and not isinstance(exc, WaitTimeout)


def _split(rows: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """Rows (field -> array) as one dict of one-row views per row."""
    return [{f: a[i : i + 1] for f, a in rows.items()} for i in range(len(rows["index"]))]


def _joined(rows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One-row dicts (``_split``) as one dict of arrays, in order."""
    if not rows:
        return {f: np.zeros(0, np.int64) for f in _ROWS}
    return {f: np.concatenate([r[f] for r in rows]) for f in _ROWS}


class SparePool:
    """Spare rows for puts to one partition (and unit choice) from this process.

    Args:
        partition: the partition the rows belong to.
        unit: the writers' unit choice the rows were placed with (-1: spread).
    """

    TARGET = 16  # spare rows to hold at first
    MAX_TARGET = 256  # concurrent puts from many threads grow the pool up to this
    MAX_ROWS = 16  # a put of more rows goes through reserve
    COOLDOWN = 64  # puts that go through reserve after one whose keys existed

    def __init__(self, partition: str, unit: int) -> None:
        self.partition = partition
        self.unit = unit
        self._lock = ForkSafeLock()
        # One dict of one-row arrays per spare row, next first: a one-row put (the
        # common small put) takes its row with no numpy call.
        self._rows: collections.deque[dict[str, np.ndarray]] = collections.deque()
        self._cooldown = 0
        self._short = False  # a put found too few rows: refill before the half mark
        self.target = self.TARGET  # doubled each time puts find the pool empty
        self._schemas: dict[str, dict[str, Any]] = {}  # fixed schemas seen (never change)

    def __len__(self) -> int:
        return len(self._rows)

    def wanted(self) -> int:
        """How many spare rows the next ``reserve`` or ``commit_new`` should ask for: none
        until the pool is down to half its ``target``, then enough to fill it (placing
        rows in batches costs the controller less per put than one row per put). The
        target doubles (up to ``MAX_TARGET``) whenever a put finds the pool empty, as
        happens when many threads put at once."""
        with self._lock:
            if self._cooldown or (len(self) > self.target // 2 and not self._short):
                return 0
            return max(0, self.target - len(self))

    def add(self, spare: Rows | None) -> None:
        """Take spare rows handed out by the controller."""
        if spare is None or not len(spare.index):
            return
        new = {f: np.asarray(a, np.int64) for f, a in
               zip(_FIELDS, (spare.index, spare.unit, spare.slot, spare.generation),
                   strict=True)}
        new["token"] = occupancy(new["index"], new["generation"])
        rows = _split(new)
        with self._lock:
            self._rows.extend(rows)
            self._short = False

    def learn(self, schemas: dict[str, Any]) -> None:
        """Record fixed schemas (a reserve's answer)."""
        self._schemas.update(schemas)

    def drain(self) -> dict[str, np.ndarray]:
        """Every spare row, now no longer in the pool (to return them)."""
        with self._lock:
            rows, self._rows = self._rows, collections.deque()
        return _joined(list(rows))

    def _take(self, n: int) -> dict[str, np.ndarray] | None:
        with self._lock:
            if self._cooldown:
                self._cooldown -= 1
                return None
            if n > self.MAX_ROWS or len(self) < n:
                if n <= self.MAX_ROWS:
                    self._short = True
                    if not len(self):  # concurrent puts outran the refills: hold more
                        self.target = min(2 * self.target, self.MAX_TARGET)
                return None
            if n == 1:
                return self._rows.popleft()
            return _joined([self._rows.popleft() for _ in range(n)])

    def _give_back(self, rows: dict[str, np.ndarray]) -> None:
        back = _split(rows)
        with self._lock:
            self._rows.extendleft(reversed(back))

    def _coerced(self, cols: dict[str, Column]
                 ) -> tuple[dict[str, Column], dict[str, Any]] | None:
        """Columns converted to the fixed schemas known here, and their schemas; None
        when a field's schema is not known here yet (``reserve`` checks it before any
        byte moves) or the data cannot take it."""
        schemas = schemas_of(cols)
        out = cols
        for name, schema in schemas.items():
            fixed = self._schemas.get(name)
            if fixed is None:
                return None
            if fixed != schema:
                col = coerce(cols[name], FieldSchema.from_dict(fixed))
                if col is None:
                    return None  # reserve raises the right SchemaError
                out = {**out, name: col}
                schemas[name] = fixed
        return out, schemas

    def put(self, ctrl: Any, units: Sequence[Any], keys: list[str], cols: dict[str, Column],
            tags: list[dict[str, Any]] | None) -> bool:
        """Write new rows ``keys`` on spare rows: True when done, False when the put must go
        through ``reserve`` (nothing visible changed then; ``reserve`` also raises the
        canonical error of a put that cannot succeed).

        Raises:
            WaitTimeout and other errors after which the outcome is unknown.
        """
        converted = self._coerced(cols)
        if converted is None:
            return False
        rows = self._take(len(keys))
        if rows is None:
            return False
        coerced, schemas = converted
        try:
            placement.store(units, self.partition, rows["unit"], rows["slot"], coerced,
                            rows["token"])
        except (WaitTimeout, StateError):
            # A unit did not answer (it may have died; the controller then took its
            # spare rows back), or refused the slots (a new process replaced it): these
            # rows are dropped (a write may still be in flight), the rest are not
            # trusted, and the put goes through reserve, which places rows on live units
            # only.
            rest = self.drain()
            try:
                ctrl.release_spares(partition=self.partition, index=rest["index"],
                                    generation=rest["generation"])
            except Exception:  # noqa: BLE001 — the controller keeps them until close
                pass
            return False
        try:
            # A few ints: as lists they cost a fraction of arrays to encode and decode.
            done = ctrl.commit_new(partition=self.partition, keys=keys,
                                   index=rows["index"].tolist(),
                                   generation=rows["generation"].tolist(), schemas=schemas,
                                   tags=tags, unit=self.unit, spare=self.wanted())
        except BaseException as exc:
            if type(exc) is StateError:
                self.drain()  # the controller took spare rows back: trust none of them
                return False
            if not _clean(exc):
                raise  # the rows are dropped: a write may still be in flight
            self._release(units, rows)
            return False
        if done.ok:
            self._schemas.update(schemas)
            self.add(done.spare)
            return True
        if done.reason == "exists":
            with self._lock:
                self._cooldown = self.COOLDOWN
        self._release(units, rows)
        return False

    def _release(self, units: Sequence[Any], rows: dict[str, np.ndarray]) -> None:
        """Free the bytes a failed put stored in spare rows and keep the rows; rows whose
        free fails are dropped (a late free could hit a later put's bytes)."""
        try:
            for u in np.unique(rows["unit"]).tolist():
                units[u].free(self.partition, rows["slot"][rows["unit"] == u])
        except Exception:
            return
        self._give_back(rows)
