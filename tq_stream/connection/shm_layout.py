"""The shared memory of a storage unit on this host, as a reader or writer in another
process maps it: a unit's layout (its slabs, flags and tokens, ``Layout``), a row
writer over it (``RowWriter``), and the mapped segments' cache (``READER``, ``forget``).
``SameHostUnit`` reads and writes through these."""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from tq_stream.backends.segments import ShmReader
from tq_stream.backends.slabs import UNSET, fence
from tq_stream.buffers import gather_rows, gather_spans, scatter_rows
from tq_stream.columns import Column, dtype_from_name
from tq_stream.multiragged import MultiRagged

READER = ShmReader()
MAX_LAYOUTS = 256  # cached layouts per unit (a cache this full is cleared)


class Layout:
    """A unit's layout of some dense fields, with their segments mapped.

    Valid while the unit's layout epoch still holds the value it was read at: the
    unit bumps the epoch before a slab moves to a new segment (growth) and when it
    drops segments, so a valid layout maps the very tensors the unit writes to. A
    layout that lacks a field asked for (not a dense slab, or its partition's stores
    were freed) is not kept: the unit may give that store a kept segment without a
    new epoch (``ShmUnit``).
    """

    __slots__ = ("__weakref__", "epoch", "epoch_view", "fields", "flags", "live", "rows",
                 "segments", "stores", "tokens")

    def __init__(self, raw: dict[str, Any]) -> None:
        # the segments this layout maps (not the epoch's): forgotten with it
        self.segments = {lay["shm"] for lay in (*raw.get("fields", {}).values(),
                                                 *(raw.get("flags") or {}).values(),
                                                 raw.get("generations"), raw.get("live"))
                         if lay is not None}
        epoch = raw.get("epoch")
        self.epoch = None if epoch is None else epoch["value"]
        self.stores = None if epoch is None else epoch.get("stores")
        self.epoch_view = None if epoch is None else words(READER.view(
            epoch["shm"], torch.int64, (2,)).numpy())  # memoryview: the cheapest read
        self.fields = {f: mapped(lay) for f, lay in raw.get("fields", {}).items()}
        # numpy views: one-row index operations cost a fraction of torch's here
        self.tokens = map_np(raw.get("generations"))
        self.flags = {f: map_np(lay) for f, lay in (raw.get("flags") or {}).items()}
        self.live = map_np(raw.get("live"))
        self.rows = RowWriter(self, self.tokens, self.live) if self.tokens is not None and \
            self.live is not None and self.epoch_view is not None else None

    def valid(self) -> bool:
        return self.epoch_view is not None and self.epoch_view[0] == self.epoch

    def writable(self) -> bool:
        """Still valid for writes: no slab moved and no store was dropped since."""
        return self.valid() and self.epoch_view[1] == self.stores  # type: ignore[index]

    def write(self, slots: np.ndarray, columns: dict[str, torch.Tensor],
              tokens: np.ndarray) -> bool:
        """Write new rows (their slots' tokens UNSET) straight into the unit's slabs, set
        their flags and publish their tokens; False if it cannot be done here (nothing
        is trusted then: the caller writes the rows again through the unit).

        Seqlock with the unit: every store here comes before the final check of the
        epochs (a fence between), and the unit moves the epochs before it copies a
        slab or drops a store (a fence between), so either that check fails or the
        unit's copy holds these rows.
        """
        if len(slots) == 1 and self.rows is not None:
            return self.rows.write(int(slots[0]), columns, int(tokens[0]))
        top = int(slots.max())
        if self.live is None or self.tokens is None or not self.writable() or \
                top >= self.live.shape[0] or top >= self.tokens.shape[0]:
            return False
        targets = []
        for f, col in columns.items():
            view, flags = self.fields.get(f), self.flags.get(f)
            if view is None or flags is None or top >= min(view.shape[0], flags.shape[0]) \
                    or col.dtype != view.dtype or col.shape[1:] != view.shape[1:]:
                return False
            targets.append((view, flags, col))
        if not (self.tokens[slots] == UNSET).all():
            return False  # rows being read may live there: only the unit overwrites them
        for view, flags, col in targets:
            scatter_rows(view, slots, col)
            flags[slots] = True
        self.live[slots] = True
        self.tokens[slots] = tokens
        fence()
        return self.writable()

    def gather(self, slots: np.ndarray,
               into: dict[str, torch.Tensor] | None = None) -> dict[str, Column]:
        """Copy rows out of the mapped slabs, into ``into[f]`` where it fits; a field some
        of whose rows were never written (or freed since) is left out: the unit answers
        for it, and refuses naming it."""
        out: dict[str, Column] = {}
        top = int(slots.max()) if len(slots) else -1
        for f, view in self.fields.items():
            written = self.flags.get(f)
            if written is None or top >= written.shape[0] or not written[slots].all():
                continue
            dest = (into or {}).get(f)
            if dest is not None and (dest.dtype != view.dtype or
                                     tuple(dest.shape) != (len(slots), *view.shape[1:])):
                dest = None
            out[f] = gather_rows(view, slots, dest)
        return out

    def current(self, slots: np.ndarray, generations: np.ndarray) -> bool:
        """True if every slot holds the row of its token (seqlock check after a copy)."""
        tokens = self.tokens
        if tokens is None or (len(slots) and int(slots.max()) >= tokens.shape[0]):
            return False
        return bool(np.array_equal(tokens[slots], generations))


class RowWriter:
    """``Layout.write`` of one row, with plain memory stores.

    A put of one row is the common small put, and on this machine each numpy or torch
    call costs tens of microseconds when its code is not in the CPU caches (as after
    a few idle milliseconds): here the bytes are one ``memmove`` and the flags, tokens
    and epochs are read and written through memoryviews. Same stores in the same
    order as ``Layout.write``, so the same seqlock argument holds.
    """

    __slots__ = ("fields", "flags", "layout", "live", "tokens")

    def __init__(self, layout: Layout, tokens: np.ndarray, live: np.ndarray) -> None:
        # a proxy: a strong reference would make a cycle, and the segments a dropped
        # layout maps would stay mapped (an fd each) until the cyclic GC ran
        self.layout: Layout = weakref.proxy(layout)
        self.tokens = words(tokens)  # ``tokens``, ``live``: the layout's, mapped
        self.live = live.data
        self.flags = {f: a.data for f, a in layout.flags.items() if a is not None}
        # field -> (address of row 0, bytes per row, rows, dtype, shape of a row)
        self.fields = {f: (t.data_ptr(), t[0].nbytes if len(t) else 0, t.shape[0], t.dtype,
                           tuple(t.shape[1:]))
                       for f, t in layout.fields.items() if t is not None}

    def write(self, slot: int, columns: Mapping[str, Column], token: int) -> bool:
        if not self.layout.writable() or not 0 <= slot < min(len(self.tokens), len(self.live)):
            return False
        for f, col in columns.items():
            field, flags = self.fields.get(f), self.flags.get(f)
            if field is None or flags is None or slot >= min(field[2], len(flags)) or \
                    not raw_bytes_of(col, field[3], field[4]):
                return False
        if self.tokens[slot] != UNSET:
            return False  # rows being read may live there: only the unit overwrites them
        for f, col in columns.items():
            address, size = self.fields[f][:2]
            ctypes.memmove(address + slot * size, col.data_ptr(), size)
            self.flags[f][slot] = True
        self.live[slot] = True
        self.tokens[slot] = token
        fence()
        return self.layout.writable()


def raw_bytes_of(col: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    """True if ``col`` is one row of ``dtype`` and ``shape`` whose memory holds exactly its
    values: a plain, contiguous CPU tensor without a lazy conjugate or negation (a
    ``conj()`` view's memory holds the unconjugated values; a copy resolves them)."""
    return type(col) is torch.Tensor and col.dtype == dtype and \
        tuple(col.shape) == (1, *shape) and col.is_cpu and col.is_contiguous() and \
        not col.is_conj() and not col.is_neg()


def arena_rows(arena: torch.Tensor, where: dict[str, Any]) -> MultiRagged:
    """The rows ``where`` (``ShmUnit.spans``) places in ``arena``: a view of it when they
    lie there one after the other, else gathered."""
    start = np.asarray(where["start"], dtype=np.int64)
    shapes = torch.as_tensor(np.asarray(where["shapes"], dtype=np.int64))
    lengths = shapes.prod(1).numpy() if shapes.shape[1] else np.ones(len(start), np.int64)
    if np.array_equal(start[1:], start[:-1] + lengths[:-1]):
        values = arena[int(start[0]) : int(start[0]) + int(lengths.sum())]
    else:
        values, _ = gather_spans(arena, start, lengths)
    return MultiRagged(values, shapes, tuple(where["dims"]))


def words(a: np.ndarray) -> memoryview:
    """An int64 array as a memoryview of its words (one item read or written in C)."""
    return a.data.cast("B").cast("q")


def mapped(lay: dict[str, Any]) -> torch.Tensor:
    """The tensor a layout entry (segment, dtype, shape) describes."""
    return READER.view(lay["shm"], dtype_from_name(lay["dtype"]), tuple(lay["shape"]))


def map_layout(lay: dict[str, Any] | None) -> torch.Tensor | None:
    return None if lay is None else mapped(lay)


def map_np(lay: dict[str, Any] | None) -> np.ndarray | None:
    t = map_layout(lay)
    return None if t is None else t.numpy()


def forget(cache: dict[Any, Layout]) -> None:
    """Drop cached layouts, the reader's mappings of the segments they mapped, and of
    segments that are gone (their memory and fd are returned once nothing maps them).
    Forgotten by name, not only by existence: a unit bumps its epoch before it unlinks
    a slab's old segment, so when a reader drops its layouts the file may still be
    there; kept in the reader's cache, it would stay mapped long after."""
    names = set().union(*(layout.segments for layout in cache.values()))
    cache.clear()
    READER.forget(names)
    READER.forget_gone()
