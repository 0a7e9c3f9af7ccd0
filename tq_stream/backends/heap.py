"""Heap memory for a unit's stores: tensors on torch's heap, and arenas that grow in
address space reserved ahead (``HeapAlloc``).

An arena appends rows, so its values grow again and again. Grown by a copy, an arena
must double each time to keep the copying cheap (each value copied about once), and
then holds up to twice what it needs. ``HeapAlloc.extend`` grows one without a copy
once it is large: an arena of ``RESERVE_FROM`` bytes or more that grows moves once into
a private anonymous mapping several times its size, and each later growth is a longer
view of the same mapping. A smaller arena grows by a copy on the heap, whose freed
pages a store made anew (one large put) takes again without faulting them in. A page of it
takes memory once written, so an arena may grow by small steps (``alloc.stepped``)
and hold little more than its values; only when the mapping is used up are the values
copied, into one ``RESERVE`` times larger (at least ``RESERVE_MIN``).
"""

from __future__ import annotations

import math
import mmap
import weakref

import torch

RESERVE_FROM = 1 << 20  # bytes: an arena smaller than this grows by a copy, on the heap
RESERVE = 4  # address space reserved, times the bytes the arena grows to
RESERVE_MIN = 64 << 20  # bytes of address space reserved at least (no memory: unwritten)


class HeapAlloc:
    """Where a ``MemoryUnit``'s stores get memory: ``torch.empty``, and ``extend`` for
    arenas (``alloc.Extends``).

    Invariant: ``_maps`` holds, for each tensor ``extend`` returned as a view of a
    mapping, that tensor (weakly) and its mapping; the tensor keeps its mapping alive
    (``torch.frombuffer``), so a view of any of its rows stays right after a growth.
    Private mappings are copied on write by a fork, as the heap is. ``_maps`` takes no
    lock: each of its operations is one dict call (atomic under the GIL), and an entry
    goes from a weakref callback, which may run inside any allocation.

    Example:
        >>> heap = HeapAlloc()
        >>> t = heap.extend(heap((16,), torch.uint8), 2 << 20, used=16)  # on the heap
        >>> t = heap.extend(t, 3 << 20, used=2 << 20)  # copied into a reserved mapping
        >>> heap.extend(t, 4 << 20, used=3 << 20).data_ptr() == t.data_ptr()  # in place
        True
    """

    def __init__(self) -> None:
        self._maps: dict[int, tuple[weakref.ref[torch.Tensor], mmap.mmap]] = {}

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def extend(self, tensor: torch.Tensor, rows: int, used: int) -> torch.Tensor:
        """``tensor`` (as this allocator made it) with ``rows`` rows, its first ``used``
        rows kept: a longer view of the same memory if its mapping has room, else new
        memory with those rows copied."""
        shape = (rows, *tensor.shape[1:])
        mapping = self._room(tensor, _nbytes(shape, tensor.dtype))
        if mapping is not None:
            return self._view(mapping, tensor.dtype, shape)
        reserve = tensor.numel() * tensor.element_size() >= RESERVE_FROM
        new = self._new(shape, tensor.dtype) if reserve else torch.empty(shape, dtype=tensor.dtype)
        new[:used].copy_(tensor[:used])
        return new

    def extra_bytes(self, tensor: torch.Tensor, rows: int) -> int:
        """Bytes ``extend(tensor, rows, ...)`` adds to what ``tensor`` holds at its peak:
        the new rows if it grows in place, else the whole new tensor (both are held
        while the rows are copied)."""
        nbytes = _nbytes((rows, *tensor.shape[1:]), tensor.dtype)
        if self._room(tensor, nbytes) is not None:
            return nbytes - tensor.numel() * tensor.element_size()
        return nbytes

    def _room(self, tensor: torch.Tensor, nbytes: int) -> mmap.mmap | None:
        """The mapping ``tensor`` views, if it has ``nbytes`` of room."""
        entry = self._maps.get(id(tensor))
        if entry is None or entry[0]() is not tensor or len(entry[1]) < nbytes:
            return None
        return entry[1]

    def _new(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = _nbytes(shape, dtype)
        # just the bytes asked for if the kernel refuses to reserve more
        for size in (max(RESERVE * nbytes, RESERVE_MIN), nbytes):
            try:
                mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
            except OSError:
                continue
            return self._view(mapping, dtype, shape)
        return torch.empty(shape, dtype=dtype)

    def _view(self, mapping: mmap.mmap, dtype: torch.dtype,
              shape: tuple[int, ...]) -> torch.Tensor:
        view = torch.frombuffer(mapping, dtype=dtype, count=math.prod(shape)).view(shape)
        key = id(view)  # its entry goes with it, before the id can be reused

        def gone(_: object) -> None:
            self._forget(key)

        self._maps[key] = (weakref.ref(view, gone), mapping)
        return view

    def _forget(self, key: int) -> None:
        entry = self._maps.get(key)
        if entry is not None and entry[0]() is None:
            self._maps.pop(key, None)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize
