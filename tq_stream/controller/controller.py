"""Controller: keys, readiness, leases and steps of every partition — metadata only.

Every public method takes and returns plain values (str, int, float, bool,
lists, dicts, numpy arrays), so the same object serves in-process callers and
remote ones behind a transport. One lock guards all metadata; one condition
variable wakes waiters (consumers waiting for ready rows, writers waiting for
capacity) whenever rows are committed, acked, released or cleared.

The write protocol is ``reserve`` (validate, allocate rows; may wait for
capacity) → the writer stores the bytes in the units → ``commit`` (rows become
visible); a writer that fails in between calls ``abort``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tq_stream.checks import check_tags
from tq_stream.columns import FieldSchema
from tq_stream.controller import access, counts
from tq_stream.controller.admission import Admission
from tq_stream.controller.capacity import full_error, full_reason
from tq_stream.controller.consuming import ConsumingLogic, check_session
from tq_stream.controller.frees import FreeFn, Frees, no_free
from tq_stream.controller.media_calls import MediaCalls
from tq_stream.controller.partition import PartitionMeta, parse_schemas
from tq_stream.controller.reservations import (
    DEFAULT_WRITE_LEASE,
    WRITER_TASK,
    Reservations,
    abort_due,
    hold_restored,
)
from tq_stream.controller.shared_puts import reserve_shared
from tq_stream.controller.spares import SpareLogic, check_spare
from tq_stream.controller.steps import StepLogic
from tq_stream.controller.takeovers import check_holder
from tq_stream.controller.task import TaskConfig, TaskState, check_replicas
from tq_stream.controller.timings import Timings
from tq_stream.controller.units import Units
from tq_stream.controller.waiters import Waiters
from tq_stream.errors import (
    ClosedError,
    ConfigError,
    KeyConflictError,
    StateError,
    check_consumers,
    check_name,
    check_positive,
    check_timeout,
)
from tq_stream.handling import WouldBlock, may_block
from tq_stream.samplers.base import Sampler, check_sampler
from tq_stream.samplers.sequential import SequentialSampler

logger = logging.getLogger(__name__)


class Controller(ConsumingLogic, StepLogic, SpareLogic):
    """The metadata service of one deployment.

    Args:
        n_units: number of storage units rows are spread over.
        free: ``free(unit, partition, slots)``, called (outside the lock) when
            rows are freed, so the unit returns their memory.
        timings: what measures waits and logs the slow ones (default: ``Timings()``).
    """

    RPC_METHODS = frozenset({
        "create_partition", "close_partition", "reserve", "commit", "abort",
        "register_task", "get_meta", "ack", "release", "renew", "clear", "lookup",
        "locate", "list_rows", "list_tags", "keys_of", "set_tags", "set_version", "reading",
        "stats",
        "partitions", "admit", "set_admission", "admission", "commit_new", "release_spares",
        "first_unfinished", "cancel", "task_rows", "dead_units", "reserve_shared",
        "media_hold", "media_release", "media_lookup",
    })
    # Methods that never wait, so a server may run them on its IO thread: they hold the
    # lock only for short CPU work; reserve and admit raise WouldBlock instead of waiting.
    # Not here: get_meta (waits, and a sampler's discards free storage through the units),
    # ack / clear / abort (free storage through the units), list_rows / register_task
    # (work proportional to the partition, or a sampler module import).
    RPC_INLINE = frozenset({
        "create_partition", "close_partition", "partitions", "reserve", "commit", "release",
        "renew", "lookup", "locate", "keys_of", "set_tags", "set_version", "reading", "stats",
        "admit",
        "set_admission", "admission", "commit_new", "release_spares", "first_unfinished",
        "cancel", "task_rows", "dead_units",
    })

    # Methods that may wait long, by who waits (a server caps each class: see
    # ``tq_stream.transport.wait_slots``).
    RPC_WAITS = {"get_meta": "consume", "reserve": "produce", "admit": "produce",
                 "reserve_shared": "produce"}
    # Methods a server calls with their request's reply handle: a commit may answer a
    # waiting get_meta (``waiters.py``).
    RPC_REPLIES = frozenset({"get_meta"})

    def __init__(self, n_units: int = 1, free: FreeFn = no_free,
                 timings: Timings | None = None) -> None:
        self.n_units = check_positive("n_units", n_units)
        self._cond = threading.Condition(threading.RLock())
        self._parts: dict[str, PartitionMeta] = {}
        self._tasks: dict[str, dict[str, TaskState]] = {}
        self._rr = 0
        self._closed = False
        self._cancelled: dict[str, float] = {}  # consumer sessions told to stop waiting
        self._frees = Frees(free, self._cond)  # slots freed in storage, retried (frees.py)
        # metrics: waits, hand-out latency, rates; slow waits logged
        self._timings = Timings() if timings is None else timings
        self._reservations = Reservations()  # rows reserved, not committed (reservations.py)
        self._journal: Any = None  # records delivery changes (deploy/ack_journal.py) if set
        self._waiters = Waiters(self._cond)  # get_meta calls waiting (waiters.py)
        # storage units lost and not back, and the loss of their rows (units.py)
        self._units = Units(self.n_units, self._cond, lambda: self._parts,
                            lambda p: self._tasks.get(p, {}), self._frees, self._release_rows)
        # producers paced by the staleness window (admission.py)
        self._admission = Admission(self._cond, self._part, self._task,
                                    lambda p: self._tasks.get(p, {}), self._timings)
        # media pinned by handles of live sessions (media_calls.py, media_pins.py)
        self.media = MediaCalls(
            self._cond, lambda: self._parts, self._part,
            lambda p: self._part(p, create=True, by_put=True),
            lambda part, rows: self._free_slots(part.name, self._release_rows(part, rows)))
        self.media_hold, self.media_release = self.media.hold, self.media.release
        self.media_lookup = self.media.lookup

    # ------------------------------------------------------------ admission
    def admit(self, partition: str, n: int, timeout: float = 60.0) -> int:
        """``Admission.admit``: wait until ``n`` more rows may be started."""
        return self._admission.admit(partition, n, timeout)

    def set_admission(self, partition: str, task: str, steps_per_version: int) -> None:
        """``Admission.set_steps_per_version``."""
        self._admission.set_steps_per_version(partition, task, steps_per_version)

    def admission(self, partition: str) -> dict[str, Any]:
        """``Admission.status``: rows admitted so far and the room left."""
        return self._admission.status(partition)

    def task_rows(self, partition: str, task: str) -> dict[str, Any]:
        """Rows ``task`` will still be handed in new steps (``counts.task_rows``)."""
        with self._cond:
            self._check_open()
            part = self._parts.get(partition)
            return counts.task_rows(part, None if part is None else
                                    self._tasks[partition].get(task))

    # ------------------------------------------------------------ rows by key (access.py)
    def lookup(self, partition: str, keys: Sequence[str],
               fields: Sequence[str] | None = ()) -> dict[str, Any]:
        """Placement of existing ``keys`` whose ``fields`` are written (``access.lookup``)."""
        with self._cond:
            return access.lookup(self._part(partition), keys, fields)

    def locate(self, partition: str, keys: Sequence[str]) -> dict[str, Any]:
        """Where ``keys`` live and which fields they hold (``access.locate``)."""
        with self._cond:
            return access.locate(self._part(partition), keys)

    def list_rows(self, partition: str,
                  keys: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Every row (or ``keys``'): key, tags, fields; oldest first (``access.list_rows``)."""
        with self._cond:
            return access.list_rows(self._part(partition), keys)

    def list_tags(self, partition: str) -> dict[str, Any]:
        """Keys and tags of every row as columns (``access.list_tags``)."""
        with self._cond:
            return access.list_tags(self._part(partition))

    def keys_of(self, partition: str, index: Sequence[int]) -> list[str]:
        """Keys of live rows ``index`` (``access.keys_of``)."""
        with self._cond:
            return access.keys_of(self._part(partition), index)

    def stats(self) -> dict[str, Any]:
        """Per partition: ``access.partition_stats`` (keys: ``stats.PartitionStats``)."""
        with self._cond:
            return {name: {**access.partition_stats(part, self._tasks[name], self._timings),
                           "media": self.media.stats(part)}
                    for name, part in self._parts.items()}

    def clear(self, partition: str, keys: Sequence[str] | None = None) -> int:
        """Free rows (all rows if ``keys`` is None); returns how many were freed."""
        with self._cond:
            part = self._part(partition)
            if keys is None:
                rows = np.flatnonzero(part.used)
            else:
                rows = part.lookup(list(keys))
                rows = rows[rows >= 0]
            part.lost.forget(keys)  # a cleared key may be written afresh
            freed = self._release_rows(part, rows)
        self._free_slots(partition, freed)
        return len(rows)

    def set_tags(self, partition: str, keys: Sequence[str], tags: list[dict[str, Any]]) -> None:
        """Merge ``tags[i]`` into the tags of ``keys[i]``; rows may become ready."""
        tags_ = check_tags(tags, len(keys))
        with self._cond:
            part = self._part(partition)
            idx = access.existing(part, keys)
            part.tags.set(idx, tags_ or [])
            for task in self._tasks[partition].values():  # rows may wait for these tags
                task.offer(idx, part.ready_for(task.config.fields, idx, task.tags))
            self._rows_ready(part)

    # ------------------------------------------------------------ storage units
    def unit_lost(self, unit: int) -> dict[str, int]:
        """``Units.lost``: drop the rows of unit ``unit``, place none there; returns
        rows dropped per partition."""
        return self._units.lost(unit)

    def unit_back(self, unit: int) -> None:
        """``Units.back``: a new, empty unit serves as ``unit``."""
        self._units.back(unit)

    def dead_units(self) -> list[int]:
        with self._cond:
            return sorted(self._units.dead)

    def _live_units(self) -> np.ndarray:
        """Units new rows may be placed on (a deployment may leave out silent ones)."""
        return self._units.live()

    # ------------------------------------------------------------ partitions
    def _part(self, partition: str, create: bool = False, by_put: bool = False) -> PartitionMeta:
        self._check_open()
        part = self._parts.get(partition)
        if part is None:
            if not create:
                raise KeyConflictError(
                    f"partition must exist, got {partition!r} (known: {sorted(self._parts)})"
                )
            check_name("partition", partition)
            part = self._parts[partition] = PartitionMeta(partition, None, self.n_units)
            part.by_put = by_put  # made by a put (see abort)
            self._tasks[partition] = {}
        elif create and not by_put:
            part.by_put = False  # named explicitly: kept even while empty
        return part

    def create_partition(self, partition: str, capacity: int | None = None,
                         consumers: Sequence[str] | None = None) -> None:
        """Create ``partition`` (a no-op if it exists with the same settings).

        Args:
            capacity: at most this many live rows (a full partition blocks writers).
            consumers: the tasks that will read every row. A row is freed once each of
                them acked or discarded it; without a declaration rows stay until cleared.
                Declared once; tasks not in the list cannot register.
        """
        if capacity is not None:
            check_positive("capacity", capacity)
        declared = None if consumers is None else check_consumers(consumers)
        with self._cond:
            part = self._part(partition, create=True)
            if part.capacity != capacity and part.live and capacity is not None \
                    and capacity < part.live:
                raise ConfigError(
                    f"capacity must be >= the {part.live} rows partition {partition!r} "
                    f"holds, got {capacity}"
                )
            if declared is not None and part.consumers not in (None, declared):
                raise ConfigError(
                    f"consumers of partition {partition!r} are declared once: had "
                    f"{list(part.consumers or ())}, got {list(declared)}")
            if declared is not None:
                stray = sorted(set(self._tasks[partition]) - set(declared))
                if stray:
                    raise ConfigError(
                        f"consumers must include every task already registered on partition "
                        f"{partition!r}, missing {stray} from {list(declared)}")
            part.capacity = capacity
            if declared is not None and part.consumers is None:
                part.consumers = declared
                freed = self._finish_rows(part, np.flatnonzero(part.used))
            else:
                freed = []
        self._free_slots(partition, freed)

    def close_partition(self, partition: str) -> None:
        """No more rows will be written: drain-mode consumers end after the last batch."""
        with self._cond:
            self._part(partition, create=True).closed = True
            self._cond.notify_all()

    def partitions(self) -> list[str]:
        with self._cond:
            return sorted(self._parts)

    # ----------------------------------------------------------------- writes
    def reserve(self, partition: str, keys: Sequence[str], schemas: Mapping[str, Any],
                unit: int = -1, timeout: float = 60.0,
                expect: Sequence[int] | None = None, spare: int = 0, session: str = "",
                lease: float = DEFAULT_WRITE_LEASE,
                holder: Mapping[str, Any] | None = None) -> dict[str, Any]:
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
        with self._cond:
            part = self._part(partition, create=expect is None, by_put=True)
            held_for = self._check_holder(partition, held)
            while True:
                if may_block():
                    self._abort_reservations()  # a dead producer's rows hold capacity
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
                    raise ClosedError(
                        f"partition {partition!r} is closed to new rows, got new keys "
                        f"{[k for k, m in zip(keys, new.tolist(), strict=True) if m][:5]}"
                    )
                cap = part.capacity
                if cap is not None and n_new > cap:
                    raise ConfigError(
                        f"a put must not add more rows than the capacity {cap} of partition "
                        f"{partition!r}, got {n_new} new rows"
                    )
                if cap is None or part.live + n_new <= cap:
                    break
                if not may_block():
                    raise WouldBlock  # nothing allocated yet: a worker thread waits
                left = deadline - time.monotonic()
                if left <= 0:
                    raise full_error(part, timeout)
                wake = min(left, max(0.01, self._reservations.soonest() - time.time()))
                self._timings.wait(self._cond, wake, deadline - timeout, "capacity",
                                   partition, lambda: full_reason(part))
                self._check_open()
            if n_new:
                new_keys = [k for k, m in zip(keys, new.tolist(), strict=True) if m]
                idx[new] = part.allocate(new_keys, self._place(unit, n_new))
                self._grow_tasks(part)
                self._reservations.add(partition, idx[new], part.generation[idx[new]],
                                       session, lease, timeout, time.time())
            fixed = {f: part.schemas[f].to_dict() for f in schemas_ if f in part.schemas}
            out = {"index": idx, "unit": part.unit[idx], "slot": part.slot[idx],
                   "generation": part.generation[idx], "new": new, "schemas": fixed}
            if held_for is not None:  # the writer stores no byte after this many seconds
                out["holder_left"] = held_for
            if gone:
                part.lost.skipped += len(gone)
                out["lost"] = {"pos": list(gone), "unit": list(gone.values())}
            if spare:
                out["spare"] = self._spares(part, unit, spare if expect is None
                                            and part.capacity is None else 0)
            return out

    def reserve_shared(self, partition: str, keys: Sequence[str], schemas: Mapping[str, Any],
                       digests: Sequence[Mapping[str, str]], nbytes: Sequence[int],
                       unit: int = -1, timeout: float = 60.0, session: str = "",
                       lease: float = DEFAULT_WRITE_LEASE) -> dict[str, Any]:
        """``shared_puts.reserve_shared`` (the other arguments as in ``reserve``)."""
        return reserve_shared(self._cond, lambda p: self._part(p, create=True, by_put=True),
                              self.reserve, self.abort, partition, keys, schemas, digests,
                              nbytes, {"unit": unit, "timeout": timeout, "session": session,
                                       "lease": lease})

    def renew(self, partition: str, task: str, step: int | None = None,
              session: str = "") -> int:
        """``ConsumingLogic.renew``; a producer's heartbeat renews its media pins too."""
        n = super().renew(partition, task, step, session)
        if task == WRITER_TASK:
            with self._cond:
                n += self.media.renew(partition, session)
        return n

    def _check_holder(self, partition: str, held: tuple | None) -> float | None:
        """A write through a BatchMeta: see ``TaskState.check_writer``."""
        return None if held is None else \
            self._task(partition, held[0])[1].check_writer(held[1], held[2], time.time())

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("controller is closed (its stream was closed)")

    def _place(self, unit: int, n: int) -> np.ndarray:
        if 0 <= unit < self.n_units and unit not in self._units.dead:
            return np.full(n, unit, dtype=np.int32)
        # Contiguous blocks, one per live unit (rotating which unit comes first): rows
        # put together sit side by side in each unit and in the batch, so a read of them
        # is one plain copy per unit straight into the output. Lost units get none.
        live = self._live_units().tolist()
        first = self._rr % len(live)
        order = live[first:] + live[:first]
        q, r = divmod(n, len(live))  # np.array_split's sizes: the first r blocks get one more
        sizes = [q + 1] * r + [q] * (len(live) - r)
        self._rr = (self._rr + n) % self.n_units
        return np.repeat(np.asarray(order, dtype=np.int32), sizes)

    def _grow_tasks(self, part: PartitionMeta) -> None:
        for task in self._tasks[part.name].values():
            task.grow(part.size)

    def commit(self, partition: str, index: np.ndarray, generation: np.ndarray,
               schemas: Mapping[str, Any], tags: list[dict[str, Any]] | None = None,
               holder: Mapping[str, Any] | None = None,
               shared: Sequence[str | None] | None = None) -> None:
        """Mark the fields of rows ``index`` written (their bytes are stored); ``holder``
        as in ``reserve``; ``shared``: the shared entry each row names (or None)."""
        schemas_ = parse_schemas(schemas)
        index = np.asarray(index, dtype=np.int64)
        held = check_holder(holder)
        with self._cond:
            part = self._part(partition)
            self._check_holder(partition, held)
            part.check_generation(index, generation)
            if shared is not None:
                part.shared.bind(part, index, shared)
                self.media.pins.handed(part, shared)  # the rows keep the entries now
            self._mark_written(part, index, schemas_, tags)
            self._reservations.settle(partition, index)

    def _mark_written(self, part: PartitionMeta, index: np.ndarray,
                      schemas_: dict[str, FieldSchema], tags: list | None) -> None:
        """Commit the fields of rows ``index`` (lock held; generations checked)."""
        part.fix_schemas(schemas_)
        for f in schemas_:
            part.ready[f][index] = True
        if part.lost:  # a lost row's key made afresh: a later put adds to this row
            part.lost.forget(part.keys[index].tolist())
        part.write_time[index] = time.time()
        if tags is not None:  # no tags: nothing to merge
            part.tags.set(index, tags)
        index = part.shared.written(part, index)  # rows naming entries written here
        for task in self._tasks[part.name].values():
            task.offer(index, part.ready_for(task.config.fields, index, task.tags))
        self._rows_ready(part)

    def abort(self, partition: str, index: np.ndarray, generation: np.ndarray) -> None:
        """Undo ``reserve`` for rows that no field was committed to."""
        index = np.asarray(index, dtype=np.int64)
        with self._cond:
            part = self._parts.get(partition)
            if part is None:
                return
            gen = np.asarray(generation, dtype=np.int64)
            ok = part.used[index] & (part.generation[index] == gen)
            for r in part.ready.values():
                ok &= ~r[index]
            freed = self._release_rows(part, index[ok])
        self._free_slots(partition, freed)
        with self._cond:  # a failed first put leaves no partition (once its slots are free)
            part = self._parts.get(partition)
            if part is not None and part.unused() and not self._tasks[partition]:
                del self._parts[partition], self._tasks[partition]

    def _release_rows(self, part: PartitionMeta, rows: np.ndarray) -> list:
        if len(rows) == 0:
            return []
        for task in self._tasks[part.name].values():
            task.forget_row(rows)
            for rec in task.steps.values():
                rec.shares = [s[~np.isin(s, rows)] for s in rec.shares]
        freed = part.release(rows)
        self._reservations.settle(part.name, rows)
        self._cond.notify_all()
        return freed

    def _abort_reservations(self, session: str | None = None) -> int:
        """Abort the reservations due (or every one of ``session``), lock held
        (``reservations.abort_due``); returns the rows removed."""
        return self.media.expire() + abort_due(
            self._reservations, self._parts, lambda part, rows: self._free_slots(
                part.name, self._release_rows(part, rows)), session)

    def _free_slots(self, partition: str, freed: list) -> None:
        """Free slots in storage, then make them reusable (``frees.py``)."""
        self._frees.run(partition, freed, self._give_slots)

    def _give_slots(self, unit: int, partition: str, slots: np.ndarray) -> None:
        part = self._parts.get(partition)
        if part is not None:
            part.give_slots(unit, slots)

    # ------------------------------------------------------------------ tasks
    def register_task(self, partition: str, task: str, fields: Sequence[str], batch_size: int,
                      dp_size: int = 1, replicas: int = 1, lease_timeout: float = 300.0,
                      drop_last: bool = False, sampler: Sampler | None = None) -> None:
        """Declare a consumer task; every rank calls it with the same arguments."""
        check_name("task", task)
        if not fields or any(not isinstance(f, str) for f in fields):
            raise ConfigError(f"fields must be a non-empty list of str, got {fields!r}")
        config = TaskConfig(tuple(fields), check_positive("batch_size", batch_size),
                            check_positive("dp_size", dp_size),
                            check_replicas(replicas),
                            check_timeout("lease_timeout", lease_timeout), bool(drop_last))
        sampler = check_sampler(sampler if sampler is not None else SequentialSampler())
        with self._cond:
            part = self._part(partition, create=True)
            if part.consumers is not None and task not in part.consumers:
                raise ConfigError(
                    f"task must be one of the declared consumers {list(part.consumers)} of "
                    f"partition {partition!r}, got {task!r}")
            existing = self._tasks[partition].get(task)
            if existing is not None and existing.restored is not None:
                from tq_stream.controller.checkpoint import adopt

                adopt(existing, config, sampler)
                self._cond.notify_all()
                return
            if existing is not None:
                if existing.config != config:
                    raise ConfigError(
                        f"task {task!r} on partition {partition!r} must be registered with the "
                        f"same settings by every rank: had {existing.config}, got {config}"
                    )
                if type(existing.sampler) is not type(sampler):
                    raise ConfigError(
                        f"sampler of task {task!r} must be the same class on every rank: had "
                        f"{type(existing.sampler).__name__}, got {type(sampler).__name__}"
                    )
                return
            state = TaskState(task, config, sampler, part.size)
            state.last_move = time.time()
            state.version, state.version_step = part.versions.pop(task, (None, None))
            rows = part.oldest_first(np.flatnonzero(part.used))
            state.offer(rows, part.ready_for(config.fields, rows, state.tags))
            self._tasks[partition][task] = state
            self._cond.notify_all()

    def _task(self, partition: str, task: str) -> tuple[PartitionMeta, TaskState]:
        part = self._part(partition)
        state = self._tasks[partition].get(task)
        if state is None or state.restored is not None:
            again = " again after the restore" if state is not None else ""
            raise KeyConflictError(
                f"task must be registered on partition {partition!r}{again} first "
                f"(register_task), got {task!r}"
            )
        return part, state

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
            part = self._part(partition, create=True)
            state = self._tasks[partition].get(task)
            if state is None:  # before the consumer registers (a resumed trainer)
                part.versions[task] = (version, at_step)
            else:
                state.set_version(version, at_step)
            self._cond.notify_all()

    def reading(self, partition: str, task: str, step: int) -> None:
        """The consumer reads ``step`` now, under the version it set last: a step held
        back because rows might be stale at a version predicted for its turn is then
        formed for the version the consumer actually holds (a loader calls this before
        it waits for a batch). A call for a step already passed changes nothing."""
        check_positive("step", step, allow_zero=True)
        with self._cond:
            state = self._task(partition, task)[1]
            before = state.position
            state.reading(step)
            if state.position != before:
                state.last_move = time.time()
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        from tq_stream.controller.checkpoint import controller_state

        with self._cond:
            return controller_state(self._parts, self._tasks)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        from tq_stream.controller.checkpoint import load_controller

        with self._cond:
            if self._parts:
                raise StateError("load_state_dict must be called on an empty controller")
            self._parts, self._tasks = load_controller(state, self.n_units)
            hold_restored(self._reservations, self._parts)
            self._cond.notify_all()
