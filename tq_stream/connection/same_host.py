"""SameHostUnit: a storage unit in another process of this host, whose dense fields are
read and written through its shared memory."""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tq_stream.backends.arena_writes import ArenaWrite
from tq_stream.backends.base import StorageUnit
from tq_stream.backends.segments import ShmReader
from tq_stream.backends.slabs import UNSET, fence
from tq_stream.buffers import gather_rows, gather_spans, scatter_rows
from tq_stream.columns import Column, Ragged, dtype_from_name, dtype_name
from tq_stream.errors import ConfigError, StateError, WaitTimeout
from tq_stream.multiragged import MultiRagged

if TYPE_CHECKING:
    from tq_stream.connection.proxies import RemoteUnit

_READER = ShmReader()
MAX_LAYOUTS = 256  # cached layouts per unit (a cache this full is cleared)


class _Layout:
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
        self.epoch_view = None if epoch is None else _words(_READER.view(
            epoch["shm"], torch.int64, (2,)).numpy())  # memoryview: the cheapest read
        self.fields = {f: _map(lay) for f, lay in raw.get("fields", {}).items()}
        # numpy views: one-row index operations cost a fraction of torch's here
        self.tokens = _map_np(raw.get("generations"))
        self.flags = {f: _map_np(lay) for f, lay in (raw.get("flags") or {}).items()}
        self.live = _map_np(raw.get("live"))
        self.rows = _RowWriter(self) if self.tokens is not None and self.live is not None \
            and self.epoch_view is not None else None

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
        for f, col in columns.items():
            view, flags = self.fields.get(f), self.flags.get(f)
            if view is None or flags is None or top >= min(view.shape[0], flags.shape[0]) \
                    or col.dtype != view.dtype or col.shape[1:] != view.shape[1:]:
                return False
        if not (self.tokens[slots] == UNSET).all():
            return False  # rows being read may live there: only the unit overwrites them
        for f, col in columns.items():
            scatter_rows(self.fields[f], slots, col)
            self.flags[f][slots] = True
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


class _RowWriter:
    """``_Layout.write`` of one row, with plain memory stores.

    A put of one row is the common small put, and on this machine each numpy or torch
    call costs tens of microseconds when its code is not in the CPU caches (as after
    a few idle milliseconds): here the bytes are one ``memmove`` and the flags, tokens
    and epochs are read and written through memoryviews. Same stores in the same
    order as ``_Layout.write``, so the same seqlock argument holds.
    """

    __slots__ = ("fields", "flags", "layout", "live", "tokens")

    def __init__(self, layout: _Layout) -> None:
        # a proxy: a strong reference would make a cycle, and the segments a dropped
        # layout maps would stay mapped (an fd each) until the cyclic GC ran
        self.layout = weakref.proxy(layout)
        self.tokens = _words(layout.tokens)
        self.live = memoryview(layout.live)  # type: ignore[arg-type]
        self.flags = {f: memoryview(a) for f, a in layout.flags.items() if a is not None}
        # field -> (address of row 0, bytes per row, rows, dtype, shape of a row)
        self.fields = {f: (t.data_ptr(), t[0].nbytes if len(t) else 0, t.shape[0], t.dtype,
                           tuple(t.shape[1:]))
                       for f, t in layout.fields.items() if t is not None}

    def write(self, slot: int, columns: dict[str, Column], token: int) -> bool:
        if not self.layout.writable() or not 0 <= slot < min(len(self.tokens), len(self.live)):
            return False
        for f, col in columns.items():
            field, flags = self.fields.get(f), self.flags.get(f)
            if field is None or flags is None or slot >= min(field[2], len(flags)) or \
                    not _raw_bytes_of(col, field[3], field[4]):
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


def _raw_bytes_of(col: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    """True if ``col`` is one row of ``dtype`` and ``shape`` whose memory holds exactly its
    values: a plain, contiguous CPU tensor without a lazy conjugate or negation (a
    ``conj()`` view's memory holds the unconjugated values; a copy resolves them)."""
    return type(col) is torch.Tensor and col.dtype == dtype and \
        tuple(col.shape) == (1, *shape) and col.is_cpu and col.is_contiguous() and \
        not col.is_conj() and not col.is_neg()


def _arena_rows(arena: torch.Tensor, where: dict[str, Any]) -> MultiRagged:
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


def _words(a: np.ndarray) -> memoryview:
    """An int64 array as a memoryview of its words (one item read or written in C)."""
    return memoryview(a).cast("B").cast("q")


def _mapped(lay: dict[str, Any]) -> torch.Tensor:
    """The tensor a layout entry (segment, dtype, shape) describes."""
    return _READER.view(lay["shm"], dtype_from_name(lay["dtype"]), tuple(lay["shape"]))


def _map(lay: dict[str, Any] | None) -> torch.Tensor | None:
    return None if lay is None else _mapped(lay)


def _map_np(lay: dict[str, Any] | None) -> np.ndarray | None:
    t = _map(lay)
    return None if t is None else t.numpy()


def _forget(cache: dict[Any, _Layout]) -> None:
    """Drop cached layouts, the reader's mappings of the segments they mapped, and of
    segments that are gone (their memory and fd are returned once nothing maps them).
    Forgotten by name, not only by existence: a unit bumps its epoch before it unlinks
    a slab's old segment, so when a reader drops its layouts the file may still be
    there; kept in the reader's cache, it would stay mapped long after."""
    names = set().union(*(layout.segments for layout in cache.values()))
    cache.clear()
    _READER.forget(names)
    _READER.forget_gone()


class SameHostUnit(StorageUnit):
    """A unit process on this host, reached through its shared-memory slabs where it pays.

    - Reads of dense fields copy straight out of the slabs (no bytes on a socket).
      The layout is asked for once and reused while the unit's layout epoch is
      unchanged, so such a read makes no call at all; the slots' tokens are checked
      after the copy (a seqlock), and a read that raced a write asks the unit.
    - Small puts of new dense rows (up to ``SHARED_ROWS``, below ``DIRECT_BYTES``)
      are copied into the slabs here, with their flags and tokens (``_Layout.write``),
      and make no call either; a write that raced a slab move or a dropped store is
      done again by the unit.
    - Puts of ``DIRECT_BYTES`` or more of dense, ragged and multi-ragged values are
      copied in between two small calls (``prepare_write`` / ``finish_write``): dense
      rows into their slabs, ragged rows at the end of their arenas, where the unit
      placed them (``tq_stream.backends.arena_writes``); object fields of the same put
      go over the socket.
    - Multi-ragged fields (images, video) are read in the unit's shared memory, the
      first read too: one small call (``spans``) says where the rows lie, and rows
      written one after the other come back as views of the unit's arena (no copy);
      their bytes stay as they are while the rows live. A field ``spans`` does not
      place (ragged, object) is remembered and read from the unit without asking again.
    - Everything else goes over the socket to the unit process.
    """

    def __init__(self, remote: RemoteUnit) -> None:
        self._remote = remote
        self._layouts: dict[tuple[str, tuple[str, ...]], _Layout] = {}
        self._writes: dict[tuple[str, tuple[str, ...]], _Layout] = {}  # writable layouts
        self._shm = True  # False once the unit says it has no shared memory
        self._direct = True  # False once the unit refuses direct writes
        # (partition, field) a read found not multi-ragged: never asked ``spans`` again
        self._plain: set[tuple[str, str]] = set()

    DIRECT_BYTES = 1 << 20  # puts of dense fields at least this large skip the socket
    SHARED_ROWS = 64  # smaller puts of new dense rows make no call at all

    def put(self, partition: str, slots: np.ndarray, columns: dict[str, Column],
            generations: np.ndarray | None = None) -> None:
        if len(slots) == 1 and generations is not None:  # a small put's one new row
            layout = self._writes.get((partition, tuple(columns)))
            if layout is not None and layout.rows is not None and \
                    layout.rows.write(int(slots[0]), columns, int(generations[0])):
                return  # (a cached layout still writable is current: nothing is stale)
        slots = np.asarray(slots, dtype=np.int64)
        if not len(slots):
            return
        tensors = {f: c for f, c in columns.items() if isinstance(c, torch.Tensor)}
        size = sum(c.numel() * c.element_size() for c in tensors.values())
        if self._shm and len(tensors) == len(columns) and generations is not None \
                and size < self.DIRECT_BYTES and len(slots) <= self.SHARED_ROWS:
            layout = self._write_layout(partition, tuple(columns))
            if layout is not None and layout.write(slots, tensors, generations):
                return
        if self._shm and self._direct:
            size += sum(c.values.nbytes for c in columns.values()
                        if isinstance(c, Ragged | MultiRagged))
        if self._shm and self._direct and size >= self.DIRECT_BYTES:
            arenas = {f: w for f, w in ((f, ArenaWrite.of(c)) for f, c in columns.items())
                      if w is not None}
            try:
                # Dense and ragged fields straight into shared memory; object fields
                # (if any) still travel over the socket, with the finish_write.
                if self._put_direct(partition, slots, tensors, arenas, columns, generations):
                    return
            except ConfigError:
                self._direct = False  # this unit takes no direct writes: use the socket
        self._remote.put(partition, slots, columns, generations)

    def _put_direct(self, partition: str, slots: np.ndarray, tensors: dict[str, torch.Tensor],
                    arenas: dict[str, ArenaWrite], columns: dict[str, Column],
                    generations: np.ndarray | None) -> bool:
        """Copy rows straight into the unit's shared memory between ``prepare_write`` and
        ``finish_write`` (see ``tq_stream.backends.direct``): dense ``tensors`` into
        their slabs, the values of ragged ``arenas`` where the unit placed their rows;
        the other ``columns`` go with ``finish_write``. False if a segment was gone
        before it could be mapped (the write is abandoned: put through the unit)."""
        fields = {f: [dtype_name(c.dtype), list(c.shape[1:])] for f, c in tensors.items()}
        rest = {f: c for f, c in columns.items() if f not in tensors and f not in arenas}
        plan = self._remote.prepare_write(partition, slots, generations, fields,
                                          {f: w.wire() for f, w in arenas.items()})
        ok = False
        placed = plan.get("arenas") or {}
        try:
            try:
                views = {f: _mapped(lay) for f, lay in plan["fields"].items()}
                ends = {f: _mapped(lay)[int(lay["at"]) : int(lay["at"]) + arenas[f].total]
                        for f, lay in placed.items()}
            except StateError:
                return False
            for f, view in views.items():
                scatter_rows(view, slots, tensors[f])
            for f, end in ends.items():
                end.copy_(arenas[f].values(columns[f]))
            ok = True
        finally:
            self._remote.finish_write(partition, plan["ticket"], ok, rest if ok else None)
        return True

    def get(self, partition: str, slots: np.ndarray, fields: Sequence[str],
            generations: np.ndarray | None = None,
            into: dict[str, torch.Tensor] | None = None) -> dict[str, Column]:
        slots = np.asarray(slots, dtype=np.int64)
        out: dict[str, Column] = {}
        for attempt in range(3 if self._shm else 0):
            try:
                layout = self._layout(partition, fields, fresh=attempt > 0)
            except StateError:  # a segment went between the layout call and mapping it
                continue  # after the last attempt: the unit answers (below), under its lock
            out = layout.gather(slots, into)
            if generations is not None and out and not layout.current(slots, generations):
                out = {}  # a put or clear touched the slots: the unit decides (locked)
            break
        rest = [f for f in fields if f not in out]
        if rest and self._shm and len(slots):
            out.update(self._views(partition, slots, rest, generations))
            rest = [f for f in fields if f not in out]
        if rest:
            got = self._remote.get(partition, slots, rest, generations)
            if len(self._plain) >= MAX_LAYOUTS:
                self._plain.clear()
            self._plain.update((partition, f) for f, c in got.items()
                               if not isinstance(c, MultiRagged))
            out.update(got)
        return {f: out[f] for f in fields}

    def _views(self, partition: str, slots: np.ndarray, fields: Sequence[str],
               generations: np.ndarray | None) -> dict[str, Column]:
        """Multi-ragged fields (all but those an earlier read found otherwise) read in
        the unit's shared memory: views of its arena when the rows lie there one after
        the other (a batch read as it was written), else one copy out of it; {} for what
        the unit does not place (it then answers ``get``)."""
        multi = [f for f in fields if (partition, f) not in self._plain]
        if not multi:
            return {}
        out: dict[str, Column] = {}
        try:
            for f, where in self._remote.spans(partition, slots, multi, generations).items():
                out[f] = _arena_rows(_READER.view(where["arena"]["shm"], dtype_from_name(
                    where["arena"]["dtype"]), tuple(where["arena"]["shape"])), where)
            # Rows are never moved in their arena while they live, but a segment may be
            # given to a new store once its rows are all freed: their tokens tell.
            if out and generations is not None and \
                    not self._layout(partition, [], fresh=False).current(slots, generations):
                return {}
        except StateError:  # a segment went (the arena grew), or the rows were cleared
            return {}  # the unit answers, under its lock
        return out

    def get_into(self, partition: str, slots: np.ndarray, fields: Sequence[str],
                 generations: np.ndarray | None,
                 into: dict[str, torch.Tensor] | None) -> dict[str, Column]:
        """``get`` into destinations for dense fields (``backends.shared.GathersInto``)."""
        return self.get(partition, slots, fields, generations, into)

    def _layout(self, partition: str, fields: Sequence[str], fresh: bool) -> _Layout:
        """The cached layout of ``fields``, or a new one when it is stale or ``fresh``."""
        key = (partition, tuple(fields))
        self._drop_stale()
        layout = self._layouts.get(key)
        if layout is not None and not fresh and layout.valid():
            return layout
        if layout is not None or len(self._layouts) >= MAX_LAYOUTS:
            _forget(self._layouts)
        layout = self._ask_layout(partition, fields, writable=False) or _Layout({})
        if set(layout.fields) == set(fields) and layout.tokens is not None:
            self._layouts[key] = layout  # partial layouts are used once (see _Layout)
        return layout

    def _drop_stale(self) -> None:
        """Forget every cached layout once the unit's epoch moved (one read of it): they
        all share it, and the segments they map may be unlinked, their memory held
        only by these mappings until dropped."""
        for cache in (self._layouts, self._writes):
            some = next(iter(cache.values()), None)
            if some is not None and not some.valid():
                _forget(self._layouts)
                _forget(self._writes)
                return

    def _ask_layout(self, partition: str, fields: Sequence[str],
                    writable: bool) -> _Layout | None:
        """The unit's current layout of ``fields`` (None: it keeps no shared memory)."""
        raw = self._remote.layout(partition, fields, writable)
        if not raw:
            self._shm = False  # the unit keeps its slabs on its heap
            return None
        return _Layout(raw)

    def _write_layout(self, partition: str, fields: tuple[str, ...]) -> _Layout | None:
        """A writable layout of ``fields`` (cached while it stays writable), or None when
        the unit has no such slabs yet (the first put of a field goes to the unit)."""
        key = (partition, fields)
        self._drop_stale()
        layout = self._writes.get(key)
        if layout is not None and layout.writable():
            return layout
        if layout is not None or len(self._writes) >= MAX_LAYOUTS:
            _forget(self._writes)
        try:
            layout = self._ask_layout(partition, fields, writable=True)
        except (StateError, WaitTimeout):  # a segment went meanwhile, or the unit broke
            return None  # the put goes through the unit (which says what is wrong)
        if layout is None or set(layout.fields) != set(fields) or \
                set(layout.flags) != set(fields) or layout.live is None or layout.tokens is None:
            return None
        self._writes[key] = layout
        return layout

    def free(self, partition: str, slots: np.ndarray) -> None:
        self._remote.free(partition, slots)

    def drop(self, partition: str) -> None:
        self._remote.drop(partition)

    def may_spill(self, partition: str, slots: np.ndarray, fields: Sequence[str]) -> None:
        self._remote.may_spill(partition, slots, fields)

    def set_memory(self, partition: str, memory_budget: int | None = None,
                   cold: Sequence[str] = ()) -> None:
        self._remote.set_memory(partition, memory_budget, cold)

    def nbytes(self) -> int:
        return self._remote.nbytes()

    def ping(self) -> dict[str, Any]:
        return self._remote.ping()

    def save_rows(self, request: dict[str, Any]) -> dict[str, Any]:
        return self._remote.save_rows(request)

    def load_rows(self, path: str, save: str, unit: int) -> dict[str, Any]:
        return self._remote.load_rows(path, save, unit)
    def stats(self, timeout: float | None = None) -> dict[str, Any]:
        return self._remote.stats(timeout)

    def close(self) -> None:
        self._remote.close()
