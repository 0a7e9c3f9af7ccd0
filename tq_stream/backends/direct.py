"""DirectWrites: same-host writers copy dense rows straight into a unit's shared memory.

Protocol (two small calls around one copy):

1. ``prepare_write(partition, slots, generations, fields, arenas)``: under the unit's
   lock the dense slabs of ``fields`` are created or grown to hold ``slots``, the rows
   of ``arenas`` (ragged and multi-ragged fields, ``tq_stream.backends.arena_writes``)
   are reserved at the end of their arenas, the slots' tokens are set UNSET (readers
   retry) and a *write ticket* is opened; the reply is the slabs' layout (segment,
   dtype, shape) and each arena's, with where in it the rows' values go (``at``).
2. The writer copies its rows into the mapped segments.
3. ``finish_write(partition, ticket, ok, columns)``: the tokens are published (``ok``)
   or left UNSET (a failed copy: the rows stay unreadable), and the ticket is closed;
   the rows' other fields (``columns``: object fields) are then put as by ``put``,
   which saves the writer a call.

Invariant: a slab or arena never moves (grows or compacts into a new segment) while
a ticket of its partition is open — a growth waits (bounded) until the tickets
close, or expire after ``TICKET_TTL`` seconds (a writer that died), so no copy lands
in a segment that was already replaced.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tq_stream.backends.alloc import Alloc
from tq_stream.backends.arena_writes import ArenaWrite
from tq_stream.backends.partition_store import PartitionStore
from tq_stream.backends.slabs import DenseSlab, MultiRaggedArena, RaggedArena, Store
from tq_stream.backends.slots import check_unheld
from tq_stream.backends.spill import least_dense
from tq_stream.columns import dtype_from_name, dtype_name
from tq_stream.errors import ConfigError, StateError, WaitTimeout
from tq_stream.handling import WouldBlock, may_block

TICKET_TTL = 60.0  # seconds an open ticket blocks growth before it is dropped
GROWTH_WAIT = 30.0  # seconds a growth waits for open tickets


@dataclass(frozen=True)
class UnitStores:
    """What ``DirectWrites`` is handed of its unit: the unit's lock, its partitions (the
    same dict, guarded by that lock), and the unit's calls it makes with the lock held."""

    lock: threading.RLock
    parts: Mapping[str, PartitionStore]
    check_put: Callable[[str, Mapping[str, int], int], None]  # (partition, need, rows)
    new_partition: Callable[[str], PartitionStore]
    alloc_for: Callable[[str, str, str], Alloc]  # (partition, field, part)
    describe: Callable[[torch.Tensor], dict[str, Any] | None]  # a segment's layout


class DirectWrites:
    """The open direct writes of one ``ShmUnit``: their tickets, and the condition (on
    the unit's lock) that growths and checkpoints wait on until they close."""

    def __init__(self, unit: UnitStores) -> None:
        self._unit = unit
        self.cond = threading.Condition(unit.lock)
        self._tickets: dict[int, tuple[str, np.ndarray, np.ndarray | None, float]] = {}
        self._ticket_ids = itertools.count(1)

    def open_on(self, partition: str) -> bool:
        """True while a write ticket of ``partition`` is open (expired ones dropped)."""
        now = time.monotonic()
        for t in [t for t, v in self._tickets.items() if v[3] < now]:
            del self._tickets[t]  # its writer died: its slots stay UNSET (unreadable)
        return any(v[0] == partition for v in self._tickets.values())

    def _must_grow(self, partition: str, slots: np.ndarray, fields: Collection[str],
                   appends: Mapping[str, int]) -> bool:
        part = self._unit.parts.get(partition)
        if part is None or not len(slots):
            return False
        return _moves(part.fields, int(slots.max()), fields, appends)

    def wait_growth(self, partition: str, slots: np.ndarray, fields: Collection[str],
                    appends: Mapping[str, int]) -> None:
        """Called with the lock held: wait until growing these slabs (to hold ``slots``
        of ``fields``) and arenas (by ``appends`` values) moves no open write.

        Raises:
            WouldBlock: it would wait, on a server's IO thread (``may_block()`` False):
                that thread must stay free to run the ``finish_write`` that ends the wait.
        """
        deadline = time.monotonic() + GROWTH_WAIT
        while self._must_grow(partition, slots, fields, appends) and self.open_on(partition):
            if not may_block():
                raise WouldBlock
            left = deadline - time.monotonic()
            if left <= 0:
                raise WaitTimeout(f"a slab of partition {partition!r} must grow, but direct "
                                  f"writes stayed open for {GROWTH_WAIT}s")
            self.cond.wait(min(left, 1.0))

    def quiesce(self, partition: str, slots: np.ndarray) -> None:
        """Called with the lock held: wait (bounded) until no open write covers ``slots``,
        so a checkpoint copies their finished rows (a row being written has no token)."""
        deadline = time.monotonic() + GROWTH_WAIT
        while self.open_on(partition) and any(
                v[0] == partition and np.isin(v[1], slots).any()
                for v in self._tickets.values()):
            left = deadline - time.monotonic()
            if left <= 0:
                raise WaitTimeout(f"a checkpoint of partition {partition!r} waited "
                                  f"{GROWTH_WAIT}s for direct writes to its rows to finish")
            self.cond.wait(min(left, 1.0))

    def prepare(self, partition: str, slots: np.ndarray, generations: np.ndarray | None,
                fields: Mapping[str, Sequence[Any]],
                arenas: Mapping[str, object] | None = None) -> dict[str, Any]:
        """Ready dense slabs of ``fields`` (name -> [dtype, shape]) for ``slots``, and
        place their rows of ragged fields ``arenas`` (name -> ``ArenaWrite.wire()``).
        The unit collects the segments a growth left behind afterwards.

        Returns:
            ``{"ticket", "fields": {name: layout}, "arenas": {name: layout plus "at"}}``.
        """
        unit = self._unit
        slots = np.asarray(slots, dtype=np.int64)
        writes = {name: ArenaWrite.parse(name, raw, len(slots))
                  for name, raw in (arenas or {}).items()}
        with self.cond:
            unit.check_put(partition, {
                f: least_dense(len(slots), tuple(shape), dtype_from_name(dtype))
                for f, (dtype, shape) in fields.items()}, len(slots))
            self.wait_growth(partition, slots, fields,
                             {name: w.total for name, w in writes.items()})
            tokens = None if generations is None else np.asarray(generations, np.int64)
            part = unit.parts.get(partition)
            if part is not None:  # a put never replaces another row
                check_unheld(partition, slots, part.gen.data.numpy(), tokens)
            else:
                part = unit.new_partition(partition)

            def alloc_for(name: str, kind: str = "") -> Alloc:
                return unit.alloc_for(partition, name, kind)

            dense: list[DenseSlab] = []
            for name, (dtype, shape) in fields.items():
                store = part.fields.get(name)
                if store is None:
                    store = part.fields[name] = DenseSlab(
                        dtype_from_name(dtype), tuple(shape), alloc_for(name),
                        alloc_for(name, "flags"))
                if not (isinstance(store, DenseSlab) and store.shape == tuple(shape)
                        and str(store.dtype).removeprefix("torch.") == dtype):
                    raise ConfigError(f"field {name!r} must be a dense slab of "
                                      f"{dtype}{list(shape)} to be written directly")
                dense.append(store)
            for name, write in writes.items():
                store = part.fields.get(name)
                if store is None:
                    store = part.fields[name] = write.new_store(alloc_for(name))
                if not write.fits(store):
                    raise ConfigError(f"field {name!r} must be a {write.kind} arena of "
                                      f"{dtype_name(write.dtype)}{list(write.shape)} to be "
                                      f"written directly")
            # Every field checked before any row is placed: a refused write places none.
            at = {name: write.place(part.fields[name], slots) for name, write in writes.items()}
            for slab in dense:
                slab.ensure(int(slots.max()))
            layout: dict[str, Any] = {}
            for name in (*fields, *writes):
                store = part.fields[name]
                desc = unit.describe(store.data if isinstance(store, DenseSlab)
                                     else _arena_values(name, store))
                if desc is None:
                    raise ConfigError(f"field {name!r} has no shared-memory slab")
                layout[name] = desc
                if isinstance(store, DenseSlab):
                    store.written[slots] = True
            part.gen.begin(slots)
            part.mark(slots, True)
            ticket = next(self._ticket_ids)
            self._tickets[ticket] = (partition, slots, tokens,
                                     time.monotonic() + TICKET_TTL)
        return {"ticket": ticket, "fields": {f: layout[f] for f in fields},
                "arenas": {f: {**layout[f], "at": at[f]} for f in writes}}

    def close(self, partition: str, ticket: int,
              ok: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """Publish (``ok``) or abandon the rows of ``ticket``; wakes waiting growths.
        Returns the ticket's slots and tokens."""
        with self.cond:
            entry = self._tickets.pop(int(ticket), None)
            self.cond.notify_all()
            if entry is None:
                raise StateError(f"write ticket {ticket} of partition {partition!r} must "
                                 f"be open to finish, but it expired (> {TICKET_TTL}s)")
            part = self._unit.parts.get(partition)
            if ok and part is not None:
                part.gen.end(entry[1], entry[2])
        return entry[1], entry[2]


def _arena_values(name: str, store: Store) -> torch.Tensor:
    """The values tensor of an arena store (a write placed rows of ``name`` in it)."""
    if not isinstance(store, RaggedArena | MultiRaggedArena):
        raise ConfigError(f"field {name!r} must be a dense slab or an arena to be "
                          f"written directly, got {type(store).__name__}")
    return store.values


def _moves(stores: Mapping[str, Store], top: int, fields: Collection[str],
           appends: Mapping[str, int]) -> bool:
    """True if holding slot ``top`` of dense ``fields``, or appending ``appends[f]``
    values to arena f, moves one of ``stores`` to a new segment."""
    for f, s in stores.items():
        if isinstance(s, DenseSlab) and f in fields and top >= s.data.shape[0]:
            return True
        if isinstance(s, RaggedArena | MultiRaggedArena) and f in appends and \
                s.moves_for(appends[f]):
            return True
    return False
