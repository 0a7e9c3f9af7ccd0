"""Column stores: where one field's rows live inside a storage unit.

- ``DenseSlab``: a preallocated ``[capacity, *shape]`` tensor; a batch read is
  one ``index_select`` into one output buffer.
- ``RaggedArena``: values appended to an arena tensor, a (start, length) per
  slot; freed space is reclaimed by compaction once it exceeds the live part.
- ``ObjectSlots``: a numpy object array of plain Python values.

Every store grows by doubling and can report its bytes. An ``alloc`` callable
(``alloc(shape, dtype) -> Tensor``) decides where slab memory comes from, so a
shared-memory unit reuses the same stores.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from tq_stream.columns import Column, Ragged, dtype_from_name, schema_of

Alloc = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
_MIN_ROWS = 16


def heap_alloc(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def _grown(n: int, need: int) -> int:
    while n < need:
        n *= 2
    return n


class DenseSlab:
    """Fixed-shape rows in one tensor ``[capacity, *shape]``."""

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...], alloc: Alloc = heap_alloc):
        self.dtype, self.shape, self._alloc = dtype, shape, alloc
        self.data = alloc((_MIN_ROWS, *shape), dtype)

    def _ensure(self, max_slot: int) -> None:
        cap = self.data.shape[0]
        if max_slot < cap:
            return
        new = self._alloc((_grown(cap, max_slot + 1), *self.shape), self.dtype)
        new[:cap].copy_(self.data)
        self.data = new

    def put(self, slots: np.ndarray, values: torch.Tensor) -> None:
        self._ensure(int(slots.max()))
        idx = torch.from_numpy(slots)
        self.data.index_copy_(0, idx, values.to(self.dtype).reshape(-1, *self.shape))

    def get(self, slots: np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
        idx = torch.from_numpy(slots)
        if out is None:
            return self.data.index_select(0, idx)
        return torch.index_select(self.data, 0, idx, out=out)

    def free(self, slots: np.ndarray) -> None:
        pass  # slots are simply overwritten on reuse

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

    def _ensure_values(self, extra: int) -> None:
        garbage = self.end - self.live
        if garbage > max(self.live, 1 << 16) and self.end + extra > self.values.shape[0]:
            self._compact()
        cap = self.values.shape[0]
        if self.end + extra > cap:
            new = self._alloc((_grown(cap, self.end + extra), *self.tail), self.dtype)
            new[: self.end].copy_(self.values[: self.end])
            self.values = new

    def _compact(self) -> None:
        slots = np.flatnonzero(self.length >= 0)
        gathered = self._gather(slots)
        lengths = self.length[slots]
        self.values[: gathered.shape[0]].copy_(gathered)
        self.start[slots] = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(slots) else 0
        self.end = int(gathered.shape[0])

    def _gather(self, slots: np.ndarray) -> torch.Tensor:
        lengths = self.length[slots]
        total = int(lengths.sum())
        if total == 0:
            return self.values[:0].clone()
        offs = np.cumsum(lengths) - lengths
        idx = np.repeat(self.start[slots] - offs, lengths) + np.arange(total, dtype=np.int64)
        return self.values.index_select(0, torch.from_numpy(idx))

    def put(self, slots: np.ndarray, values: Ragged) -> None:
        self._ensure_slots(int(slots.max()))
        old = self.length[slots]
        self.live -= int(old[old > 0].sum())
        self.length[slots] = -1
        vals = values.values.to(self.dtype)
        self._ensure_values(int(vals.shape[0]))
        lengths = values.lengths.numpy()
        self.values[self.end : self.end + vals.shape[0]].copy_(vals)
        self.start[slots] = self.end + (values.offsets[:-1] - values.offsets[0]).numpy()
        self.length[slots] = lengths
        self.end += int(vals.shape[0])
        self.live += int(lengths.sum())

    def get(self, slots: np.ndarray) -> Ragged:
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


class ObjectSlots:
    """Plain Python values (str, numbers, bytes, lists/dicts) per slot."""

    def __init__(self) -> None:
        self.data = np.empty(_MIN_ROWS, dtype=object)

    def put(self, slots: np.ndarray, values: list) -> None:
        cap = self.data.shape[0]
        top = int(slots.max())
        if top >= cap:
            self.data = np.concatenate([self.data, np.empty(_grown(cap, top + 1) - cap, object)])
        for s, v in zip(slots.tolist(), values, strict=True):
            self.data[s] = v

    def get(self, slots: np.ndarray) -> list:
        return self.data[slots].tolist()

    def free(self, slots: np.ndarray) -> None:
        slots = slots[slots < self.data.shape[0]]
        self.data[slots] = None

    def nbytes(self) -> int:
        return self.data.nbytes


Store = DenseSlab | RaggedArena | ObjectSlots


def store_for(column: Column, alloc: Alloc = heap_alloc) -> Store:
    """A new, empty store fitting the kind of ``column``."""
    schema = schema_of(column)
    if schema.kind == "dense":
        return DenseSlab(dtype_from_name(schema.dtype), schema.shape, alloc)
    if schema.kind == "ragged":
        return RaggedArena(dtype_from_name(schema.dtype), schema.shape, alloc)
    return ObjectSlots()
