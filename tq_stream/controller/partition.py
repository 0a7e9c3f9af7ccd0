"""PartitionMeta: the rows of one partition, their keys, placement and readiness.

Row indexes are reused after a row is freed; ``generation[i]`` counts reuses so
a stale handle can be told from the row now in that place. ``created[i]`` numbers
rows in creation order (oldest first), which writes of later fields never change. Each row lives in
one storage unit (``unit[i]``) at a slot of that unit (``slot[i]``); slots are
allocated per unit, lowest freed first, so slabs stay compact.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tq_stream import fieldpath
from tq_stream.controller.lost import LostKeys
from tq_stream.controller.shared_entries import SharedTable
from tq_stream.controller.tags import TagTable
from tq_stream.errors import SchemaError, StateError
from tq_stream.schemas import FieldSchema, coercible

_MIN = 64


def parse_schemas(schemas: Mapping[str, Any]) -> dict[str, FieldSchema]:
    """``FieldSchema.from_dict`` of each field's schema dict (it shares one object per
    distinct schema: every put sends the schemas of its fields, nearly always ones seen
    before, and building a frozen dataclass is a large share of a one-row put)."""
    return {name: FieldSchema.from_dict(d) for name, d in schemas.items()}


def _grow(arr: np.ndarray, n: int, fill: Any = 0) -> np.ndarray:
    return np.concatenate([arr, np.full(n - arr.shape[0], fill, dtype=arr.dtype)])


class _SlotPool:
    """Slots of one storage unit: the lowest freed slot is reused first."""

    def __init__(self) -> None:
        self.free: list[int] = []
        self.next = 0

    def take(self, n: int) -> np.ndarray:
        out = [heapq.heappop(self.free) for _ in range(min(n, len(self.free)))]
        rest = n - len(out)
        out.extend(range(self.next, self.next + rest))
        self.next += rest
        return np.asarray(out, dtype=np.int64)

    def give(self, slots: np.ndarray) -> None:
        for s in slots.tolist():
            heapq.heappush(self.free, s)
        while self.free and len(self.free) == self.next:  # all free: start over
            self.free.clear()
            self.next = 0


class PartitionMeta:
    """Columnar metadata of one partition.

    Invariants: ``used[i]`` iff row i holds a live key; ``key_index[keys[i]] == i``
    for used rows; ``ready[f][i]`` only for used rows; ``live == used.sum()``.
    ``spare[i]`` (never with ``used[i]``): row i has a unit and slot but no key yet;
    a writer holds it to store a later put's bytes before naming the keys (``bind``).
    """

    def __init__(self, name: str, capacity: int | None, n_units: int) -> None:
        self.name = name
        self.capacity = capacity
        self.closed = False
        # tasks that read every row (None: not declared; rows stay until cleared)
        self.consumers: tuple[str, ...] | None = None
        # created with a memory_budget: units hear which fields may spill (spill_hints.py)
        self.spills = False
        # set_version (version, at_step) of tasks not registered yet
        self.versions: dict[str, tuple[int, int | None]] = {}
        self.admitted = 0  # rows producers started through Writer.reserve
        self.lost = LostKeys(name)  # keys of rows lost with their storage unit
        self.schemas: dict[str, FieldSchema] = {}
        self.key_index: dict[str, int] = {}
        self.keys = np.empty(_MIN, dtype=object)
        self.used = np.zeros(_MIN, dtype=bool)
        self.spare = np.zeros(_MIN, dtype=bool)
        self.unit = np.zeros(_MIN, dtype=np.int32)
        self.slot = np.zeros(_MIN, dtype=np.int64)
        self.generation = np.zeros(_MIN, dtype=np.int64)
        self.write_time = np.zeros(_MIN, dtype=np.float64)
        self.created = np.zeros(_MIN, dtype=np.int64)
        self.ready: dict[str, np.ndarray] = {}
        self.tags = TagTable(_MIN)
        self.shared = SharedTable(_MIN)  # entries put once, named by rows (shared_entries.py)
        self.live = 0
        self._free_rows: list[int] = []
        self._next_row = 0
        self.next_created = 0
        self._pools = [_SlotPool() for _ in range(n_units)]
        # Created by a put and named by nothing else since (create_partition,
        # close_partition, register_task clear it): a failed first put removes it.
        self.by_put = False

    def unused(self) -> bool:
        """Made by a put that never committed: no rows, spares, fields or settings, and no
        slot held or still being freed in storage (every pool started over), so a
        partition made again under this name cannot get a slot a late free still hits."""
        return self.by_put and self.live == 0 and not self.spare.any() and not self.schemas \
            and self.admitted == 0 and all(p.next == 0 for p in self._pools)

    @property
    def size(self) -> int:
        return self.used.shape[0]

    def slot_end(self, unit: int) -> int:
        """Every slot of ``unit`` that rows of this partition use is below this."""
        return self._pools[unit].next

    def grow_to(self, need: int) -> None:
        """Room for rows below ``need`` (every column doubled until it fits)."""
        n = self.size
        while n < need:
            n *= 2
        if n == self.size:
            return
        self.keys = _grow(self.keys, n, None)
        self.used = _grow(self.used, n, False)
        self.spare = _grow(self.spare, n, False)
        self.unit = _grow(self.unit, n)
        self.slot = _grow(self.slot, n)
        self.generation = _grow(self.generation, n)
        self.write_time = _grow(self.write_time, n)
        self.created = _grow(self.created, n)
        self.ready = {f: _grow(r, n, False) for f, r in self.ready.items()}
        self.tags.grow(n)
        self.shared.grow(n)

    def free_state(self, spare: np.ndarray) -> dict[str, Any]:
        """The free rows and slots as plain data (a checkpoint), counting rows ``spare``
        as free: ``next_row``, ``free_rows`` and per unit ``pools`` (``next``, ``free``)."""
        return {
            "next_row": self._next_row, "free_rows": list(self._free_rows) + spare.tolist(),
            "pools": [{"next": p.next,
                       "free": sorted(p.free + self.slot[spare[self.unit[spare] == u]].tolist())}
                      for u, p in enumerate(self._pools)],
        }

    def load_free_state(self, state: Mapping[str, Any]) -> None:
        """The free rows and slots of ``free_state`` (a restore)."""
        self._next_row, self._free_rows = int(state["next_row"]), list(state["free_rows"])
        for pool, ps in zip(self._pools, state["pools"], strict=True):
            pool.next, pool.free = int(ps["next"]), sorted(ps["free"])

    def check_schemas(self, schemas: dict[str, FieldSchema], coerce: bool = False) -> None:
        """Raise SchemaError if a field's data disagrees with its fixed schema
        (``coerce``: unless it can be converted to it, see ``columns.coerce``)."""
        fresh = [name for name in schemas if name not in self.schemas]
        if fresh and any(fieldpath.SEP in name for name in (*fresh, *self.schemas)):
            fieldpath.check_paths(fresh, self.schemas)  # "obs" vs "obs.image"
        for name, schema in schemas.items():
            fixed = self.schemas.get(name)
            if fixed is not None and fixed != schema and not (coerce and
                                                              coercible(fixed, schema)):
                raise SchemaError(
                    f"field {name!r} of partition {self.name!r} must be "
                    f"{fixed.describe()} (fixed by its first write), got {schema.describe()}"
                )

    def fix_schemas(self, schemas: dict[str, FieldSchema]) -> None:
        self.check_schemas(schemas)
        for name, schema in schemas.items():
            if name not in self.schemas:
                self.schemas[name] = schema
                self.ready[name] = np.zeros(self.size, dtype=bool)

    def check_expected(self, keys: list[str], idx: np.ndarray,
                       expect: np.ndarray | Sequence[int]) -> None:
        """Rows ``idx`` of ``keys`` still have generations ``expect`` (a write through a
        BatchMeta): StateError if some were freed meanwhile."""
        gen = np.asarray(expect, dtype=np.int64)
        ok = idx >= 0
        ok[ok] = self.generation[idx[ok]] == gen[ok]
        if not ok.all():
            gone = [k for k, g in zip(keys, ok.tolist(), strict=True) if not g][:5]
            raise StateError(
                f"rows of partition {self.name!r} must still exist to be written through "
                f"their meta, but {int((~ok).sum())} were freed meanwhile (e.g. {gone})"
            )

    def check_generation(self, index: np.ndarray, gen: np.ndarray | Sequence[int]) -> None:
        """Rows ``index`` are still in use with generations ``gen`` (a commit)."""
        gen = np.asarray(gen, dtype=np.int64)
        ok = self.used[index] & (self.generation[index] == gen)
        if not ok.all():
            bad = self.keys[index[~ok]].tolist()[:5]
            raise StateError(
                f"rows of partition {self.name!r} must still exist to be written, "
                f"but {int((~ok).sum())} were cleared meanwhile (e.g. {bad})"
            )

    def lookup(self, keys: list[str]) -> np.ndarray:
        """Row index of each key, -1 where the key is absent."""
        get = self.key_index.get
        return np.fromiter((get(k, -1) for k in keys), dtype=np.int64, count=len(keys))

    def allocate(self, keys: list[str], units: np.ndarray, now: float) -> np.ndarray:
        """Create rows for new ``keys``, each in storage unit ``units[i]``, written
        (so far) at ``now`` (the controller's clock)."""
        idx = self._place(units)
        self._bind(keys, idx, now)
        return idx

    def allocate_spares(self, units: np.ndarray) -> np.ndarray:
        """Spare rows (placed, no key yet), each in storage unit ``units[i]``."""
        idx = self._place(units)
        self.spare[idx] = True
        return idx

    def bind(self, keys: list[str], idx: np.ndarray, now: float) -> None:
        """Give spare rows ``idx`` the new ``keys``: they become rows like ``allocate``'s."""
        self.spare[idx] = False
        self._bind(keys, idx, now)

    def bind_row(self, key: str, i: int, now: float) -> None:
        """``bind`` of one row with int indexing."""
        self.spare[i] = False
        self.used[i] = True
        self.write_time[i] = now
        self.created[i] = self.next_created
        self.next_created += 1
        self.keys[i] = key
        self.key_index[key] = i
        self.live += 1

    def release_spares(self, idx: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """Take back spare rows (stale handles no longer match); returns ``(unit, slots)``
        pairs to free in storage, reusable after ``give_slots`` (as for ``release``)."""
        idx = idx[self.spare[idx]]
        freed = self._slots_by_unit(idx)
        self.spare[idx] = False
        self.generation[idx] += 1
        self._free_rows.extend(idx.tolist())
        return freed

    def _slots_by_unit(self, idx: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """``(unit, slots)`` of rows ``idx``, one pair per unit."""
        if len(idx) == 1:  # one row (a one-row ack): no np.unique
            return [(int(self.unit[idx[0]]), self.slot[idx])]
        units = self.unit[idx]
        return [(u, self.slot[idx[units == u]]) for u in np.unique(units).tolist()]

    def _place(self, units: np.ndarray) -> np.ndarray:
        n = len(units)
        rows = [self._free_rows.pop() for _ in range(min(n, len(self._free_rows)))]
        extra = n - len(rows)
        rows.extend(range(self._next_row, self._next_row + extra))
        self._next_row += extra
        idx = np.asarray(rows, dtype=np.int64)
        self.grow_to(self._next_row)
        for u in np.unique(units).tolist():
            mask = units == u
            self.slot[idx[mask]] = self._pools[u].take(int(mask.sum()))
        self.unit[idx] = units
        return idx

    def _bind(self, keys: list[str], idx: np.ndarray, now: float) -> None:
        n = len(keys)
        self.used[idx] = True
        self.write_time[idx] = now
        self.created[idx] = np.arange(self.next_created, self.next_created + n)
        self.next_created += n
        for k, i in zip(keys, idx.tolist(), strict=True):
            self.keys[i] = k  # one at a time: a list into an object array costs more
            self.key_index[k] = i
        self.live += n

    def release(self, idx: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """Free rows ``idx``; returns ``(unit, slots)`` pairs to free in storage.

        The slots are reusable only after ``give_slots``, once storage freed them,
        so a late free can never hit a slot that a new row already uses.
        """
        idx = self.shared.release(self, idx[self.used[idx]])  # + entries no row names
        freed = self._slots_by_unit(idx)
        for k in self.keys[idx].tolist():
            del self.key_index[k]
        self.used[idx] = False
        self.keys[idx] = None
        self.generation[idx] += 1
        for r in self.ready.values():
            r[idx] = False
        self.tags.clear(idx)
        self._free_rows.extend(idx.tolist())
        self.live -= len(idx)
        return freed

    def row_mask(self, n: int) -> np.ndarray:
        """``used[:n]`` without the shared entries (rows a task may be handed)."""
        return self.used[:n] & ~self.shared.entry[:n] if self.shared.count else self.used[:n]

    def oldest_first(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` sorted by creation."""
        return rows[np.argsort(self.created[rows], kind="stable")]

    def give_slots(self, unit: int, slots: np.ndarray) -> None:
        self._pools[unit].give(slots)

    def ready_for(self, fields: tuple[str, ...], idx: np.ndarray,
                  tags: tuple[str, ...] = ()) -> np.ndarray:
        """Mask over ``idx``: rows with every field in ``fields`` written (every field
        under a parent path ``"obs"``) and every tag in ``tags`` set; no shared entry."""
        mask: np.ndarray = self.used[idx] & ~self.shared.entry[idx] if self.shared.count \
            else self.used[idx]
        for f in fields:
            for r in self._ready_masks(f):
                if r is None:
                    return np.zeros(len(idx), dtype=bool)
                mask &= r[idx]
        for t in tags:
            present = self.tags.present.get(t)
            if present is None:
                return np.zeros(len(idx), dtype=bool)
            mask &= present[idx]
        return mask

    def row_ready(self, fields: tuple[str, ...], i: int, tags: tuple[str, ...] = ()) -> bool:
        """``ready_for`` of one row."""
        if not self.used[i] or (self.shared.count and self.shared.entry[i]):
            return False
        for f in fields:
            for r in self._ready_masks(f):
                if r is None or not r[i]:
                    return False
        for t in tags:
            present = self.tags.present.get(t)
            if present is None or not present[i]:
                return False
        return True

    def _ready_masks(self, name: str) -> list[np.ndarray | None]:
        """The written-masks ``name`` needs: its own, or those of every field under it
        (a parent path, see ``fieldpath.resolve``); ``[None]`` if it names no field."""
        r = self.ready.get(name)
        if r is not None:
            return [r]
        return [self.ready[f] for f in fieldpath.under(name, self.ready)] or [None]

    def fields_of(self, i: int) -> list[str]:
        return [f for f, r in self.ready.items() if r[i]]
