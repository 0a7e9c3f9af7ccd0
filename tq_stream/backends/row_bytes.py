"""What a store holds: which slots, the bytes of each row (what a save cuts its chunks by),
the written slots (what a field marked cold moves to disk)."""

from __future__ import annotations

import numpy as np

from tq_stream.backends.slabs import DenseSlab, MultiRaggedArena, RaggedArena, Store

OBJECT_ROW = 256  # a plain value's bytes are unknown without encoding it: a guess


def row_bytes(store: Store, slots: np.ndarray) -> np.ndarray:
    """The bytes of the rows in ``slots`` (0 for a slot that holds none)."""
    if isinstance(store, DenseSlab):
        row = int(np.prod(store.shape)) * store.data.element_size()
        inside = slots < store.written.shape[0]
        out = np.zeros(len(slots), dtype=np.int64)
        out[inside] = store.written[slots[inside]] * row
        return out
    if isinstance(store, MultiRaggedArena):
        return _arena_bytes(store.elems, slots) + store.shapes.shape[1] * 8
    if isinstance(store, RaggedArena):
        return _arena_bytes(store, slots)
    return np.full(len(slots), OBJECT_ROW, dtype=np.int64)


def _arena_bytes(arena: RaggedArena, slots: np.ndarray) -> np.ndarray:
    per = int(np.prod(arena.tail)) * arena.values.element_size()
    inside = slots < arena.length.shape[0]
    out = np.zeros(len(slots), dtype=np.int64)
    out[inside] = np.maximum(arena.length[slots[inside]], 0) * per + 16
    return out


def written_slots(store: Store) -> np.ndarray:
    """The slots of ``store`` that hold a value (ascending)."""
    if isinstance(store, MultiRaggedArena):
        return np.flatnonzero(store.elems.length >= 0).astype(np.int64)
    if isinstance(store, RaggedArena):
        return np.flatnonzero(store.length >= 0).astype(np.int64)
    return np.flatnonzero(store.written).astype(np.int64)


def held(store: Store, slots: np.ndarray) -> np.ndarray:
    """A bool per slot of ``slots``: ``store`` holds a value there."""
    if isinstance(store, MultiRaggedArena):
        store = store.elems
    flags = store.length >= 0 if isinstance(store, RaggedArena) else store.written
    inside = slots < flags.shape[0]
    out = np.zeros(len(slots), dtype=bool)
    out[inside] = flags[slots[inside]]
    return out
