"""MemoryUnit: a storage unit in this process's heap (embedded mode, unit tests)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from tq_stream.backends import unit_files
from tq_stream.backends.alloc import Alloc, heap_alloc
from tq_stream.backends.base import StorageUnit
from tq_stream.backends.generations import stale_rows
from tq_stream.backends.partition_store import PartitionStore
from tq_stream.backends.row_bytes import held, row_bytes, written_slots
from tq_stream.backends.slabs import Store, store_for
from tq_stream.backends.slots import check_unheld
from tq_stream.backends.spill import (
    Spill,
    bounded,
    check_budget,
    check_cold,
    least_bytes,
    merged,
)
from tq_stream.columns import Column, take
from tq_stream.errors import ClosedError, ConfigError, KeyConflictError


def _rows_in(slots: np.ndarray, column: Column,
             keep: np.ndarray) -> tuple[np.ndarray, Column]:
    """The rows of ``column`` (one per slot of ``slots``) whose slot is in ``keep``."""
    mask = np.isin(slots, keep)
    if mask.all():
        return slots, column
    return slots[mask], take(column, torch.from_numpy(np.flatnonzero(mask)))


class MemoryUnit(StorageUnit):
    """Column slabs on the heap, one lock per unit.

    Example:
        >>> unit = MemoryUnit()
        >>> unit.put("train", np.array([0, 1]), {"x": torch.ones(2, 3)})
        >>> unit.get("train", np.array([1]), ["x"])["x"].shape
        torch.Size([1, 3])
    """

    def __init__(self, alloc: Alloc = heap_alloc, spill_dir: str | None = None) -> None:
        self._alloc = alloc
        self._spill = Spill(spill_dir)  # budgets, cold fields, rows on disk (spill.py)
        self._parts: dict[str, PartitionStore] = {}
        self._lock = threading.RLock()  # re-entered by ShmUnit's direct-write checks
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("storage unit is closed")

    def _alloc_for(self, partition: str, field: str, part: str = "") -> Alloc:
        """The allocator of one new store (``field`` "" for the partition's slot tokens;
        ``part`` "flags" for a slab's written flags, "live" for the partition's): a
        field's values are allocated within the partition's memory budget, never for a
        cold field (``spill.py``)."""
        raw = self._raw_alloc(partition, field, part)
        if field == "" or part:
            return raw
        return bounded(raw, functools.partial(self._check_room, partition, field))

    def _raw_alloc(self, partition: str, field: str, part: str = "") -> Alloc:
        """Where a store's memory comes from (``ShmUnit``: shared-memory segments)."""
        return self._alloc

    def _check_put(self, partition: str, need: Mapping[str, int], rows: int) -> None:
        """Refuse a put (lock held) to a closed unit, or one of ``rows`` rows whose fields
        not cold need ``need`` bytes in memory by themselves, past the budget
        (``Spill.check_fits``)."""
        self._check_open()
        self._spill.check_fits(partition, sum(
            n for f, n in need.items() if not self._spill.is_cold(partition, f)), rows)

    def _has_room(self, partition: str, need: int) -> bool:
        """True if ``need`` more bytes of field values fit ``partition``'s budget beside
        its stores (lock held)."""
        part = self._parts.get(partition)
        held = sum(s.nbytes() for s in part.fields.values()) if part is not None else 0
        return self._spill.fits(partition, held, need)

    def _check_room(self, partition: str, field: str, need: int) -> None:
        """Refuse an allocation of ``need`` bytes for ``field`` (lock held) that is cold
        or would take ``partition`` past its memory budget."""
        if self._spill.is_cold(partition, field):
            raise ConfigError(f"field {field!r} of partition {partition!r} is cold: it is "
                              f"kept on disk and written through put, never in memory")
        part = self._parts.get(partition)
        stores = list(part.fields.values()) if part is not None else []
        self._spill.check_room(partition, sum(s.nbytes() for s in stores), need, lambda: sum(
            int(row_bytes(s, written_slots(s)).sum()) for s in stores))

    def set_memory(self, partition: str, memory_budget: int | None = None,
                   cold: Sequence[str] = ()) -> None:
        budget, names = check_budget(memory_budget), check_cold(cold)
        with self._lock:
            self._check_open()
            self._spill.set(partition, budget, names)
            part = self._parts.get(partition)
            if part is not None:  # rows already in memory go to disk, then their store
                self._to_disk(partition, part, {f: written_slots(s) for f, s in
                                                part.fields.items() if f in names})

    def may_spill(self, partition: str, slots: np.ndarray, fields: Sequence[str]) -> None:
        """Move the rows of ``slots`` of ``fields`` to disk if ``partition`` has a memory
        budget (without one nothing is gained); a store left without rows in memory goes."""
        slots = np.asarray(slots, dtype=np.int64)
        with self._lock:
            part = self._parts.get(partition)
            if part is None or partition not in self._spill.budgets or self._closed:
                return
            self._quiesce(partition, slots)  # (ShmUnit) no direct write to them is open
            self._to_disk(partition, part, {f: slots[held(part.fields[f], slots)]
                                            for f in fields if f in part.fields})

    def _to_disk(self, partition: str, part: PartitionStore,
                 rows: Mapping[str, np.ndarray]) -> None:
        """Move ``rows[field]`` of each field to disk (lock held); a store left without a
        row goes, unless a same-host write to the partition is open (a later call)."""
        emptied = []
        for f, slots in rows.items():
            store = part.fields[f]
            if len(slots):
                self._spill.column(partition, f).put(slots, store.get(slots))
                store.free(slots)
            if not len(written_slots(store)):
                emptied.append(f)
        if emptied and not self._writes_open(partition):
            self._stores_may_go()
            for f in emptied:
                del part.fields[f]
            self._stores_went()

    def _writes_open(self, partition: str) -> bool:
        """True while a same-host write into ``partition``'s stores is open (ShmUnit)."""
        return False

    def memory_settings(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return self._spill.settings()

    def _stores_went(self) -> None:  # noqa: B027 - a hook for ShmUnit
        """Called with the lock held after stores of a partition that holds rows went."""

    def _new_partition(self, partition: str) -> PartitionStore:
        part = self._parts[partition] = PartitionStore(
            self._alloc_for(partition, ""), self._alloc_for(partition, "", "live"))
        return part

    def _new_store(self, partition: str, name: str, column: Column) -> Store:
        return store_for(column, self._alloc_for(partition, name),
                         self._alloc_for(partition, name, "flags"))

    def _stores_may_go(self) -> None:  # noqa: B027 - a hook for ShmUnit
        """Called before the stores of a partition may be dropped."""

    def put(self, partition: str, slots: np.ndarray, columns: Mapping[str, Column],
            generations: np.ndarray | None = None) -> None:
        self._put(partition, slots, columns, generations)

    def put_spilled(self, partition: str, slots: np.ndarray, columns: Mapping[str, Column],
                    generations: np.ndarray | None = None) -> None:
        self._put(partition, slots, columns, generations, to_disk=True)

    def _put(self, partition: str, slots: np.ndarray, columns: Mapping[str, Column],
             generations: np.ndarray | None = None, to_disk: bool = False) -> None:
        slots = np.asarray(slots, dtype=np.int64)
        if len(slots) == 0:
            return
        with self._lock:
            self._check_put(partition, {} if to_disk else {
                n: least_bytes(c) for n, c in columns.items()}, len(slots))
            part = self._parts.get(partition)
            if part is not None:  # a put never replaces another row
                check_unheld(partition, slots, part.gen.data.numpy(), generations)
            else:
                part = self._new_partition(partition)
            part.gen.begin(slots)  # same-host readers of these slots now retry
            try:
                for name, column in columns.items():
                    if to_disk or self._spill.is_cold(partition, name):
                        self._spill.column(partition, name).put(slots, column)
                        continue
                    store = part.fields.get(name)
                    if store is None:
                        store = part.fields[name] = self._new_store(partition, name, column)
                    store.put(slots, column)
                    disk = self._spill.on_disk(partition, name)
                    if disk is not None:  # rows spilled before: this put overwrites them
                        disk.free(slots)
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
            return {name: self._read(partition, part, name, slots) for name in fields}

    def _read(self, partition: str, part: PartitionStore | None, name: str,
              slots: np.ndarray) -> Column:
        """Rows ``slots`` of field ``name``, from memory or disk (lock held)."""
        store = part.fields.get(name) if part is not None else None
        disk = self._spill.on_disk(partition, name)
        if store is None and disk is None:
            raise KeyConflictError(
                f"field {name!r} has no stored values in partition {partition!r}")
        try:
            if disk is None:
                assert store is not None
                return store.get(slots)
            if store is None:
                return disk.get(slots)
            # in memory where the store holds a row (a same-host direct write after a
            # spill is newer), else on disk
            on_disk = disk.holds(slots) & ~held(store, slots)
            return merged(slots, on_disk, store.get, disk.get)
        except KeyConflictError as exc:
            raise KeyConflictError(f"field {name!r} of partition {partition!r}: {exc}") from None

    def _quiesce(self, partition: str, slots: np.ndarray) -> None:  # noqa: B027 - a hook
        """Called with the lock held before a checkpoint copies ``slots`` (ShmUnit waits
        for open direct writes to them)."""

    def collect(self, request: Mapping[str, Any], chunk_bytes: int) -> Iterator[
            tuple[str, np.ndarray, np.ndarray, dict[str, tuple[np.ndarray, Column, np.ndarray]]]]:
        """Rows of a checkpoint request whose slots hold their tokens before and after
        the copy (a same-host writer may write new rows without the lock: seqlock), about
        ``chunk_bytes`` at a time, each chunk copied under the lock when asked for."""
        for name, spec in request["partitions"].items():
            # Highest slots first: a restore's first put sizes each slab once (a slab
            # grown row by row would hold its old and new memory at each doubling).
            order = np.argsort(-np.asarray(spec["slots"], dtype=np.int64), kind="stable")
            slots = np.asarray(spec["slots"], dtype=np.int64)[order]
            tokens = np.asarray(spec["tokens"], dtype=np.int64)[order]
            masks = {f: np.asarray(m, dtype=bool)[order] for f, m in spec["fields"].items()}
            for rows in self._chunks(name, slots, masks, chunk_bytes):
                chunk = self._copy(name, slots[rows], tokens[rows],
                                   {f: m[rows] for f, m in masks.items()})
                if chunk is not None:
                    yield chunk

    def _chunks(self, partition: str, slots: np.ndarray, masks: Mapping[str, np.ndarray],
                chunk_bytes: int) -> list[slice]:
        """Ranges of ``slots`` holding about ``chunk_bytes`` of the written fields."""
        with self._lock:
            self._check_open()
            part = self._parts.get(partition)
            sizes = np.zeros(len(slots), dtype=np.int64)
            for f, mask in masks.items():
                store = part.fields.get(f) if part is not None else None
                disk = self._spill.on_disk(partition, f)
                if store is not None:
                    sizes += row_bytes(store, slots) * mask
                elif disk is not None:
                    sizes += disk.row_bytes(slots) * mask
        return unit_files.chunk_rows(sizes, chunk_bytes)

    def _copy(self, name: str, slots: np.ndarray, tokens: np.ndarray,
              masks: Mapping[str, np.ndarray]) -> tuple[
                  str, np.ndarray, np.ndarray,
                  dict[str, tuple[np.ndarray, Column, np.ndarray]]] | None:
        """The rows of ``slots`` still holding ``tokens`` (None: the partition is gone)."""
        with self._lock:
            self._check_open()
            self._quiesce(name, slots)
            part = self._parts.get(name)
            if part is None:
                return None
            ok = part.gen.holds(slots, tokens)
            fields = {f: slots[m & ok] for f, m in masks.items()}
            fields = {f: (s, self._read(name, part, f, s)) for f, s in fields.items() if len(s)}
            keep = ok & part.gen.holds(slots, tokens)
            out = {}
            for f, (s, c) in fields.items():
                s, c = _rows_in(s, c, slots[keep])
                disk, store = self._spill.on_disk(name, f), part.fields.get(f)
                on_disk = np.zeros(len(s), dtype=bool) if disk is None else disk.holds(s)
                if store is not None and on_disk.any():
                    on_disk &= ~held(store, s)
                out[f] = (s, c, on_disk)
            return name, slots[keep], tokens[keep], out

    def free(self, partition: str, slots: np.ndarray) -> None:
        slots = np.asarray(slots, dtype=np.int64)
        with self._lock:
            part = self._parts.get(partition)
            if part is None or self._closed:
                return
            part.gen.free(slots)
            for store in part.fields.values():
                store.free(slots)
            self._spill.free(partition, slots)
            slots = slots[slots < part.live.shape[0]]
            part.live[slots] = False
            if not part.live.any():
                self._emptied(partition, part)

    def _emptied(self, partition: str, part: PartitionStore) -> None:
        """Called with the lock held when the last row of ``partition`` was freed: its
        stores go (all slab memory returned; ``ShmUnit`` may keep them for reuse)."""
        self._drop_store(partition, part)

    def _drop_store(self, partition: str, part: PartitionStore) -> bool:
        """Drop the stores of ``partition`` if it holds no row (lock held); False if a
        same-host writer wrote a row into them meanwhile (they stay then)."""
        self._stores_may_go()
        if part.live.any():  # checked after the hook: a same-host writer may have come
            return False
        part.gen.retire()
        del self._parts[partition]
        return True

    def drop(self, partition: str) -> None:
        with self._lock:
            self._stores_may_go()
            part = self._parts.pop(partition, None)
            if part is not None:
                part.gen.retire()
            self._spill.drop(partition)

    def held(self) -> dict[str, dict[str, np.ndarray]]:
        """Every partition's written slots and their tokens (``{"slots", "tokens"}``):
        what a restarted controller reconciles its checkpoint with."""
        with self._lock:
            out = {}
            for name, part in self._parts.items():
                slots = np.flatnonzero(part.live).astype(np.int64)
                tokens = part.gen.data.numpy()
                inside = slots < tokens.shape[0]
                out[name] = {"slots": slots[inside], "tokens": tokens[slots[inside]].copy()}
            return out

    @property
    def stores(self) -> Mapping[str, PartitionStore]:
        """The partitions this unit holds, by name (read them under no promise: a put or
        a drop may change them meanwhile)."""
        return self._parts

    def nbytes(self) -> int:
        """Bytes of the stores of partitions that hold rows (stores an emptied
        partition keeps for reuse are not counted, see ``ShmUnit``)."""
        with self._lock:
            return sum(s.nbytes() for p in self._parts.values() if p.live.any()
                       for s in p.fields.values())

    def stats(self) -> dict[str, Any]:
        with self._lock:
            held = {name: {f: s.nbytes() for f, s in p.fields.items()}
                    for name, p in self._parts.items() if p.live.any()}
            parts = {name: {"rows": int(self._parts[name].live.sum()), "fields": fields,
                            "spilled": self._spill.spilled(name),
                            "budget": self._spill.budgets.get(name)}
                     for name, fields in held.items()}
        return {"nbytes": sum(sum(f.values()) for f in held.values()), "partitions": parts}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for part in self._parts.values():
                part.gen.retire()
            self._parts.clear()
            self._spill.close()
