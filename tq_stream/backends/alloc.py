"""Where a store's memory comes from, and the orders its writers keep.

An ``Alloc`` (``alloc(shape, dtype) -> Tensor``) decides where slab memory comes from (the
heap, or a shared-memory segment in ``ShmUnit``); ``GrowsInPlace`` is one that can also
extend a tensor it made, ``Extends`` one that extends it in place while it can, else by a
copy (the heap's, ``heap.HeapAlloc``); ``grown`` and ``stepped`` say how far a store
grows. ``fence`` orders a writer's stores before its later loads; the ``written`` helpers
keep a per-slot mask of which slots hold a value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from tq_stream.backends.heap import HeapAlloc
from tq_stream.errors import KeyConflictError
from tq_stream.forksafe import ForkSafeLock

Alloc = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
MIN_ROWS = 16
STEP = 16  # a store that grows without a copy grows by 1/STEP of itself at least


@runtime_checkable
class GrowsInPlace(Protocol):
    """An allocator that also grows a tensor it made without moving or copying its bytes
    (a shared-memory unit extends the segment's file: ``ShmUnit``); an arena grown so
    keeps its memory, and a reader's or writer's mapping of it stays right."""

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...

    def grow(self, tensor: torch.Tensor, rows: int) -> torch.Tensor:
        """``tensor`` (as this allocator made it) with ``rows`` rows, the first ones its."""
        ...


@runtime_checkable
class Extends(Protocol):
    """An allocator that extends a tensor it made, in place while it can, else by a
    copy into new memory (``heap.HeapAlloc``): the tensor may move."""

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...

    def extend(self, tensor: torch.Tensor, rows: int, used: int) -> torch.Tensor:
        """``tensor`` with ``rows`` rows, its first ``used`` rows kept."""
        ...

    def extra_bytes(self, tensor: torch.Tensor, rows: int) -> int:
        """Bytes ``extend`` to ``rows`` rows holds beyond ``tensor`` at its peak."""
        ...


heap_alloc = HeapAlloc()


def grown(n: int, need: int) -> int:
    """Capacity for ``need`` rows of a store of ``n`` that grows by a copy: doubled (so
    each row is copied about once however often it grows)."""
    while n < need:
        n *= 2
    return n


def stepped(n: int, need: int) -> int:
    """Capacity for ``need`` rows of a store of ``n`` that grows without a copy: ``need``,
    or 1/STEP more than ``n`` (growths stay few), so it holds little more than its rows."""
    return max(need, n + n // STEP)


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


def check_written(written: np.ndarray, slots: np.ndarray) -> None:
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


def mark_written(written: np.ndarray, slots: np.ndarray, value: bool) -> np.ndarray:
    top = int(slots.max()) + 1 if len(slots) else 0
    if top > written.shape[0]:
        written = np.concatenate([written, np.zeros(grown(max(written.shape[0], 1), top)
                                                    - written.shape[0], dtype=bool)])
    written[slots] = value
    return written
