"""Controller: keys, readiness, leases and steps of every partition — metadata only.

Public methods take and return plain values, numpy arrays or the reply structs of
``tq_stream.messages``. One lock guards all metadata; one condition wakes waiters
whenever rows are committed, acked, released or cleared. Each concern is a part on
one ``Book`` (partitions, tasks, the condition): ``Writes``, ``Spares`` (puts on
spare rows), ``Consuming`` over ``Delivery`` (the delivery rules), ``Admission``,
``Units`` (lost storage units), and plain functions (``access``, ``registration``,
``counts``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from tq_stream.controller import access, counts, registration
from tq_stream.controller.admission import Admission
from tq_stream.controller.book import Book, Journal
from tq_stream.controller.consuming import Consuming
from tq_stream.controller.delivery import Delivery
from tq_stream.controller.frees import FreeFn, Frees, no_free
from tq_stream.controller.journal_replay import RowsOf, replay
from tq_stream.controller.media_calls import MediaCalls
from tq_stream.controller.reservations import DEFAULT_WRITE_LEASE, Reservations
from tq_stream.controller.shared_puts import reserve_shared
from tq_stream.controller.spares import Spares
from tq_stream.controller.spill_hints import SpillFn, SpillHints, no_spill
from tq_stream.controller.task_config import DEFAULT_LEASE_TIMEOUT, TaskConfig
from tq_stream.controller.timings import Timings
from tq_stream.controller.units import Units
from tq_stream.controller.waiters import Waiters
from tq_stream.controller.writes import Writes
from tq_stream.errors import ConfigError, StateError, check_consumers, check_name, check_positive
from tq_stream.handling import Reply
from tq_stream.messages.puts import Committed, Placement
from tq_stream.messages.reads import (
    AdmissionStatus,
    Found,
    Located,
    Resume,
    StepMeta,
    TagColumns,
    TaskRows,
)
from tq_stream.samplers.base import Sampler, check_sampler
from tq_stream.samplers.sequential import SequentialSampler

logger = logging.getLogger(__name__)
Clock = Callable[[], float]


class Controller:
    """The metadata service of one deployment.

    Args:
        n_units: number of storage units rows are spread over.
        free: ``free(unit, partition, slots)``, called (outside the lock) when
            rows are freed, so the unit returns their memory.
        timings: what measures waits and logs the slow ones (default: ``Timings()``).
        clock: wall-clock seconds of leases, reservations and write times (a test's
            fake clock moves them on; waits are bounded by ``time.monotonic``).
    """

    def __init__(self, n_units: int = 1, free: FreeFn = no_free,
                 timings: Timings | None = None, clock: Clock = time.time,
                 may_spill: SpillFn = no_spill) -> None:
        self.n_units = check_positive("n_units", n_units)
        self._cond = threading.Condition(threading.RLock())
        self._timings = Timings() if timings is None else timings  # waits, rates, hand-outs
        self._reservations = Reservations()  # rows reserved, not committed (reservations.py)
        # partitions, tasks, slots freed in storage and retried (book.py, frees.py)
        self._book = Book(self.n_units, self._cond, self._reservations,
                          Frees(free, self._cond), SpillHints(may_spill, self._cond), clock)
        self._parts, self._tasks = self._book.parts, self._book.tasks
        self._waiters = Waiters(self._cond)  # get_meta calls waiting (waiters.py)
        # storage units lost and not back, and the loss of their rows (units.py)
        self._units = Units(self._book)
        self._admission = Admission(self._book, self._timings)
        self._delivery = Delivery(self._book, self._waiters, self._timings)
        self._consuming = Consuming(self._book, self._delivery, self._waiters, self._timings)
        self._writes = Writes(self._book, self._units, self._timings,
                              lambda: self._live_units(), self._consuming.rows_ready)
        self._spares = Spares(self._book, self._writes.place_spares, self._writes.mark_written,
                              self._consuming.rows_ready)
        self._media = MediaCalls(self._book)  # media handles' pins (media_calls.py)
        self.media_hold, self.media_release = self._media.hold, self._media.release
        self.media_lookup = self._media.lookup

    # ------------------------------------------------------------ parts, for tests and tools
    @property
    def lock(self) -> threading.Condition:
        """The one lock (and condition) every controller part holds while it runs."""
        return self._cond

    @property
    def book(self) -> Book:
        """The partitions and tasks (``Book``); read or change them under ``lock``."""
        return self._book

    @property
    def waiters(self) -> Waiters:
        """The get_meta calls parked for rows (``len`` counts them)."""
        return self._waiters

    @property
    def unit_map(self) -> Units:
        """Where rows live on the storage units, and what a lost unit takes (``Units``)."""
        return self._units

    # ------------------------------------------------------------ admission
    def admit(self, partition: str, n: int, timeout: float = 60.0) -> int:
        """``Admission.admit``: wait until ``n`` more rows may be started."""
        return self._admission.admit(partition, n, timeout)

    def set_admission(self, partition: str, task: str, steps_per_version: int) -> None:
        """``Admission.set_steps_per_version``."""
        self._admission.set_steps_per_version(partition, task, steps_per_version)

    def admission(self, partition: str) -> AdmissionStatus:
        """``Admission.status``: rows admitted so far and the room left."""
        return self._admission.status(partition)

    def task_rows(self, partition: str, task: str) -> TaskRows:
        """Rows ``task`` will still be handed in new steps (``counts.task_rows``)."""
        with self._cond:
            self._book.check_open()
            part = self._parts.get(partition)
            return counts.task_rows(part, None if part is None else
                                    self._tasks[partition].get(task))

    # ------------------------------------------------------------ rows by key (access.py)
    def lookup(self, partition: str, keys: Sequence[str],
               fields: Sequence[str] | None = ()) -> Found:
        """Placement of existing ``keys`` whose ``fields`` are written (``access.lookup``)."""
        with self._cond:
            return access.lookup(self._book.part(partition), keys, fields)

    def locate(self, partition: str, keys: Sequence[str]) -> Located:
        """Where ``keys`` live and which fields they hold (``access.locate``)."""
        with self._cond:
            return access.locate(self._book.part(partition), keys)

    def list_rows(self, partition: str,
                  keys: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Every row (or ``keys``'): key, tags, fields; oldest first (``access.list_rows``)."""
        with self._cond:
            return access.list_rows(self._book.part(partition), keys)

    def list_tags(self, partition: str) -> TagColumns:
        """Keys and tags of every row as columns (``access.list_tags``)."""
        with self._cond:
            return access.list_tags(self._book.part(partition))

    def keys_of(self, partition: str, index: Sequence[int]) -> list[str]:
        """Keys of live rows ``index`` (``access.keys_of``)."""
        with self._cond:
            return access.keys_of(self._book.part(partition), index)

    def stats(self) -> dict[str, Any]:
        """Per partition: ``access.partition_stats`` (keys: ``stats.PartitionStats``)."""
        with self._cond:
            now = self._book.clock()
            return {name: {**access.partition_stats(part, self._tasks[name], self._timings, now),
                           "media": self._media.stats(part)} for name, part in self._parts.items()}

    def clear(self, partition: str, keys: Sequence[str] | None = None) -> int:
        """``Writes.clear``: free rows (all rows if ``keys`` is None); returns how many."""
        return self._writes.clear(partition, keys)

    def set_tags(self, partition: str, keys: Sequence[str], tags: list[dict[str, Any]]) -> None:
        """``Writes.set_tags``: merge ``tags[i]`` into the tags of ``keys[i]``."""
        self._writes.set_tags(partition, keys, tags)

    # ------------------------------------------------------------ storage units
    def unit_lost(self, unit: int) -> dict[str, int]:
        """``Units.lost``: drop the rows of unit ``unit``, place none there; returns
        rows dropped per partition."""
        return self._units.lost(unit)

    def unit_back(self, unit: int) -> None:
        """``Units.back``: a new, empty unit serves as ``unit``."""
        self._units.back(unit)

    def dead_units(self) -> list[int]:
        """Storage units lost and not back."""
        with self._cond:
            return sorted(self._units.dead)

    def _live_units(self) -> np.ndarray:
        """Units new rows may be placed on (a deployment may leave out silent ones)."""
        return self._units.live()

    # ------------------------------------------------------------ partitions
    def create_partition(self, partition: str, capacity: int | None = None,
                         consumers: Sequence[str] | None = None,
                         spills: bool = False) -> None:
        """Create ``partition`` (a no-op if it exists with the same settings).

        Args:
            capacity: at most this many live rows (a full partition blocks writers).
            consumers: the tasks that will read every row. A row is freed once each of
                them acked or discarded it; without a declaration rows stay until cleared.
                Declared once; tasks not in the list cannot register.
            spills: its units keep a memory budget: tell them which fields of live rows
                every declared reader finished (``spill_hints.py``); never unset.
        """
        if capacity is not None:
            check_positive("capacity", capacity)
        declared = None if consumers is None else check_consumers(consumers)
        with self._cond:
            freed = registration.declare(self._book, partition, capacity, declared, spills)
        self._book.free_slots(partition, freed)

    def close_partition(self, partition: str) -> None:
        """No more rows will be written: drain-mode consumers end after the last batch."""
        with self._cond:
            self._book.part(partition, create=True).closed = True
            self._cond.notify_all()

    def partitions(self) -> list[str]:
        with self._cond:
            return sorted(self._parts)

    # ----------------------------------------------------------------- writes
    def reserve(self, partition: str, keys: Sequence[str], schemas: Mapping[str, Any],
                unit: int = -1, timeout: float = 60.0,
                expect: Sequence[int] | None = None, spare: int = 0, session: str = "",
                lease: float = DEFAULT_WRITE_LEASE,
                holder: Mapping[str, Any] | None = None, blocked: float = 0.0) -> Placement:
        """``Writes.reserve``: validate a put and place its rows; new rows wait for
        capacity."""
        return self._writes.reserve(partition, keys, schemas, unit, timeout, expect, spare,
                                    session, lease, holder, blocked)

    def reserve_shared(self, partition: str, keys: Sequence[str], schemas: Mapping[str, Any],
                       digests: Sequence[Mapping[str, str]], nbytes: Sequence[int],
                       unit: int = -1, timeout: float = 60.0, session: str = "",
                       lease: float = DEFAULT_WRITE_LEASE) -> Placement:
        """``shared_puts.reserve_shared`` (the other arguments as in ``reserve``)."""
        return reserve_shared(self._cond, lambda p: self._book.part(p, create=True, by_put=True),
                              self.reserve, self.abort, partition, keys, schemas, digests,
                              nbytes, {"unit": unit, "timeout": timeout, "session": session,
                                       "lease": lease})

    def commit(self, partition: str, index: np.ndarray, generation: np.ndarray,
               schemas: Mapping[str, Any], tags: list[dict[str, Any]] | None = None,
               holder: Mapping[str, Any] | None = None,
               shared: Sequence[str | None] | None = None) -> None:
        """``Writes.commit``: mark the fields of rows ``index`` written (``shared``: the
        shared entry each row names, or None)."""
        self._writes.commit(partition, index, generation, schemas, tags, holder, shared)

    def abort(self, partition: str, index: np.ndarray, generation: np.ndarray) -> None:
        """``Writes.abort``: undo ``reserve`` for rows that no field was committed to."""
        self._writes.abort(partition, index, generation)

    def commit_new(self, partition: str, keys: Sequence[str], index: Sequence[int] | np.ndarray,
                   generation: Sequence[int] | np.ndarray, schemas: Mapping[str, Any],
                   tags: list[dict[str, Any]] | None = None, unit: int = -1,
                   spare: int = 0) -> Committed:
        """``Spares.commit_new``: create rows for new ``keys`` on spare rows whose bytes
        are stored, and commit them."""
        return self._spares.commit_new(partition, keys, index, generation, schemas, tags,
                                       unit, spare)

    def release_spares(self, partition: str, index: np.ndarray, generation: np.ndarray) -> int:
        """``Spares.release_spares``: take back spare rows a writer no longer needs."""
        return self._spares.release_spares(partition, index, generation)

    # ------------------------------------------------------------ consumers (consuming.py)
    def get_meta(self, partition: str, task: str, step: int | None = None, dp_rank: int = 0,
                 timeout: float = 60.0, replica: int | None = None, session: str = "",
                 consumer: str = "", reply: Reply[StepMeta] | None = None) -> StepMeta | None:
        """``Consuming.get_meta``: the rows of ``step`` (None: the next batch for this
        consumer) for ``dp_rank``; waits for enough ready rows."""
        return self._consuming.get_meta(partition, task, step, dp_rank, timeout, replica,
                                        session, consumer, reply)

    def ack(self, partition: str, task: str, step: int, dp_rank: int, index: np.ndarray,
            generation: np.ndarray, replica: int = 0, session: str = "") -> int:
        """``Consuming.ack``: replica ``replica`` of ``dp_rank`` is done with rows."""
        return self._consuming.ack(partition, task, step, dp_rank, index, generation, replica,
                                   session)

    def release(self, partition: str, task: str, step: int, dp_rank: int, index: np.ndarray,
                generation: np.ndarray, replica: int = 0, session: str = "") -> None:
        """``Consuming.release``: give up reading (step, dp_rank) for now."""
        self._consuming.release(partition, task, step, dp_rank, index, generation, replica,
                                session)

    def renew(self, partition: str, task: str, step: int | None = None,
              session: str = "") -> int:
        """``Consuming.renew``: keep the leases of ``session`` alive."""
        return self._consuming.renew(partition, task, step, session)

    def first_unfinished(self, partition: str, task: str, dp_rank: int = 0,
                         replica: int | None = None) -> Resume:
        """``Consuming.first_unfinished``: where a reader of ``dp_rank`` resumes."""
        return self._consuming.first_unfinished(partition, task, dp_rank, replica)

    def cancel(self, session: str) -> None:
        """``Consuming.cancel``: end every wait and claim of ``session`` now."""
        self._consuming.cancel(session)

    # ------------------------------------------------------------------ tasks
    def register_task(self, partition: str, task: str, fields: Sequence[str], batch_size: int,
                      dp_size: int = 1, replicas: int = 1,
                      lease_timeout: float = DEFAULT_LEASE_TIMEOUT, drop_last: bool = False,
                      sampler: Sampler | None = None) -> None:
        """Declare a consumer task; every rank calls it with the same arguments
        (``register`` with their ``TaskConfig``)."""
        check_name("task", task)
        self.register(partition, task, TaskConfig.checked(
            fields, batch_size, dp_size, replicas, lease_timeout, drop_last), sampler)

    def register(self, partition: str, task: str, config: TaskConfig,
                 sampler: Sampler | None = None) -> None:
        """Declare consumer ``task`` of ``partition`` with ``config`` and ``sampler``
        (default: SequentialSampler) (``registration.register``)."""
        check_name("task", task)
        sampler = check_sampler(sampler if sampler is not None else SequentialSampler())
        with self._cond:
            registration.register(self._book, partition, task, config, sampler)

    def set_version(self, partition: str, task: str, version: int,
                    at_step: int | None = None) -> None:
        """The consumer's current policy version (read by staleness-aware samplers).

        Args:
            at_step: the step the consumer reads next under ``version`` (a loader passes
                it). Steps formed ahead of their turn then see the highest version the
                consumer may hold at their turn (``TaskState.version_at``), so a
                staleness bound still holds when a prefetched batch reaches the training
                loop; rows are discarded as stale only against ``version`` itself. The
                same version again only moves the consumer's position (``reading``).
        """
        if isinstance(version, bool) or not isinstance(version, int):
            raise ConfigError(f"version must be an int, got {version!r}")
        if at_step is not None:
            check_positive("at_step", at_step, allow_zero=True)
        with self._cond:
            registration.set_version(self._book, partition, task, version, at_step)

    def reading(self, partition: str, task: str, step: int) -> None:
        """The consumer reads ``step`` now, under the version it set last: a step held
        back because rows might be stale at a version predicted for its turn is then
        formed for the version the consumer actually holds (a loader calls this before
        it waits for a batch). A call for a step already passed changes nothing."""
        check_positive("step", step, allow_zero=True)
        with self._cond:
            registration.reading(self._book, partition, task, step)

    def close(self) -> None:
        with self._cond:
            self._book.closed = True
            self._cond.notify_all()

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        from tq_stream.controller.checkpoint import controller_state

        with self._cond:
            return controller_state(self._parts, self._tasks, self._book.pins)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        from tq_stream.controller.checkpoint import load_into

        with self._cond:
            if self._parts:
                raise StateError("load_state_dict must be called on an empty controller")
            freed = load_into(self._book, state, self.n_units)
            self._cond.notify_all()
        for name, slots in freed:  # rows dropped by a restore (checkpoint.for_new_deployment)
            self._book.free_slots(name, slots)

    def set_clock(self, clock: Clock) -> None:
        """Read wall-clock seconds from ``clock`` from now on (a test's fake clock)."""
        with self._cond:
            self._book.clock = clock

    def set_journal(self, journal: Journal | None) -> None:
        """Record every delivery change in ``journal`` before its reply from now on
        (``deploy/ack_journal.py``; None: no more)."""
        with self._cond:
            self._book.journal = journal

    def replay_journal(self, records: Iterable[list[Any]], rows_of: RowsOf,
                       source: str) -> dict[str, int]:
        """Apply ack-journal ``records`` (of file ``source``) on a restored controller
        before it serves (``journal_replay.replay``); returns the changes by kind."""
        with self._cond:
            return replay(self._book, self._delivery, self.register_task, records, rows_of,
                          source)
