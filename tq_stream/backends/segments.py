"""Segments: mapped /dev/shm files, as a storage unit makes and grows them (``Segment``)
and as a same-host client maps them (``ShmReader``); see ``tq_stream.backends.shm``."""

from __future__ import annotations

import mmap
import os
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from tq_stream.errors import StateError
from tq_stream.forksafe import ForkSafeLock

SHM_DIR = "/dev/shm"


class Segment:
    """One mapped /dev/shm file."""

    def __init__(self, name: str, size: int, create: bool) -> None:
        self.name = name
        # What a unit allocated it for (see ShmUnit): store key, dtype, shape, bytes and
        # an allocation sequence number.
        self.key: tuple[str, ...] | None = None
        self.dtype: torch.dtype | None = None
        self.shape: tuple[int, ...] = ()
        self.nbytes = size
        self.seq = 0
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

    def extend(self, size: int) -> None:
        """Grow the file to ``size`` bytes and map all of it; the bytes stay where they
        are, and a tensor over the old mapping stays valid (it keeps that mapping)."""
        fd = os.open(os.path.join(SHM_DIR, self.name), os.O_RDWR)
        try:
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.nbytes = size

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


class ShmReader:
    """A client-side cache of mapped segments (bounded; least recently used evicted)."""

    def __init__(self, max_segments: int = 64) -> None:
        self._maps: OrderedDict[str, Segment] = OrderedDict()
        self._max = max_segments
        self._lock = ForkSafeLock()  # a producer thread's put may hold it at a fork

    def view(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        need = int(np.prod(shape)) * dtype.itemsize
        with self._lock:
            seg = self._maps.get(name)
            if seg is None or len(seg.map) < need:  # new, or an arena grew in place
                try:
                    seg = Segment(name, 0, create=False)
                except FileNotFoundError:
                    raise StateError(f"shared-memory segment {name!r} is gone (its slab "
                                     f"grew or its unit stopped); retry the read") from None
                self._maps[name] = seg
                while len(self._maps) > self._max:
                    self._maps.popitem(last=False)
            self._maps.move_to_end(name)
        return seg.tensor(dtype, shape)

    def forget(self, names: set[str]) -> None:
        """Drop the mappings of segments ``names`` (a later view maps them again)."""
        with self._lock:
            for name in names:
                self._maps.pop(name, None)

    def forget_gone(self) -> int:
        """Drop the mappings of segments their unit has unlinked (grown out, freed, or
        of a unit that died); returns how many. The memory of such a segment is
        returned once no tensor over it is left, so a client that once read a large
        batch does not keep it alive. Cheap enough for every layout change: one
        ``stat`` per cached segment."""
        with self._lock:
            gone = [n for n in self._maps if not os.path.exists(os.path.join(SHM_DIR, n))]
            for name in gone:
                del self._maps[name]
        return len(gone)

    def current(self, layout: dict[str, Any] | None, slots: np.ndarray,
                generations: np.ndarray) -> bool:
        """True if every slot holds the row of its token (seqlock check after a copy)."""
        if layout is None:
            return False
        tokens = self.view(layout["shm"], torch.int64, tuple(layout["shape"]))
        if len(slots) and int(slots.max()) >= tokens.shape[0]:
            return False
        seen = tokens.index_select(0, torch.from_numpy(slots))
        return bool(torch.equal(seen, torch.from_numpy(np.asarray(generations, np.int64))))
