"""Column stores: where one field's rows live inside a storage unit.

- ``DenseSlab``: a preallocated ``[capacity, *shape]`` tensor; a batch read is
  one ``index_select`` into one output buffer.
- ``RaggedArena``: values appended to an arena tensor, a (start, length) per
  slot; freed space is reclaimed by compaction once it exceeds the live part.
- ``MultiRaggedArena``: rows ragged in several dims; their elements in a
  ``RaggedArena`` of one dim, their shapes per slot.
- ``ObjectSlots``: a numpy object array of plain Python values.

Every store grows by doubling, can report its bytes, and knows which slots hold a
value: reading a slot that was never written (or was freed) raises
KeyConflictError instead of returning stale bytes. An ``alloc`` callable
(``alloc(shape, dtype) -> Tensor``) decides where slab memory comes from, so a
shared-memory unit reuses the same stores. ``Generations`` holds the occupancy
token of every slot of a partition (see ``tq_stream.backends.base.occupancy``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from tq_stream.buffers import gather_rows, indexable, scatter_rows
from tq_stream.columns import SCALARS, Column, Ragged, dtype_from_name, schema_of
from tq_stream.errors import KeyConflictError, StateError
from tq_stream.forksafe import ForkSafeLock
from tq_stream.multiragged import MultiRagged

Alloc = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
_MIN_ROWS = 16


@runtime_checkable
class GrowsInPlace(Protocol):
    """An allocator that also grows a tensor it made without moving or copying its bytes
    (a shared-memory unit extends the segment's file: ``ShmUnit``); an arena grown so
    keeps its memory, and a reader's or writer's mapping of it stays right."""

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...

    def grow(self, tensor: torch.Tensor, rows: int) -> torch.Tensor:
        """``tensor`` (as this allocator made it) with ``rows`` rows, the first ones its."""
        ...


def heap_alloc(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def _grown(n: int, need: int) -> int:
    while n < need:
        n *= 2
    return n


def _check_written(written: np.ndarray, slots: np.ndarray) -> None:
    """Raise KeyConflictError unless every slot in ``slots`` holds a value.

    ``written`` is a per-slot bool mask, or the arena's length array (-1: empty).
    """
    inside = (slots >= 0) & (slots < written.shape[0])
    ok = inside.copy()
    ok[inside] = written[slots[inside]] if written.dtype == bool else \
        written[slots[inside]] >= 0
    if not ok.all():
        bad = slots[~ok][:5].tolist()
        raise KeyConflictError(f"slots must hold a value to be read, got slots {bad} that "
                               f"were never written or were freed")


def _mark(written: np.ndarray, slots: np.ndarray, value: bool) -> np.ndarray:
    top = int(slots.max()) + 1 if len(slots) else 0
    if top > written.shape[0]:
        written = np.concatenate([written, np.zeros(_grown(max(written.shape[0], 1), top)
                                                    - written.shape[0], dtype=bool)])
    written[slots] = value
    return written


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
        self.data = alloc((_MIN_ROWS, *shape), dtype)  # may be larger (a reused segment)
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
        n = _grown(cap, max_slot + 1)
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
        _check_written(self.written, slots)
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
        self.values = alloc((_MIN_ROWS, *tail), dtype)
        self.start = np.zeros(_MIN_ROWS, dtype=np.int64)
        self.length = np.full(_MIN_ROWS, -1, dtype=np.int64)  # -1: slot empty
        self.end = 0
        self.live = 0

    def _ensure_slots(self, max_slot: int) -> None:
        cap = self.start.shape[0]
        if max_slot >= cap:
            n = _grown(cap, max_slot + 1)
            self.start = np.concatenate([self.start, np.zeros(n - cap, np.int64)])
            self.length = np.concatenate([self.length, np.full(n - cap, -1, np.int64)])

    def _compacts(self, extra: int) -> bool:
        """True if appending ``extra`` values compacts the arena first."""
        return self.end - self.live > max(self.live, 1 << 16) and \
            self.end + extra > self.values.shape[0]

    def _ensure_values(self, extra: int) -> None:
        if self._compacts(extra):
            self._compact()
        cap = self.values.shape[0]
        if self.end + extra > cap:
            rows = _grown(cap, self.end + extra)
            if isinstance(self._alloc, GrowsInPlace):  # no byte copied, none moves
                self.values = self._alloc.grow(self.values, rows)
                return
            new = self._alloc((rows, *self.tail), self.dtype)
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
        _check_written(self.length, slots)
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
        self.shapes = np.zeros((_MIN_ROWS, len(dims)), dtype=np.int64)

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
        _check_written(self.elems.length, slots)
        return self.elems.start[slots], self.shapes[slots]

    def free(self, slots: np.ndarray) -> None:
        self.elems.free(slots)

    def nbytes(self) -> int:
        return self.elems.nbytes() + self.shapes.nbytes


def _own(value: object) -> object:
    """A copy of a mutable plain value (lists/dicts), so storage and callers never share it.

    The exact plain containers are rebuilt here, much cheaper than ``deepcopy`` (a row
    is copied on every put and get); anything else (a dict subclass) is deep-copied.
    """
    kind = type(value)
    if kind in SCALARS:
        return value
    if kind is dict:
        if set(map(type, value.values())) <= SCALARS:  # flat: one C-level copy
            return dict(value)
        return {k: _own(v) for k, v in value.items()}
    if kind is list:
        return list(value) if set(map(type, value)) <= SCALARS else [_own(v) for v in value]
    if kind is tuple:
        return value if set(map(type, value)) <= SCALARS else tuple(_own(v) for v in value)
    return copy.deepcopy(value) if isinstance(value, list | dict | tuple) else value


def _own_all(values: list) -> list:
    """``[_own(v) for v in values]``, skipping the calls when every value is a scalar."""
    return list(values) if set(map(type, values)) <= SCALARS else [_own(v) for v in values]


class ObjectSlots:
    """Plain Python values (str, numbers, bytes, lists/dicts) per slot.

    Containers are copied on the way in and out: mutating a value passed to
    ``put`` or returned by ``get`` never changes what is stored.
    """

    def __init__(self) -> None:
        self.data = np.empty(_MIN_ROWS, dtype=object)
        self.written = np.zeros(_MIN_ROWS, dtype=bool)

    def put(self, slots: np.ndarray, values: list) -> None:
        cap = self.data.shape[0]
        top = int(slots.max())
        if top >= cap:
            self.data = np.concatenate([self.data, np.empty(_grown(cap, top + 1) - cap, object)])
        if len(values) != len(slots):
            raise ValueError(f"values must have one entry per slot ({len(slots)}), got "
                             f"{len(values)}")
        # fromiter keeps each value whole (an array built from nested lists would not)
        self.data[slots] = np.fromiter(_own_all(values), dtype=object, count=len(values))
        self.written = _mark(self.written, slots, True)

    def get(self, slots: np.ndarray) -> list:
        _check_written(self.written, slots)
        return _own_all(self.data[slots].tolist())

    def free(self, slots: np.ndarray) -> None:
        slots = slots[slots < self.data.shape[0]]
        self.data[slots] = None
        self.written[slots[slots < self.written.shape[0]]] = False

    def nbytes(self) -> int:
        return self.data.nbytes


Store = DenseSlab | RaggedArena | MultiRaggedArena | ObjectSlots

UNSET = -1  # the token of a slot that is free, or being written right now
_FENCE = ForkSafeLock()  # a writer in a forked child fences too


def fence() -> None:
    """A full memory barrier between the stores before and the loads after it.

    Taking a lock is a locked read-modify-write, which orders every earlier store
    before every later load on x86 (the memory model this package's seqlocks
    assume, see ``Generations``). Used where one side stores then checks a value
    the other side stores then checks (shared-memory writers and their unit).
    """
    with _FENCE:
        pass


class Generations:
    """The occupancy token of each slot of one partition; a seqlock word per slot.

    Invariants: a slot's token is ``UNSET`` while a put writes it (``begin`` ..
    ``end``) and after it is freed; otherwise it is the token of the row whose
    values the slot holds. Tokens are never reused within a partition, so a
    reader that copied rows and *then* finds each slot's token equal to the one
    it expects knows that no put touched those slots during its copy and that
    they still hold its rows (a reader in another process does this on the
    shared-memory slabs, see ``ShmReader.current``). A token array that is
    replaced (growth) or discarded is first set to ``UNSET`` everywhere, so a
    reader still mapping it never trusts it. Memory order: on x86 (TSO) stores
    and loads are not reordered among themselves, which this relies on.
    """

    def __init__(self, alloc: Alloc = heap_alloc) -> None:
        self._alloc = alloc
        self.data = alloc((_MIN_ROWS,), torch.int64)
        self.data.fill_(UNSET)

    def begin(self, slots: np.ndarray) -> None:
        """Mark ``slots`` as being written (growing the array to hold them)."""
        cap = self.data.shape[0]
        if int(slots.max()) >= cap:
            new = self._alloc((_grown(cap, int(slots.max()) + 1),), torch.int64)
            new.fill_(UNSET)
            fence()  # as in DenseSlab.ensure: a new segment bumped the layout epoch
            new[:cap].copy_(self.data)
            self.retire()
            self.data = new
        self.data[torch.from_numpy(slots)] = UNSET

    def end(self, slots: np.ndarray, tokens: np.ndarray | None) -> None:
        """Publish the tokens of the rows just written (``None``: unknown, UNSET)."""
        idx = torch.from_numpy(slots)
        if tokens is None:
            self.data[idx] = UNSET
        else:
            self.data[idx] = torch.from_numpy(np.asarray(tokens, dtype=np.int64))

    def free(self, slots: np.ndarray) -> None:
        slots = slots[(slots >= 0) & (slots < self.data.shape[0])]
        self.data[torch.from_numpy(slots)] = UNSET

    def retire(self) -> None:
        """Invalidate every slot (before the array is replaced or dropped)."""
        self.data.fill_(UNSET)

    def holds(self, slots: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Mask over ``slots``: the slot holds the row of its token."""
        inside = (slots >= 0) & (slots < self.data.shape[0])
        ok = inside.copy()
        ok[inside] = self.data.numpy()[slots[inside]] == tokens[inside]
        return ok

    def check(self, partition: str, slots: np.ndarray, tokens: np.ndarray) -> None:
        """Raise StateError unless every slot holds the row of its token."""
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.shape != slots.shape:
            raise StateError(f"generations must have one entry per slot ({len(slots)}), "
                             f"got shape {tokens.shape}")
        ok = self.holds(slots, tokens)
        if not ok.all():
            raise stale_rows(partition, slots[~ok])


def stale_rows(partition: str, slots: np.ndarray) -> StateError:
    return StateError(
        f"rows must still exist to be read, but slots {slots[:5].tolist()} of partition "
        f"{partition!r} were cleared (and may hold newer rows) since their metadata was read")


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
