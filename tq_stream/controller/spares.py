"""Spares: puts that create rows in one controller call after their bytes.

A put normally costs three calls: ``reserve`` (place the rows), the bytes to the
units, ``commit``. A writer that asks ``reserve`` for ``spare`` rows gets rows
placed in a unit and slot but holding no key yet (``PartitionMeta.spare``); its
next small put of new keys stores the bytes in those slots first and then names
the keys in one ``commit_new``, which checks everything ``reserve`` would have
checked and changes nothing unless every check passes. Bytes in a spare slot are
never visible: no key maps to it. A writer that is done returns its spare rows
(``release_spares``; it keeps only rows that hold no bytes); the rows of a writer
that died stay spare (bounded by what it asked for), and a checkpoint counts them
as free.

The Controller hands ``Spares`` the book, the placing of spare rows and the
commit of written rows (``writes.py``) and the call that answers waiters.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from tq_stream.checks import check_tags
from tq_stream.controller.book import Book
from tq_stream.controller.partition import PartitionMeta, parse_schemas
from tq_stream.errors import ClosedError, ConfigError, KeyConflictError, StateError
from tq_stream.messages.puts import Committed, Rows
from tq_stream.schemas import FieldSchema

MAX_SPARE = 1024  # spare rows one reserve may ask for


def _one_int(values: Any) -> bool:
    """``values`` is a list of one plain int (a one-row put's index or generation)."""
    return type(values) is list and len(values) == 1 and type(values[0]) is int


def check_spare(spare: Any) -> int:
    if isinstance(spare, bool) or not isinstance(spare, int) or not 0 <= spare <= MAX_SPARE:
        raise ConfigError(f"spare must be an int in [0, {MAX_SPARE}], got {spare!r}")
    return spare


def _refusal(part: PartitionMeta, keys: list[str],
             schemas_: dict[str, Any]) -> Committed | None:
    """Why ``commit_new`` cannot take new rows ``keys`` as they are (None: it can).

    Raises:
        ClosedError: the partition is closed to new rows.
        SchemaError: a new field's path clashes with a known one ("x" and "x.y").
    """
    if part.closed:
        raise ClosedError(f"partition {part.name!r} is closed to new rows, got new keys "
                          f"{keys[:5]}")
    if any(part.schemas.get(f, s) != s for f, s in schemas_.items()) or \
            not part.shared.fields.isdisjoint(schemas_):  # reserve refuses a shared field
        return Committed(ok=False, reason="schema")
    if any(k in part.key_index for k in keys):
        return Committed(ok=False, reason="exists")
    if part.lost and part.lost.gone(keys, schemas_):
        return Committed(ok=False, reason="lost")  # reserve skips those rows (lost.py)
    if part.capacity is not None and part.live + len(keys) > part.capacity:
        return Committed(ok=False, reason="capacity")
    if any(f not in part.schemas for f in schemas_):
        part.check_schemas(schemas_)  # before the bind: a new field must fit the others
    return None


PlaceSpares = Callable[[PartitionMeta, int, int], Rows]
MarkWritten = Callable[[PartitionMeta, np.ndarray, dict[str, FieldSchema], list[Any] | None], None]


class Spares:
    """Puts on spare rows (see the module docstring)."""

    def __init__(self, book: Book, place_spares: PlaceSpares, mark_written: MarkWritten,
                 rows_ready: Callable[[PartitionMeta], None]) -> None:
        self._book = book
        self._place_spares = place_spares  # ``Writes.place_spares``
        self._mark_written = mark_written  # ``Writes.mark_written``
        self._rows_ready = rows_ready  # ``Consuming.rows_ready``

    def commit_new(self, partition: str, keys: Sequence[str], index: Sequence[int] | np.ndarray,
                   generation: Sequence[int] | np.ndarray, schemas: Mapping[str, Any],
                   tags: list[dict[str, Any]] | None = None, unit: int = -1,
                   spare: int = 0) -> Committed:
        """Create rows for new ``keys`` on spare rows whose bytes are stored, and commit
        them: a put in one call after the bytes (``reserve`` gave out the spares).

        Nothing changes unless every check passes. A put this cannot take as it is
        returns ``{"ok": False, "reason": ...}`` and the writer puts again through
        ``reserve``: "exists" (some keys exist), "schema" (a field's schema differs
        from the fixed one; ``reserve`` converts or rejects it), "capacity" (the
        partition is bounded and full), "lost" (a key names a row lost with its unit
        that the put only adds to; ``reserve`` skips it).

        Args:
            unit, spare: place this many new spare rows (in ``unit``, -1: spread) for
                the caller's next puts, as ``reserve`` does.
        Returns:
            ``Committed(ok=True)`` (plus ``spare`` rows with ``spare``), or
            ``Committed(ok=False, reason=str)``.
        Raises:
            StateError: the rows are not (any more) spare rows of these generations.
            ClosedError: the partition is closed. ConfigError, KeyConflictError.
        """
        keys = list(keys)
        schemas_ = parse_schemas(schemas)
        if schemas_ and tags is None and len(keys) == 1 and _one_int(index) and \
                _one_int(generation):
            return self._commit_row(partition, keys[0], index[0], generation[0], schemas_,
                                    unit, spare)
        index = np.asarray(index, dtype=np.int64)
        gen = np.asarray(generation, dtype=np.int64)
        if not schemas_ or len(index) != len(keys) or gen.shape != index.shape \
                or (len(index) > 1 and len(np.unique(index)) != len(index)):
            raise ConfigError(f"commit_new needs fields and one distinct index and generation "
                              f"per key, "
                              f"got {len(schemas_)} fields, {len(keys)} keys, "
                              f"{len(index)} indexes, {gen.shape} generations")
        tags = check_tags(tags, len(keys))  # before any change: tags are set after the bind
        check_spare(spare)
        if len(set(keys)) != len(keys):
            raise KeyConflictError(f"keys must be distinct within one put, got {keys[:5]}")
        with self._book.cond:
            part = self._book.part(partition)
            if index.shape == (1,):  # a one-row put: plain ints, no numpy ufuncs on one row
                i = int(index[0])
                ok = 0 <= i < part.size and part.spare[i] and part.generation[i] == gen[0]
            else:
                inside = (index >= 0) & (index < part.size)
                ok = inside.all() and (part.spare[index] & (part.generation[index] == gen)).all()
            if not ok:
                raise StateError(f"rows {index.tolist()[:5]} of partition {partition!r} must be "
                                 f"spare rows of generations {gen.tolist()[:5]} to be committed "
                                 f"as new rows (they were taken back)")
            refused = _refusal(part, keys, schemas_)
            if refused is not None:
                return refused
            part.bind(keys, index, self._book.clock())
            self._mark_written(part, index, schemas_, tags)
            return self._committed(part, unit, spare)

    def _commit_row(self, partition: str, key: str, i: int, gen: int,
                    schemas_: dict[str, Any], unit: int, spare: int) -> Committed:
        """``commit_new`` of one row with fields and without tags: the same checks and
        changes on one int row, no numpy array indexing (cold, each costs tens of µs;
        design.md)."""
        check_spare(spare)
        with self._book.cond:
            part = self._book.part(partition)
            if not (0 <= i < part.size and part.spare[i] and part.generation[i] == gen):
                raise StateError(f"rows [{i}] of partition {partition!r} must be spare rows "
                                 f"of generations [{gen}] to be committed as new rows (they "
                                 f"were taken back)")
            refused = _refusal(part, [key], schemas_)
            if refused is not None:
                return refused
            part.bind_row(key, i, self._book.clock())
            self._mark_row(part, i, schemas_)
            return self._committed(part, unit, spare)

    def _mark_row(self, part: PartitionMeta, i: int, schemas_: dict[str, Any]) -> None:
        """``Writes.mark_written`` of one row without tags (lock held; its write
        time was just set by ``bind_row``)."""
        part.fix_schemas(schemas_)
        for f in schemas_:
            part.ready[f][i] = True
        if part.lost:
            part.lost.forget([part.keys[i]])
        for task in self._book.tasks[part.name].values():
            if part.row_ready(task.config.fields, i, task.tags):
                task.offer_row(i)
        self._rows_ready(part)

    def _committed(self, part: PartitionMeta, unit: int, spare: int) -> Committed:
        """The reply of a commit that took its rows, with new spare rows if asked."""
        return Committed(ok=True, spare=self._place_spares(
            part, unit, spare if part.capacity is None else 0) if spare else None)

    def release_spares(self, partition: str, index: np.ndarray, generation: np.ndarray) -> int:
        """Take back spare rows a writer no longer needs; returns how many were spare.

        The writer must hold no bytes in them (a SparePool frees what a failed put
        stored before it keeps the rows), so their slots are reusable at once: no call
        to the units, and a dead unit cannot delay it.
        """
        index = np.asarray(index, dtype=np.int64)
        gen = np.asarray(generation, dtype=np.int64)
        with self._book.cond:
            part = self._book.parts.get(partition)
            if part is None:
                return 0
            inside = (index >= 0) & (index < part.size)
            index, gen = index[inside], gen[inside]
            mine = index[part.spare[index] & (part.generation[index] == gen)]
            for unit, slots in part.release_spares(mine):
                part.give_slots(unit, slots)
        return len(mine)

