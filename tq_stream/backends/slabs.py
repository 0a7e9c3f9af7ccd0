"""Column stores: where one field's rows live inside a storage unit.

- ``DenseSlab``: a preallocated ``[capacity, *shape]`` tensor; a batch read is
  one ``index_select`` into one output buffer.
- ``RaggedArena``: values appended to an arena tensor, a (start, length) per
  slot; freed space is reclaimed by compaction once it exceeds the live part.
- ``MultiRaggedArena``: rows ragged in several dims; their elements in a
  ``RaggedArena`` of one dim, their shapes per slot.
- ``ObjectSlots`` (``object_slots.py``): a numpy object array of plain Python values.

A dense slab or a plain store grows by doubling; an arena grows by small steps
(``alloc.stepped``) when its allocator grows it without a copy (``GrowsInPlace``, or
``Extends``: the heap), so it holds little more than its values. Every store can report
its bytes, and knows which slots hold a value: reading a slot that was never written (or
was freed) raises KeyConflictError instead of returning stale bytes. An ``alloc`` callable
(``alloc(shape, dtype) -> Tensor``, ``alloc.py``) decides where slab memory comes from,
so a shared-memory unit reuses the same stores. ``Generations`` (``generations.py``)
holds the occupancy token of every slot of a partition (see
``tq_stream.backends.base.occupancy``).
"""

from __future__ import annotations

import numpy as np
import torch

from tq_stream.backends.alloc import (
    MIN_ROWS,
    Alloc,
    Extends,
    GrowsInPlace,
    check_written,
    fence,
    grown,
    heap_alloc,
    stepped,
)
from tq_stream.backends.generations import UNSET as UNSET  # re-exported: same_host reads it
from tq_stream.backends.object_slots import ObjectSlots
from tq_stream.buffers import gather_rows, indexable, scatter_rows
from tq_stream.columns import Column, Ragged, dtype_from_name, schema_of
from tq_stream.multiragged import MultiRagged

__all__ = ["UNSET", "DenseSlab", "MultiRaggedArena", "ObjectSlots", "RaggedArena", "Store",
           "fence", "store_for"]


class DenseSlab:
    """Fixed-shape rows in one tensor ``[capacity, *shape]``, and a bool per slot
    (``flags``, same capacity) telling which slots hold a value.

    Both come from allocators (``flag_alloc`` defaults to ``alloc``), so in a
    shared-memory unit a same-host writer can set a new row's flag itself
    (``tq_stream.connection.same_host``). They grow together, and a fresh flag array
    is all False, even in recycled memory.
    """

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...], alloc: Alloc = heap_alloc,
                 flag_alloc: Alloc | None = None):
        self.dtype, self.shape, self._alloc = dtype, shape, alloc
        self._flag_alloc = flag_alloc or alloc
        self.data = alloc((MIN_ROWS, *shape), dtype)  # may be larger (a reused segment)
        self.flags = self._new_flags(self.data.shape[0])
        self.written = self.flags.numpy()

    def _new_flags(self, n: int) -> torch.Tensor:
        """``n`` False flags; an allocator may hand out more (a reused segment): the
        flags are cut to the slab's capacity, so both always hold the same rows."""
        return self._flag_alloc((n,), torch.bool)[:n].zero_()

    def ensure(self, max_slot: int) -> None:
        cap = self.data.shape[0]
        if max_slot < cap:
            return
        n = grown(cap, max_slot + 1)
        new = self._alloc((n, *self.shape), self.dtype)
        flags = self._new_flags(new.shape[0])
        # A new segment bumped the unit's layout epoch: past this fence a same-host
        # writer still copying into the old slab either sees the bump and writes
        # again through the unit, or its bytes and flags are in the copies below.
        fence()
        new[:cap].copy_(self.data)
        flags[:cap].copy_(self.flags)
        self.data, self.flags, self.written = new, flags, flags.numpy()

    def put(self, slots: np.ndarray, values: torch.Tensor) -> None:
        self.ensure(int(slots.max()))
        scatter_rows(self.data, slots, values)
        self.written[slots] = True

    def get(self, slots: np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
        check_written(self.written, slots)
        return gather_rows(self.data, slots, out)

    def free(self, slots: np.ndarray) -> None:
        slots = slots[slots < self.written.shape[0]]
        self.written[slots] = False  # the bytes stay until the slot is written again

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class RaggedArena:
    """Variable-length rows appended to an arena, addressed by (start, length) per slot.

    Invariant: ``live`` is the sum of lengths of written slots; the arena part
    below ``end`` that is not live is garbage, reclaimed by ``_compact`` once it
    exceeds the live part (so the arena holds at most ~2x the live values).
    """

    def __init__(self, dtype: torch.dtype, tail: tuple[int, ...], alloc: Alloc = heap_alloc):
        self.dtype, self.tail, self._alloc = dtype, tail, alloc
        self.values = alloc((MIN_ROWS, *tail), dtype)
        self.start = np.zeros(MIN_ROWS, dtype=np.int64)
        self.length = np.full(MIN_ROWS, -1, dtype=np.int64)  # -1: slot empty
        self.end = 0
        self.live = 0

    def _ensure_slots(self, max_slot: int) -> None:
        cap = self.start.shape[0]
        if max_slot >= cap:
            n = grown(cap, max_slot + 1)
            self.start = np.concatenate([self.start, np.zeros(n - cap, np.int64)])
            self.length = np.concatenate([self.length, np.full(n - cap, -1, np.int64)])

    def _compacts(self, extra: int) -> bool:
        """True if appending ``extra`` values compacts the arena first."""
        return self.end - self.live > max(self.live, 1 << 16) and \
            self.end + extra > self.values.shape[0]

    def _ensure_values(self, extra: int) -> None:
        if self._compacts(extra):
            self._compact()
        cap, need = self.values.shape[0], self.end + extra
        if need > cap:
            if isinstance(self._alloc, GrowsInPlace):  # no byte copied, none moves
                self.values = self._alloc.grow(self.values, stepped(cap, need))
                return
            if isinstance(self._alloc, Extends):  # in place, or (rarely) by a copy
                self.values = self._alloc.extend(self.values, stepped(cap, need), self.end)
                return
            new = self._alloc((grown(cap, need), *self.tail), self.dtype)
            new[: self.end].copy_(self.values[: self.end])
            self.values = new

    def _compact(self) -> None:
        # Into new memory, never in place: a same-host reader may hold views of rows
        # (``MultiRaggedArena.locate``), whose bytes must not change under it.
        slots = np.flatnonzero(self.length >= 0)
        gathered = self._gather(slots)
        lengths = self.length[slots]
        self.values = self._alloc(tuple(self.values.shape), self.dtype)
        self.values[: gathered.shape[0]].copy_(gathered)
        self.start[slots] = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(slots) else 0
        self.end = int(gathered.shape[0])

    def _gather(self, slots: np.ndarray) -> torch.Tensor:
        lengths = self.length[slots]
        total = int(lengths.sum())
        if total == 0:
            return self.values[:0].clone()
        starts = self.start[slots]
        if (starts[1:] == starts[:-1] + lengths[:-1]).all():  # rows put together: one span
            lo = int(starts[0])
            return self.values[lo : lo + total].clone()
        offs = np.cumsum(lengths) - lengths
        idx = np.repeat(self.start[slots] - offs, lengths) + np.arange(total, dtype=np.int64)
        return indexable(self.values).index_select(0, torch.from_numpy(idx)).view(self.dtype)

    def moves_for(self, extra: int) -> bool:
        """True if appending ``extra`` values moves the arena to new memory (it compacts,
        or grows by a copy): a same-host writer must not be copying into it then."""
        return self._compacts(extra) or (self.end + extra > self.values.shape[0] and
                                         not isinstance(self._alloc, GrowsInPlace))

    def reserve(self, slots: np.ndarray, offsets: np.ndarray, total: int) -> int:
        """Place rows as ``put`` does, without their values: row i of ``slots`` is
        ``offsets[i]:offsets[i+1]`` (from ``offsets[0]``) of ``total`` values appended
        at the returned index of ``values``, where the caller copies them (a same-host
        direct write, ``tq_stream.backends.arena_writes``)."""
        self._ensure_slots(int(slots.max()))
        old = self.length[slots]
        self.live -= int(old[old > 0].sum())
        self.length[slots] = -1
        self._ensure_values(total)
        at = self.end
        lengths = offsets[1:] - offsets[:-1]
        self.start[slots] = at + (offsets[:-1] - offsets[0])
        self.length[slots] = lengths
        self.end += total
        self.live += int(lengths.sum())
        return at

    def put(self, slots: np.ndarray, values: Ragged) -> None:
        vals = values.values.to(self.dtype)
        at = self.reserve(slots, values.offsets.numpy(), int(vals.shape[0]))
        self.values[at : at + vals.shape[0]].copy_(vals)

    def get(self, slots: np.ndarray) -> Ragged:
        check_written(self.length, slots)
        lengths = self.length[slots]
        offsets = np.zeros(len(slots) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return Ragged(self._gather(slots), torch.from_numpy(offsets))

    def free(self, slots: np.ndarray) -> None:
        slots = slots[slots < self.length.shape[0]]
        old = self.length[slots]
        self.live -= int(old[old > 0].sum())
        self.length[slots] = -1

    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size() + self.start.nbytes * 2


class MultiRaggedArena:
    """Rows ragged in several dims (``MultiRagged``): each row's elements, flat, in a
    ``RaggedArena`` of one dim (a start and length per slot), its shape in
    ``shapes[slot]``.

    Invariant: ``shapes[s]`` is the shape of the row in slot s while s holds one.
    """

    def __init__(self, dtype: torch.dtype, dims: tuple[int, ...], alloc: Alloc = heap_alloc):
        self.elems = RaggedArena(dtype, (), alloc)
        self.dims = dims
        self.shapes = np.zeros((MIN_ROWS, len(dims)), dtype=np.int64)

    @property
    def values(self) -> torch.Tensor:
        """The arena's memory (a shared-memory unit keeps its segment)."""
        return self.elems.values

    def put(self, slots: np.ndarray, values: MultiRagged) -> None:
        self.elems.put(slots, Ragged(values.values, values.offsets))
        self._set_shapes(slots, values.shapes.numpy())

    def moves_for(self, extra: int) -> bool:
        """``RaggedArena.moves_for`` of the elements."""
        return self.elems.moves_for(extra)

    def reserve(self, slots: np.ndarray, shapes: np.ndarray) -> int:
        """Place rows of ``shapes`` (int64 ``[n, ndim]``) as ``put`` does, without their
        elements: the caller copies them, row after row, to the returned index of
        ``values`` (``RaggedArena.reserve``)."""
        lengths = shapes.prod(1) if self.dims else np.ones(len(slots), np.int64)
        offsets = np.zeros(len(slots) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        at = self.elems.reserve(slots, offsets, int(offsets[-1]))
        self._set_shapes(slots, shapes)
        return at

    def _set_shapes(self, slots: np.ndarray, shapes: np.ndarray) -> None:
        cap, need = self.shapes.shape[0], self.elems.start.shape[0]
        if need > cap:
            grown = np.zeros((need, len(self.dims)), dtype=np.int64)
            grown[:cap] = self.shapes
            self.shapes = grown
        self.shapes[slots] = shapes

    def get(self, slots: np.ndarray) -> MultiRagged:
        flat = self.elems.get(slots)
        return MultiRagged(flat.values, torch.from_numpy(self.shapes[slots]), self.dims)

    def locate(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where the rows of ``slots`` lie in ``values``: their first elements and
        shapes (KeyConflictError for a slot that holds no row). Rows are appended and
        never moved in place, so a row's bytes stay where they are while it lives."""
        check_written(self.elems.length, slots)
        return self.elems.start[slots], self.shapes[slots]

    def free(self, slots: np.ndarray) -> None:
        self.elems.free(slots)

    def nbytes(self) -> int:
        return self.elems.nbytes() + self.shapes.nbytes


Store = DenseSlab | RaggedArena | MultiRaggedArena | ObjectSlots


def store_for(column: Column, alloc: Alloc = heap_alloc, flag_alloc: Alloc | None = None) -> Store:
    """A new, empty store fitting the kind of ``column``."""
    schema = schema_of(column)
    if schema.kind == "dense":
        return DenseSlab(dtype_from_name(schema.dtype), schema.shape, alloc, flag_alloc)
    if schema.kind == "ragged":
        return RaggedArena(dtype_from_name(schema.dtype), schema.shape, alloc)
    if schema.kind == "multiragged":
        return MultiRaggedArena(dtype_from_name(schema.dtype), schema.shape, alloc)
    return ObjectSlots()
