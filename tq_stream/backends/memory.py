"""MemoryUnit: a storage unit in this process's heap (embedded mode, unit tests)."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import numpy as np

from tq_stream.backends.base import StorageUnit
from tq_stream.backends.slabs import Alloc, Generations, Store, heap_alloc, stale_rows, store_for
from tq_stream.columns import Column
from tq_stream.errors import ClosedError, KeyConflictError


class _PartitionStore:
    """The stores of one partition; ``live`` counts written slots so an empty
    partition can hand all of its memory back; ``gen`` holds each slot's token."""

    def __init__(self, alloc: Alloc) -> None:
        self.fields: dict[str, Store] = {}
        self.live = np.zeros(0, dtype=bool)
        self.gen = Generations(alloc)

    def mark(self, slots: np.ndarray, value: bool) -> None:
        top = int(slots.max()) + 1 if len(slots) else 0
        if top > self.live.shape[0]:
            grow = max(top, 2 * self.live.shape[0]) - self.live.shape[0]
            self.live = np.concatenate([self.live, np.zeros(grow, dtype=bool)])
        self.live[slots] = value


class MemoryUnit(StorageUnit):
    """Column slabs on the heap, one lock per unit.

    Example:
        >>> unit = MemoryUnit()
        >>> unit.put("train", np.array([0, 1]), {"x": torch.ones(2, 3)})
        >>> unit.get("train", np.array([1]), ["x"])["x"].shape
        torch.Size([1, 3])
    """

    def __init__(self, alloc: Alloc = heap_alloc) -> None:
        self._alloc = alloc
        self._parts: dict[str, _PartitionStore] = {}
        self._lock = threading.RLock()  # re-entered by ShmUnit's direct-write checks
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("storage unit is closed")

    def _alloc_for(self, partition: str, field: str) -> Alloc:
        """The allocator of one new store (``field`` "" for the slot tokens)."""
        return self._alloc

    def put(self, partition: str, slots: np.ndarray, columns: Mapping[str, Column],
            generations: np.ndarray | None = None) -> None:
        slots = np.asarray(slots, dtype=np.int64)
        if len(slots) == 0:
            return
        with self._lock:
            self._check_open()
            part = self._parts.get(partition)
            if part is None:
                part = self._parts[partition] = _PartitionStore(self._alloc_for(partition, ""))
            part.gen.begin(slots)  # same-host readers of these slots now retry
            try:
                for name, column in columns.items():
                    store = part.fields.get(name)
                    if store is None:
                        store = part.fields[name] = store_for(
                            column, self._alloc_for(partition, name))
                    store.put(slots, column)
                part.mark(slots, True)
            finally:
                part.gen.end(slots, generations)

    def get(self, partition: str, slots: np.ndarray, fields: Sequence[str],
            generations: np.ndarray | None = None) -> dict[str, Column]:
        slots = np.asarray(slots, dtype=np.int64)
        with self._lock:
            self._check_open()
            part = self._parts.get(partition)
            if generations is not None:
                if part is None:
                    if len(slots):
                        raise stale_rows(partition, slots)
                else:
                    part.gen.check(partition, slots, generations)
            out: dict[str, Column] = {}
            for name in fields:
                store = part.fields.get(name) if part is not None else None
                if store is None:
                    raise KeyConflictError(
                        f"field {name!r} has no stored values in partition {partition!r}"
                    )
                try:
                    out[name] = store.get(slots)
                except KeyConflictError as exc:
                    raise KeyConflictError(
                        f"field {name!r} of partition {partition!r}: {exc}") from None
            return out

    def free(self, partition: str, slots: np.ndarray) -> None:
        slots = np.asarray(slots, dtype=np.int64)
        with self._lock:
            part = self._parts.get(partition)
            if part is None or self._closed:
                return
            part.gen.free(slots)
            for store in part.fields.values():
                store.free(slots)
            slots = slots[slots < part.live.shape[0]]
            part.live[slots] = False
            if not part.live.any():
                part.gen.retire()
                del self._parts[partition]  # every row gone: return all slab memory

    def drop(self, partition: str) -> None:
        with self._lock:
            part = self._parts.pop(partition, None)
            if part is not None:
                part.gen.retire()

    def nbytes(self) -> int:
        with self._lock:
            return sum(s.nbytes() for p in self._parts.values() for s in p.fields.values())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for part in self._parts.values():
                part.gen.retire()
            self._parts.clear()
