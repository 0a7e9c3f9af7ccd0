"""SameHostUnit: a storage unit in another process of this host, whose dense fields are
read and written through its shared memory."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tq_stream.backends.arena_writes import ArenaWrite
from tq_stream.backends.base import StorageUnit
from tq_stream.buffers import scatter_rows
from tq_stream.columns import Column, Ragged, dtype_from_name, dtype_name
from tq_stream.connection.shm_layout import MAX_LAYOUTS, READER, Layout, arena_rows, forget, mapped
from tq_stream.errors import ConfigError, StateError, WaitTimeout
from tq_stream.multiragged import MultiRagged

if TYPE_CHECKING:
    from tq_stream.connection.remote_unit import RemoteUnit
    from tq_stream.messages.unit import UnitPing


class SameHostUnit(StorageUnit):
    """A unit process on this host, reached through its shared-memory slabs where it pays.

    - Reads of dense fields copy straight out of the slabs (no bytes on a socket).
      The layout is asked for once and reused while the unit's layout epoch is
      unchanged, so such a read makes no call at all; the slots' tokens are checked
      after the copy (a seqlock), and a read that raced a write asks the unit.
    - Small puts of new dense rows (up to ``SHARED_ROWS``, below ``DIRECT_BYTES``)
      are copied into the slabs here, with their flags and tokens (``Layout.write``),
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
        self._layouts: dict[tuple[str, tuple[str, ...]], Layout] = {}
        self._writes: dict[tuple[str, tuple[str, ...]], Layout] = {}  # writable layouts
        self._shm = True  # False once the unit says it has no shared memory
        self._direct = True  # False once the unit refuses direct writes
        # (partition, field) a read found not multi-ragged: never asked ``spans`` again
        self._plain: set[tuple[str, str]] = set()

    @property
    def remote(self) -> RemoteUnit:
        """The unit's client over its socket (calls, and the reads shared memory can't do)."""
        return self._remote

    DIRECT_BYTES = 1 << 20  # puts of dense fields at least this large skip the socket
    SHARED_ROWS = 64  # smaller puts of new dense rows make no call at all

    def put(self, partition: str, slots: np.ndarray, columns: Mapping[str, Column],
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
                    arenas: dict[str, ArenaWrite], columns: Mapping[str, Column],
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
                views = {f: mapped(lay) for f, lay in plan["fields"].items()}
                ends = {f: mapped(lay)[int(lay["at"]) : int(lay["at"]) + arenas[f].total]
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
                out[f] = arena_rows(READER.view(where["arena"]["shm"], dtype_from_name(
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

    def _layout(self, partition: str, fields: Sequence[str], fresh: bool) -> Layout:
        """The cached layout of ``fields``, or a new one when it is stale or ``fresh``."""
        key = (partition, tuple(fields))
        self._drop_stale()
        layout = self._layouts.get(key)
        if layout is not None and not fresh and layout.valid():
            return layout
        if layout is not None or len(self._layouts) >= MAX_LAYOUTS:
            forget(self._layouts)
        layout = self._ask_layout(partition, fields, writable=False) or Layout({})
        if set(layout.fields) == set(fields) and layout.tokens is not None:
            self._layouts[key] = layout  # partial layouts are used once (see Layout)
        return layout

    def _drop_stale(self) -> None:
        """Forget every cached layout once the unit's epoch moved (one read of it): they
        all share it, and the segments they map may be unlinked, their memory held
        only by these mappings until dropped."""
        for cache in (self._layouts, self._writes):
            some = next(iter(cache.values()), None)
            if some is not None and not some.valid():
                forget(self._layouts)
                forget(self._writes)
                return

    def _ask_layout(self, partition: str, fields: Sequence[str],
                    writable: bool) -> Layout | None:
        """The unit's current layout of ``fields`` (None: it keeps no shared memory)."""
        raw = self._remote.layout(partition, fields, writable)
        if not raw:
            self._shm = False  # the unit keeps its slabs on its heap
            return None
        return Layout(raw)

    def _write_layout(self, partition: str, fields: tuple[str, ...]) -> Layout | None:
        """A writable layout of ``fields`` (cached while it stays writable), or None when
        the unit has no such slabs yet (the first put of a field goes to the unit)."""
        key = (partition, fields)
        self._drop_stale()
        layout = self._writes.get(key)
        if layout is not None and layout.writable():
            return layout
        if layout is not None or len(self._writes) >= MAX_LAYOUTS:
            forget(self._writes)
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

    def ping(self) -> UnitPing:
        return self._remote.ping()

    def save_rows(self, request: Mapping[str, Any]) -> dict[str, Any]:
        return self._remote.save_rows(request)

    def load_rows(self, path: str, save: str, unit: int) -> dict[str, Any]:
        return self._remote.load_rows(path, save, unit)
    def stats(self, timeout: float | None = None) -> dict[str, Any]:
        return self._remote.stats(timeout)

    def close(self) -> None:
        self._remote.close()
