"""Shared-memory storage: a unit whose dense slabs live in /dev/shm segments.

The unit process owns the segments (creates, grows, unlinks them); a client
on the same host asks the unit for a field's ``layout`` (segment name, dtype,
shape) and gathers rows straight out of the mapped segment: one copy, no
socket for the bytes. A slab that grows moves to a new segment and the old
one is unlinked; a reader that still maps it keeps a valid (older) view, which
holds every row committed before its ``get_meta``. Segment names carry the
owner's pid (``tq_<pid>_<n>``), so segments of a unit that died are found and
removed by ``sweep_stale`` (called by every new unit and by the deployment).
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tq_stream.backends.memory import MemoryUnit
from tq_stream.backends.slabs import DenseSlab
from tq_stream.errors import StateError

SHM_DIR = "/dev/shm"
PREFIX = "tq_"


def shm_available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(pids: Sequence[int] | None = None) -> int:
    """Remove segments of dead owners (or of ``pids``); returns how many were removed."""
    removed = 0
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    for name in names:
        if not name.startswith(PREFIX):
            continue
        try:
            pid = int(name.split("_")[1])
        except (IndexError, ValueError):
            continue
        if (pids is not None and pid in pids) or (pids is None and not _pid_alive(pid)):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed += 1
            except OSError:
                pass
    return removed


class _Segment:
    """One mapped /dev/shm file."""

    def __init__(self, name: str, size: int, create: bool) -> None:
        self.name = name
        path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, max(size, 1))
            else:
                size = os.fstat(fd).st_size
            self.map = mmap.mmap(fd, max(size, 1))
        finally:
            os.close(fd)

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        count = int(np.prod(shape)) if shape else 1
        flat = torch.frombuffer(self.map, dtype=dtype, count=count) if count else \
            torch.empty(0, dtype=dtype)
        return flat.view(shape)

    def unlink(self) -> None:
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            pass


class ShmUnit(MemoryUnit):
    """A MemoryUnit whose dense slabs live in shared memory (see module docstring)."""

    def __init__(self) -> None:
        sweep_stale()
        self._segments: dict[int, _Segment] = {}  # data_ptr of a slab -> its segment
        self._counter = itertools.count()
        self._seg_lock = threading.Lock()
        super().__init__(alloc=self._alloc_dense)

    def _alloc_dense(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
        name = f"{PREFIX}{os.getpid()}_{next(self._counter)}"
        seg = _Segment(name, nbytes, create=True)
        t = seg.tensor(dtype, shape)
        with self._seg_lock:
            self._segments[t.data_ptr()] = seg
        return t

    def _live_ptrs(self) -> set[int]:
        return {s.data.data_ptr() for p in self._parts.values() for s in p.fields.values()
                if isinstance(s, DenseSlab)} | {
            s.values.data_ptr() for p in self._parts.values() for s in p.fields.values()
            if hasattr(s, "values")}

    def _collect(self) -> None:
        """Unlink segments no slab uses any more (after growth, free or drop)."""
        with self._lock:
            live = self._live_ptrs()
        with self._seg_lock:
            for ptr in [p for p in self._segments if p not in live]:
                self._segments.pop(ptr).unlink()

    def put(self, partition: str, slots: np.ndarray, columns: Any) -> None:
        super().put(partition, slots, columns)
        self._collect()

    def free(self, partition: str, slots: np.ndarray) -> None:
        super().free(partition, slots)
        self._collect()

    def drop(self, partition: str) -> None:
        super().drop(partition)
        self._collect()

    def layout(self, partition: str, fields: Sequence[str]) -> dict[str, Any]:
        """Where each dense field of ``partition`` lives: segment, dtype, shape."""
        out: dict[str, Any] = {}
        with self._lock:
            part = self._parts.get(partition)
            for f in fields:
                store = part.fields.get(f) if part is not None else None
                if isinstance(store, DenseSlab):
                    seg = self._segments.get(store.data.data_ptr())
                    if seg is not None:
                        out[f] = {"shm": seg.name, "dtype": str(store.dtype).removeprefix(
                            "torch."), "shape": list(store.data.shape)}
        return out

    def close(self) -> None:
        super().close()
        with self._seg_lock:
            for seg in self._segments.values():
                seg.unlink()
            self._segments.clear()


class ShmReader:
    """A client-side cache of mapped segments (bounded; least recently used evicted)."""

    def __init__(self, max_segments: int = 64) -> None:
        self._maps: OrderedDict[str, _Segment] = OrderedDict()
        self._max = max_segments
        self._lock = threading.Lock()

    def view(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        with self._lock:
            seg = self._maps.get(name)
            if seg is None:
                try:
                    seg = _Segment(name, 0, create=False)
                except FileNotFoundError:
                    raise StateError(f"shared-memory segment {name!r} is gone (its slab "
                                     f"grew or its unit stopped); retry the read") from None
                self._maps[name] = seg
                while len(self._maps) > self._max:
                    self._maps.popitem(last=False)
            self._maps.move_to_end(name)
        return seg.tensor(dtype, shape)
