"""Writes: how a put's rows are placed, committed and aborted, tagged and cleared.

The write protocol is ``reserve`` (validate, allocate rows; may wait for capacity)
→ the writer stores the bytes in the units → ``commit`` (rows become visible); a
writer that fails in between calls ``abort``. Rows are placed in contiguous
blocks, one per live unit, rotating which unit comes first (``place``). A reserve
may also place spare rows for the writer's next puts (``place_spares``, taken by
``Spares.commit_new``).

The Controller hands ``Writes`` the book (partitions, tasks, the condition, the
reservations), the units (which are lost), the timings that measure waits, the
units new rows may go to (a function: a deployment leaves out silent units) and
the call that answers waiters once rows are ready (``Consuming.rows_ready``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from tq_stream.checks import check_tags, check_unreserved
from tq_stream.controller import access
from tq_stream.controller.book import Book
from tq_stream.controller.capacity import full_error, full_reason, never_fits
from tq_stream.controller.consuming import check_session
from tq_stream.controller.partition import PartitionMeta, parse_schemas
from tq_stream.controller.reservations import DEFAULT_WRITE_LEASE
from tq_stream.controller.shared_entries import shown_keys
from tq_stream.controller.spares import check_spare
from tq_stream.controller.takeovers import check_holder
from tq_stream.controller.timings import Timings
from tq_stream.controller.units import Units
from tq_stream.errors import ClosedError, ConfigError, check_timeout
from tq_stream.handling import WouldBlock, may_block
from tq_stream.messages.puts import Lost, Placement, Rows
from tq_stream.schemas import FieldSchema

RowsReady = Callable[[PartitionMeta], None]


class Writes:
    """Placing, committing and aborting a put's rows (see the module docstring)."""

    def __init__(self, book: Book, units: Units, timings: Timings,
                 live_units: Callable[[], np.ndarray], rows_ready: RowsReady) -> None:
        self._book = book
        self._units = units
        self._timings = timings
        self._live_units = live_units
        self._rows_ready = rows_ready
        self._rr = 0  # the unit the next spread put starts at

    def place_spares(self, part: PartitionMeta, unit: int, n: int) -> Rows:
        """Place ``n`` spare rows (``spares.py``) in ``unit`` (-1: spread); lock held."""
        if n:
            idx = part.allocate_spares(self.place(unit, n))
            self._book.grow_tasks(part)
        else:
            idx = np.zeros(0, dtype=np.int64)
        return Rows(idx, part.unit[idx], part.slot[idx], part.generation[idx])

    def reserve(self, partition: str, keys: Sequence[str], schemas: Mapping[str, Any],
                unit: int = -1, timeout: float = 60.0,
                expect: Sequence[int] | None = None, spare: int = 0, session: str = "",
                lease: float = DEFAULT_WRITE_LEASE,
                holder: Mapping[str, Any] | None = None, blocked: float = 0.0) -> Placement:
        """Validate a put and place its rows; new rows wait for capacity.

        A closed partition takes no new rows, but fields of its existing rows can
        still be written (later stages add their fields while the partition drains).

        Args:
            expect: generations the rows must still have (a write through a
                BatchMeta): no row is created, and rows freed meanwhile are an error.
            spare: also place this many spare rows for the caller's next puts (see
                ``commit_new``); none when the partition has a capacity or with ``expect``.
            session, lease: the producer's session: the rows created stay reserved
                while it renews them (``renew(task="", session=...)``) at least every
                ``lease`` seconds, and ``timeout + lease`` seconds at most; then they
                are aborted (``reservations.py``).
            holder: the reader of a write through a BatchMeta (``task``, ``step``,
                ``dp_rank``, ``replica``, ``session``): refused with LeaseTakenOver if
                its lease went to another reader (``takeovers.py``; ``commit`` checks
                again).
            blocked: seconds the writer paused since its previous reserve of this put,
                refused by a storage unit's ``memory_budget`` (counted in the partition's
                ``blocked_seconds["memory_budget"]``).
        Returns:
            dict of ``index``, ``unit``, ``slot``, ``generation`` (arrays aligned
            with ``keys``), ``new`` (mask of rows created by this call) and
            ``schemas`` (the fixed schema of each written field that has one; the
            writer converts columns in the other form to it); with ``spare``, also
            ``spare``: ``index``, ``unit``, ``slot``, ``generation`` of the spare rows.
            Keys of rows lost with their storage unit that the put only adds fields to
            are skipped (``lost.py``): then also ``lost``: ``pos`` (their positions in
            ``keys``) and ``unit`` (each one's unit), and the arrays cover the other keys.
        Raises:
            SchemaError, ClosedError, ConfigError, StateError, WaitTimeout.
        """
        schemas_ = parse_schemas(schemas)
        if not schemas_:
            raise ConfigError("a put must write at least one field, got none")
        check_timeout("timeout", timeout)
        check_timeout("lease", lease)
        check_session("session", session)
        check_spare(spare)
        deadline = time.monotonic() + timeout
        asked = (list(keys), expect)
        held = check_holder(holder)
        if blocked:
            blocked = min(check_timeout("blocked", blocked), timeout + 1.0)
        with self._book.cond:
            part = self._book.part(partition, create=expect is None, by_put=True)
            if blocked:
                self._timings.paused(part.name, "memory_budget", blocked)
            held_for = self._check_holder(partition, held)
            while True:
                if may_block():
                    self._book.abort_reservations()  # a dead producer's rows hold capacity
                part.check_schemas(schemas_, coerce=True)
                keys, expect = asked
                part.shared.check_fields(part, keys, schemas_)
                idx = part.lookup(keys)
                new = idx < 0
                gone = part.lost.gone(keys, schemas_) if part.lost and new.any() else {}
                if gone:  # rows lost with their unit: skipped, never made again half
                    keep = np.asarray([p not in gone for p in range(len(keys))])
                    keys, idx, new = [k for k, m in zip(keys, keep.tolist(), strict=True)
                                      if m], idx[keep], new[keep]
                    expect = None if expect is None else np.asarray(expect)[keep]
                n_new = int(new.sum())
                if expect is not None:
                    part.check_expected(keys, idx, expect)
                if n_new and part.closed:
                    fresh = [k for k, m in zip(keys, new.tolist(), strict=True) if m]
                    raise ClosedError(f"partition {partition!r} is closed to new rows, got new "
                                      f"keys {shown_keys(fresh[:5])}")
                cap = part.capacity
                never = never_fits(part, n_new) if n_new else None
                if never is not None:
                    raise never
                if cap is None or part.live + n_new <= cap:
                    break
                if not may_block():
                    raise WouldBlock  # nothing allocated yet: a worker thread waits
                left = deadline - time.monotonic()
                if left <= 0:
                    raise full_error(part, timeout)
                wake = min(left, max(0.01, self._book.reservations.soonest() - self._book.clock()))
                self._timings.wait(self._book.cond, wake, deadline - timeout, "capacity",
                                   partition, lambda: full_reason(part))
                self._book.check_open()
            if n_new:
                new_keys = [k for k, m in zip(keys, new.tolist(), strict=True) if m]
                idx[new] = part.allocate(new_keys, self.place(unit, n_new), self._book.clock())
                self._book.grow_tasks(part)
                self._book.reservations.add(partition, idx[new], part.generation[idx[new]],
                                       session, lease, timeout, self._book.clock())
            fixed = {f: part.schemas[f].to_dict() for f in schemas_ if f in part.schemas}
            # holder_left: the writer stores no byte after this many seconds
            out = Placement(index=idx, unit=part.unit[idx], slot=part.slot[idx],
                            generation=part.generation[idx], new=new, schemas=fixed,
                            holder_left=held_for)
            if gone:
                part.lost.skipped += len(gone)
                out.lost = Lost(list(gone), list(gone.values()))
            if spare:
                out.spare = self.place_spares(part, unit, spare if expect is None
                                              and part.capacity is None else 0)
            return out

    def _check_holder(self, partition: str, held: tuple[Any, ...] | None) -> float | None:
        """A write through a BatchMeta: see ``TaskState.check_writer``."""
        if held is None:
            return None
        state = self._book.task(partition, held[0])[1]
        return state.check_writer(held[1], held[2], self._book.clock())

    def place(self, unit: int, n: int) -> np.ndarray:
        if 0 <= unit < self._book.n_units and unit not in self._units.dead:
            return np.full(n, unit, dtype=np.int32)
        # Contiguous blocks, one per live unit (rotating which unit comes first): rows
        # put together sit side by side in each unit and in the batch, so a read of them
        # is one plain copy per unit straight into the output. Lost units get none.
        live = self._live_units().tolist()
        first = self._rr % len(live)
        order = live[first:] + live[:first]
        q, r = divmod(n, len(live))  # np.array_split's sizes: the first r blocks get one more
        sizes = [q + 1] * r + [q] * (len(live) - r)
        self._rr = (self._rr + n) % self._book.n_units
        return np.repeat(np.asarray(order, dtype=np.int32), sizes)

    def commit(self, partition: str, index: np.ndarray, generation: np.ndarray,
               schemas: Mapping[str, Any], tags: list[dict[str, Any]] | None = None,
               holder: Mapping[str, Any] | None = None,
               shared: Sequence[str | None] | None = None) -> None:
        """Mark the fields of rows ``index`` written (their bytes are stored); ``holder``
        as in ``reserve``; ``shared``: the shared entry each row names (or None)."""
        schemas_ = parse_schemas(schemas)
        index = np.asarray(index, dtype=np.int64)
        held = check_holder(holder)
        with self._book.cond:
            part = self._book.part(partition)
            self._check_holder(partition, held)
            part.check_generation(index, generation)
            part.check_schemas(schemas_)  # every check before the bind changes rows
            part.shared.check_commit(part, index, schemas_)
            if shared is not None:
                part.shared.bind(part, index, shared)
                self._book.pins.handed(part, shared)  # the rows keep the entries now
            self.mark_written(part, index, schemas_, tags)
            self._book.reservations.settle(partition, index)

    def mark_written(self, part: PartitionMeta, index: np.ndarray,
                      schemas_: dict[str, FieldSchema], tags: list[Any] | None) -> None:
        """Commit the fields of rows ``index`` (lock held; generations checked)."""
        part.fix_schemas(schemas_)
        for f in schemas_:
            part.ready[f][index] = True
        if part.lost:  # a lost row's key made afresh: a later put adds to this row
            part.lost.forget(part.keys[index].tolist())
        part.write_time[index] = self._book.clock()
        if tags is not None:  # no tags: nothing to merge
            part.tags.set(index, tags)
        index = part.shared.written(part, index)  # rows naming entries written here
        for task in self._book.tasks[part.name].values():
            task.offer(index, part.ready_for(task.config.fields, index, task.tags))
        self._rows_ready(part)

    def abort(self, partition: str, index: np.ndarray, generation: np.ndarray) -> None:
        """Undo ``reserve`` for rows that no field was committed to."""
        index = np.asarray(index, dtype=np.int64)
        with self._book.cond:
            part = self._book.parts.get(partition)
            if part is None:
                return
            gen = np.asarray(generation, dtype=np.int64)
            ok = part.used[index] & (part.generation[index] == gen)
            for r in part.shared.own_ready(part, index).values():  # not an entry's field
                ok &= ~r
            freed = self._book.undo_rows(part, index[ok])  # and the claims they made
        self._book.free_slots(partition, freed)
        with self._book.cond:  # a failed first put leaves no partition (once its slots are free)
            part = self._book.parts.get(partition)
            if part is not None and part.unused() and not self._book.tasks[partition]:
                del self._book.parts[partition], self._book.tasks[partition]

    def clear(self, partition: str, keys: Sequence[str] | None = None) -> int:
        """Free rows (all rows if ``keys`` is None); returns how many were freed."""
        with self._book.cond:
            part = self._book.part(partition)
            if keys is None:
                rows = np.flatnonzero(part.used)
            else:
                keys = list(keys)
                check_unreserved([k for k in keys if isinstance(k, str) and k])  # no entry's
                rows = part.lookup(keys)
                rows = rows[rows >= 0]
            part.lost.forget(keys)  # a cleared key may be written afresh
            n = len(part.shared.rows(rows))  # entries are no rows
            freed = self._book.release_rows(part, rows)
            if keys is None:  # a cleared partition forgets its shared fields
                part.shared.forget(set(part.shared.fields))
        self._book.free_slots(partition, freed)
        return n

    def set_tags(self, partition: str, keys: Sequence[str], tags: list[dict[str, Any]]) -> None:
        """Merge ``tags[i]`` into the tags of ``keys[i]``; rows may become ready."""
        tags_ = check_tags(tags, len(keys))
        with self._book.cond:
            part = self._book.part(partition)
            idx = access.existing(part, keys)
            part.tags.set(idx, tags_ or [])
            for task in self._book.tasks[partition].values():  # rows may wait for these tags
                task.offer(idx, part.ready_for(task.config.fields, idx, task.tags))
            self._rows_ready(part)
