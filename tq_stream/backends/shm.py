"""Shared-memory storage: a unit whose dense slabs live in /dev/shm segments.

The unit process owns the segments (creates, grows, unlinks them); a client on the same host
asks the unit for a field's ``layout`` (segment name, dtype, shape) and gathers rows straight
out of the mapped segment: one copy, no socket for the bytes. A slab that grows moves to a new
segment and the old one is unlinked; a reader that still maps it keeps a valid (older) view,
which holds every row committed before its ``get_meta``. A ragged or multi-ragged arena grows in
place instead: its segment's file is extended and mapped again, nothing is copied and no byte
moves (``alloc.GrowsInPlace``), so growing it needs no wait for a same-host writer copying into
it. Slots are reused after a clear, so the layout also names the partition's token array
(``Generations``, a seqlock word per slot): after copying, a reader checks that every slot still
holds the token of the row it asked for (``ShmReader.current``) and otherwise reads through the
unit, which decides under its lock. Segment names carry the owner's pid (``tq_<pid>_<n>``), so
segments of a unit that died are found and removed by ``sweep_stale`` (called by every new unit
and by the deployment), which first moves the dead unit's layout epoch so that readers still
mapping its segments stop trusting them.
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from tq_stream.backends.alloc import Alloc, fence
from tq_stream.backends.arena_writes import appended
from tq_stream.backends.direct import DirectWrites, UnitStores
from tq_stream.backends.memory import MemoryUnit
from tq_stream.backends.partition_store import PartitionStore
from tq_stream.backends.row_bytes import held
from tq_stream.backends.segments import SHM_DIR, Segment
from tq_stream.backends.shm_sweep import EPOCH, PREFIX, shm_available, sweep_stale
from tq_stream.backends.slabs import DenseSlab, MultiRaggedArena
from tq_stream.columns import Column

# re-exported: where tests and deployments find them
__all__ = ["EPOCH", "PREFIX", "SHM_DIR", "ShmUnit", "shm_available", "sweep_stale"]

_COUNTER = itertools.count()  # per process, shared by its units: names never collide
STORES = 1  # index of the stores count in the epoch segment


class ShmUnit(MemoryUnit):
    """A MemoryUnit whose dense slabs live in shared memory (see module docstring).

    Args:
        keep_bytes: segments of a partition whose rows were all freed are kept, up to
            this many bytes in all (not counted by ``nbytes``), for the partition's
            next rows; 0 (the default) unlinks them at once.

    Kept stores and segments serve streaming: a consumer that keeps up with a few rows at a time
    empties a partition again and again. So the stores of a partition whose last row was freed
    stay (``warm``) while they fit in ``keep_bytes`` with the kept segments (oldest evicted
    first): a same-host writer's layout of them stays valid, and its next small put makes no
    call to the unit (``SameHostUnit``). A store that did go costs, when made again, a file, a
    mapping in the unit and in every reader and a new layout epoch, unless its segment was kept.
    A kept segment is reused only by the store it served last (same partition and field), and
    only while that store does not exist; so a reader's layout that maps it is right again once
    it is reused, and needs no new epoch; it is handed out whole, so it is reused for a
    field's values only if all of it fits the partition's memory budget. Invariants: at
    most one kept segment per (partition, field), the one that store used last; every other
    change of a store's segment bumps the epoch before rows are written to it.
    """

    def __init__(self, keep_bytes: int = 0, spill_dir: str | None = None) -> None:
        sweep_stale()
        self.keep_bytes = keep_bytes
        self._segments: dict[int, Segment] = {}  # data_ptr of a slab -> its segment
        self._idle: dict[tuple[str, ...], Segment] = {}  # kept segments, oldest first
        self._idle_bytes = 0
        # Emptied partitions whose stores stay for their next rows, oldest first, and
        # their bytes (guarded by ``_lock``; see the class docstring).
        self._warm: OrderedDict[str, int] = OrderedDict()
        self._garbage = False  # stores were dropped: their segments wait for ``_collect``
        self._seg_lock = threading.Lock()
        # The layout epoch: one int64 in its own segment, bumped whenever a segment is
        # created or unlinked, so a reader may reuse a layout while the epoch it was
        # read at is unchanged (``SameHostUnit``).
        self._epoch_seg = Segment(f"{PREFIX}{os.getpid()}_{EPOCH}_{next(_COUNTER)}", 16,
                                   create=True)
        # [0]: the layout epoch; [STORES]: bumped before stores may be dropped.
        self._epoch = np.frombuffer(self._epoch_seg.map, dtype=np.int64, count=2)
        self._allocs = 0  # segments created so far (a put that made none needs no collect)
        super().__init__(alloc=self._alloc_dense, spill_dir=spill_dir)
        self._direct = DirectWrites(UnitStores(
            lock=self._lock, parts=self._parts, check_put=self._check_put,
            new_partition=self._new_partition, alloc_for=self._alloc_for,
            describe=self._describe))

    def _raw_alloc(self, partition: str, field: str, part: str = "") -> Alloc:
        key = (partition, field, part) if part else (partition, field)
        return _SegmentAlloc(functools.partial(self._alloc_dense, key=key), self._grow_segment)

    def _grow_segment(self, tensor: torch.Tensor, rows: int) -> torch.Tensor:
        """``tensor`` (a whole segment's) as ``rows`` rows of the same, extended segment:
        nothing is copied, no segment is made or unlinked (so no new layout epoch), and
        a same-host reader or writer mapping the old size still sees the same bytes."""
        shape = (rows, *tensor.shape[1:])
        with self._seg_lock:
            seg = self._segments.pop(tensor.data_ptr())
            seg.extend(int(np.prod(shape)) * tensor.element_size())
            seg.shape = shape
            grown = seg.tensor(tensor.dtype, shape)
            self._segments[grown.data_ptr()] = seg
        return grown

    def _stores_may_go(self) -> None:
        # Before stores are dropped (their segments may be kept and reused by a new
        # store without a new layout epoch): a same-host writer holding their layout
        # sees this count move and writes again through the unit (``SameHostUnit``).
        self._epoch[STORES] += 1
        fence()

    def _stored(self, key: tuple[str, ...]) -> bool:
        """True if the store of ``key`` exists (called with ``_lock`` held)."""
        part = self._parts.get(key[0])
        return part is not None and (key[1] == "" or key[1] in part.fields)

    def _alloc_dense(self, shape: tuple[int, ...], dtype: torch.dtype,
                     key: tuple[str, ...] | None = None) -> torch.Tensor:
        # Called with ``_lock`` held (from ``put``): ``_stored`` tells creation of a
        # store (which may reuse its kept segment) from growth (which never may).
        with self._seg_lock:
            seg = self._idle.pop(key, None) if key is not None else None
            if seg is not None and key is not None:
                self._idle_bytes -= seg.nbytes
                # Handed out whole: a field's values must fit the budget (a store's
                # flags, a partition's tokens and live flags are not budgeted).
                if (not self._stored(key) and seg.dtype == dtype
                        and seg.shape[1:] == tuple(shape[1:]) and seg.shape[0] >= shape[0]
                        and (len(key) > 2 or not key[1]
                             or self._has_room(key[0], seg.nbytes))):
                    t = seg.tensor(dtype, seg.shape)
                    seg.seq = next(_COUNTER)
                    self._segments[t.data_ptr()] = seg
                    return t
                seg.unlink()
                self._epoch[0] += 1
        nbytes = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
        name = f"{PREFIX}{os.getpid()}_{next(_COUNTER)}"
        seg = Segment(name, nbytes, create=True)
        seg.key, seg.dtype, seg.shape, seg.nbytes = key, dtype, tuple(shape), nbytes
        seg.seq = next(_COUNTER)
        t = seg.tensor(dtype, shape)
        with self._seg_lock:
            self._segments[t.data_ptr()] = seg
            self._allocs += 1
            self._epoch[0] += 1  # before any row is written to the new segment
        return t

    def _live_ptrs(self) -> set[int]:
        live: set[int] = set()
        for p in self._parts.values():
            live |= {p.gen.data.data_ptr(), p.live_flags.data_ptr()}
            for s in p.fields.values():
                if isinstance(s, DenseSlab):
                    live |= {s.data.data_ptr(), s.flags.data_ptr()}
                elif hasattr(s, "values"):
                    live.add(s.values.data_ptr())
        return live

    def _collect(self, keep: bool = True) -> None:
        """Unlink segments no slab uses any more (after growth, free or drop), or keep
        the last one of a store that is gone (``keep``, see the class docstring)."""
        with self._lock, self._seg_lock:
            live = self._live_ptrs()
            dead = [self._segments.pop(p) for p in list(self._segments) if p not in live]
            last: dict[tuple[str, ...], Segment] = {}
            for seg in dead:
                key = seg.key
                if keep and key is not None and not self._stored(key) \
                        and seg.nbytes <= self.keep_bytes \
                        and (key not in last or seg.seq > last[key].seq):
                    last[key] = seg
            gone = [seg for seg in dead if seg.key is None or last.get(seg.key) is not seg]
            for key, seg in last.items():
                old = self._idle.pop(key, None)
                if old is not None:
                    self._idle_bytes -= old.nbytes
                    gone.append(old)
                self._idle[key] = seg
                self._idle_bytes += seg.nbytes
            while self._idle_bytes > self.keep_bytes:
                old = self._idle.pop(next(iter(self._idle)))
                self._idle_bytes -= old.nbytes
                gone.append(old)
            for seg in gone:
                seg.unlink()
            if gone:
                self._epoch[0] += 1

    def put(self, partition: str, slots: np.ndarray, columns: Mapping[str, Column],
            generations: np.ndarray | None = None) -> None:
        allocs = self._allocs
        try:
            with self._direct.cond:  # growing a slab must not move an open direct write
                self._direct.wait_growth(partition, np.asarray(slots, dtype=np.int64),
                                         columns, appended(columns))
                super().put(partition, slots, columns, generations)
                if partition in self._warm:  # it holds rows again
                    with self._lock:
                        self._warm.pop(partition, None)
        finally:
            if self._allocs != allocs:  # a slab grew: its old segment is garbage now
                self._collect()

    def prepare_write(self, partition: str, slots: np.ndarray, generations: np.ndarray | None,
                      fields: Mapping[str, Sequence[Any]],
                      arenas: Mapping[str, object] | None = None) -> dict[str, Any]:
        """Open a direct write (``DirectWrites.prepare``); a grown slab's old segment goes."""
        reply = self._direct.prepare(partition, slots, generations, fields, arenas)
        self._collect()
        return reply

    def _writes_open(self, partition: str) -> bool:
        return self._direct.open_on(partition)

    def _quiesce(self, partition: str, slots: np.ndarray) -> None:
        self._direct.quiesce(partition, slots)

    def finish_write(self, partition: str, ticket: int, ok: bool = True,
                     columns: dict[str, Column] | None = None) -> None:
        """End a direct write (``tq_stream.backends.direct``), then put the rows' other
        fields ``columns`` (if ``ok``), as ``put`` would."""
        slots, tokens = self._direct.close(partition, ticket, ok)
        if ok and columns:
            self.put(partition, slots, columns, tokens)

    def free(self, partition: str, slots: np.ndarray) -> None:
        super().free(partition, slots)
        if self._garbage:  # stores went (this partition's or warm ones): so did slabs
            self._garbage = False
            self._collect()

    def _stores_went(self) -> None:
        self._collect(keep=False)  # their segments go (a reader re-reads the layout)

    def _drop_store(self, partition: str, part: PartitionStore) -> bool:
        dropped = super()._drop_store(partition, part)
        self._garbage = self._garbage or dropped
        return dropped

    def _emptied(self, partition: str, part: PartitionStore) -> None:
        # Lock held. Keep the stores for the partition's next rows if they fit with the
        # kept segments; the oldest other warm partitions go to make room.
        nbytes = sum(s.nbytes() for s in part.fields.values()) + \
            part.gen.data.nbytes + part.live_flags.nbytes
        self._warm.pop(partition, None)
        while self._warm and sum(self._warm.values()) + nbytes + self._idle_bytes \
                > self.keep_bytes:
            self._evict_warm(next(iter(self._warm)))
        if nbytes + self._idle_bytes <= self.keep_bytes:
            self._warm[partition] = nbytes
        else:
            self._drop_store(partition, part)

    def _evict_warm(self, partition: str) -> None:
        """Drop the stores a warm partition kept (lock held); it may hold rows again,
        written by a same-host writer (then they stay). Its segments are collected by
        the caller's ``free``."""
        self._warm.pop(partition)
        part = self._parts.get(partition)
        if part is not None:
            self._drop_store(partition, part)

    def drop(self, partition: str) -> None:
        with self._lock:
            self._warm.pop(partition, None)
        super().drop(partition)
        with self._lock, self._seg_lock:  # a dropped partition keeps no segments
            for key in [k for k in self._idle if k[0] == partition]:
                seg = self._idle.pop(key)
                self._idle_bytes -= seg.nbytes
                seg.unlink()
            self._epoch[0] += 1
        self._collect(keep=False)

    def layout(self, partition: str, fields: Sequence[str],
               writable: bool = False) -> dict[str, Any]:
        """Where ``partition``'s dense ``fields`` and its slot tokens live.

        Returns:
            ``{"fields": {field: {"shm", "dtype", "shape"}}, "flags": same (each
            field's written flags), "generations": same or None, "epoch": {"shm",
            "value", "stores"}}`` (dense fields only; an unknown partition has
            neither); the layout stays valid while the int64 in segment
            ``epoch["shm"]`` still holds ``epoch["value"]``. With ``writable``, also
            ``"live"`` (the partition's), for a same-host writer of new rows, which
            must also see the second int64 still hold ``epoch["stores"]``.
        """
        out: dict[str, Any] = {}
        flags: dict[str, Any] = {}
        gen = live = None
        with self._lock:
            epoch = {"shm": self._epoch_seg.name, "value": int(self._epoch[0]),
                     "stores": int(self._epoch[STORES])}
            part = self._parts.get(partition)
            if part is not None:
                gen = self._describe(part.gen.data)
                live = self._describe(part.live_flags)
            for f in fields:
                store = part.fields.get(f) if part is not None else None
                if isinstance(store, DenseSlab):
                    lay = self._describe(store.data)
                    if lay is not None:
                        out[f] = lay
                        flags[f] = self._describe(store.flags)
        reply = {"fields": out, "flags": flags, "generations": gen, "epoch": epoch}
        if writable:
            reply["live"] = live
        return reply

    def spans(self, partition: str, slots: np.ndarray, fields: Sequence[str],
              generations: np.ndarray | None = None) -> dict[str, Any]:
        """Where the rows ``slots`` of ``partition``'s multi-ragged ``fields`` lie in
        shared memory, for a same-host reader that views them (``SameHostUnit``).

        Returns:
            ``{field: {"arena": {"shm", "dtype", "shape"}, "start": first element
            per row, "shapes": int64 [n, ndim], "dims"}}``; fields of other kinds, or
            with rows spilled to disk, are left out (``get`` answers). Raises as ``get``
            for rows cleared since their meta was read."""
        slots = np.asarray(slots, dtype=np.int64)
        out: dict[str, Any] = {}
        with self._lock:
            part = self._parts.get(partition)
            if part is None:
                return out
            if generations is not None:
                part.gen.check(partition, slots, generations)
            for f in fields:
                store = part.fields.get(f)
                arena = self._describe(store.values) if isinstance(store, MultiRaggedArena) \
                    and held(store, slots).all() else None  # spilled rows: get answers
                if isinstance(store, MultiRaggedArena) and arena is not None:
                    start, shapes = store.locate(slots)
                    out[f] = {"arena": arena, "start": start, "shapes": shapes,
                              "dims": list(store.dims)}
        return out

    def _describe(self, data: torch.Tensor) -> dict[str, Any] | None:
        seg = self._segments.get(data.data_ptr())
        if seg is None:
            return None
        return {"shm": seg.name, "dtype": str(data.dtype).removeprefix("torch."),
                "shape": list(data.shape)}

    def close(self) -> None:
        super().close()
        with self._lock:
            self._warm.clear()
        with self._seg_lock:
            for seg in [*self._segments.values(), *self._idle.values()]:
                seg.unlink()
            self._segments.clear()
            self._idle.clear()
            self._idle_bytes = 0
            self._epoch[0] += 1
            self._epoch_seg.unlink()


class _SegmentAlloc:
    """A store's allocator in a ``ShmUnit``: new segments, and arenas grown in place by
    extending theirs (``alloc.GrowsInPlace``)."""

    def __init__(self, alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor],
                 grow: Callable[[torch.Tensor, int], torch.Tensor]) -> None:
        self._alloc, self._grow = alloc, grow

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self._alloc(shape, dtype)

    def grow(self, tensor: torch.Tensor, rows: int) -> torch.Tensor:
        return self._grow(tensor, rows)
