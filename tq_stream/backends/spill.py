"""Spilling: a partition's memory budget, and the column values a unit keeps on disk.

A storage unit holds each partition's column bytes in memory (its heap, or shared
memory) up to the partition's ``memory_budget``; what goes past it lives on local disk
and is read back on demand by ``get``. The rules a unit keeps (``Spill``):

- A field marked *cold* (``create_partition(cold=...)``, ``Stream.mark_cold``) is kept on
  disk only: its rows already in memory move there when it is marked, later puts write
  there. A read of it reads the files of the rows asked for.
- Every other field is kept in memory. A store that would grow past the budget (the
  bytes of the partition's stores, counting the new allocation whole: what a growth by
  copy holds at its peak) is refused with ``MemoryBudgetExceeded``: the writer aborts its
  rows and puts again within its timeout, so a producer ahead of its consumers waits for
  their acks to free rows; nothing is written past the budget, ever. A put whose own rows
  need more than the budget (``least_bytes``) is refused first with
  ``MemoryBudgetTooSmall``, not put again: freeing rows cannot make room for it.

Files live in one private folder per unit (``tq_spill_<pid>_*``, mode 0700) under the
owner's ``spill_dir``; their names are counters (no client string reaches a path), one
file per put of a field (``recordfile``, checksummed, no fsync: scratch data), removed
once none of its rows lives, and the folder with the unit's ``close``.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable

import numpy as np
import torch

from tq_stream import recordfile
from tq_stream.backends.alloc import Alloc, Extends, GrowsInPlace
from tq_stream.columns import Column, Ragged, concat, take
from tq_stream.errors import (
    ConfigError,
    KeyConflictError,
    MemoryBudgetExceeded,
    MemoryBudgetTooSmall,
)
from tq_stream.multiragged import MultiRagged

MAX_PARTITIONS = 4096  # partitions a unit keeps settings for: a client cannot grow more
MIN_BUDGET = 4096  # bytes: a smaller memory_budget is refused when set
MIN_ROWS = 16  # rows a store of a field holds at least (``slabs``)


def check_spill_dir(value: object) -> str | None:
    """``spill_dir`` as an absolute folder path (None: the system's temporary folder),
    or ConfigError naming it."""
    if value is None:
        return None
    if not isinstance(value, str) or not os.path.isabs(value) or \
            (os.path.exists(value) and not os.path.isdir(value)):
        raise ConfigError(f"spill_dir must be an absolute path of a folder (made if "
                          f"missing), got {value!r}")
    return value


def check_budget(value: object) -> int | None:
    """``memory_budget`` as bytes (None: unbounded), or ConfigError naming it."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < MIN_BUDGET:
        raise ConfigError(f"memory_budget must be a number of bytes of at least {MIN_BUDGET} "
                          f"(one page; a store holds at least {MIN_ROWS} rows of each "
                          f"in-memory field) or None, got {value!r}")
    return value


def least_bytes(column: Column) -> int:
    """Bytes a store needs at least to hold ``column``'s rows: a dense field at least
    ``MIN_ROWS`` rows, a ragged one its values (object values are not counted)."""
    if isinstance(column, (Ragged, MultiRagged)):
        return int(column.values.numel()) * column.values.element_size()
    if isinstance(column, torch.Tensor) and not column.is_nested and column.dim() > 0:
        return least_dense(int(column.shape[0]), tuple(column.shape[1:]), column.dtype)
    return 0


def least_dense(rows: int, shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes a dense slab needs at least to hold ``rows`` rows of ``shape``."""
    return _bytes((max(rows, MIN_ROWS), *shape), dtype) if rows else 0


def check_cold(value: object) -> frozenset[str]:
    """``cold`` as field names, or ConfigError naming it."""
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise ConfigError(f"cold must be a list of field names, got {value!r}")
    names = list(value)
    bad = [n for n in names if not isinstance(n, str) or not n]
    if bad:
        raise ConfigError(f"cold must be a list of field names, got {bad!r} in it")
    return frozenset(names)


def _bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()


class Bounded:
    """An allocator that asks ``check(bytes)`` before each allocation (which raises to
    refuse it): the whole new tensor counts, since a growth by copy holds both."""

    def __init__(self, inner: Alloc, check: Callable[[int], None]) -> None:
        self._inner, self._check = inner, check

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        self._check(_bytes(shape, dtype))
        return self._inner(shape, dtype)


class BoundedInPlace(Bounded):
    """``Bounded`` for an allocator that grows in place: a growth counts its new rows."""

    def __init__(self, inner: GrowsInPlace, check: Callable[[int], None]) -> None:
        super().__init__(inner, check)
        self._grows = inner

    def grow(self, tensor: torch.Tensor, rows: int) -> torch.Tensor:
        self._check(_bytes((rows - tensor.shape[0], *tensor.shape[1:]), tensor.dtype))
        return self._grows.grow(tensor, rows)


class BoundedExtends(Bounded):
    """``Bounded`` for an allocator that extends a tensor (``alloc.Extends``): an
    extension counts what it holds beyond the tensor at its peak."""

    def __init__(self, inner: Extends, check: Callable[[int], None]) -> None:
        super().__init__(inner, check)
        self._extends = inner

    def extend(self, tensor: torch.Tensor, rows: int, used: int) -> torch.Tensor:
        self._check(self._extends.extra_bytes(tensor, rows))
        return self._extends.extend(tensor, rows, used)

    def extra_bytes(self, tensor: torch.Tensor, rows: int) -> int:
        return self._extends.extra_bytes(tensor, rows)


def bounded(inner: Alloc, check: Callable[[int], None]) -> Alloc:
    """``inner`` asking ``check`` first (growing in place, or extending, if ``inner``
    does)."""
    if isinstance(inner, GrowsInPlace):
        return BoundedInPlace(inner, check)
    if isinstance(inner, Extends):
        return BoundedExtends(inner, check)
    return Bounded(inner, check)


class DiskColumn:
    """One field's rows of one partition, in files of the rows each put wrote."""

    def __init__(self, folder: str, names: itertools.count[int]) -> None:
        self._folder, self._names = folder, names
        self._file = np.full(16, -1, dtype=np.int64)  # per slot: its file (-1: none)
        self._pos = np.zeros(16, dtype=np.int64)  # per slot: its row in that file
        self._files: dict[int, list[int]] = {}  # file -> [rows alive, bytes, rows written]

    def _path(self, name: int) -> str:
        return os.path.join(self._folder, f"{name}.col")

    def holds(self, slots: np.ndarray) -> np.ndarray:
        inside = slots < self._file.shape[0]
        out = np.zeros(len(slots), dtype=bool)
        out[inside] = self._file[slots[inside]] >= 0
        return out

    def put(self, slots: np.ndarray, column: Column) -> None:
        self.free(slots)
        name = next(self._names)
        path = self._path(name)
        recordfile.write(path, [{"column": column}], durable=False)
        top = int(slots.max()) + 1
        if top > self._file.shape[0]:
            n = max(top, 2 * self._file.shape[0])
            self._file = np.concatenate([self._file, np.full(n - self._file.shape[0], -1)])
            self._pos = np.concatenate([self._pos, np.zeros(n - self._pos.shape[0], np.int64)])
        self._file[slots] = name
        self._pos[slots] = np.arange(len(slots))
        self._files[name] = [len(slots), os.path.getsize(path), len(slots)]

    def get(self, slots: np.ndarray) -> Column:
        """Rows ``slots`` in order (KeyConflictError for a slot this holds none of)."""
        if not self.holds(slots).all():
            bad = slots[~self.holds(slots)][:5].tolist()
            raise KeyConflictError(f"slots must hold a value to be read, got slots {bad} "
                                   f"that were never written or were freed")
        files = self._file[slots]
        parts, order = [], []
        for name in dict.fromkeys(files.tolist()):  # each file read once, first seen first
            (record,) = recordfile.read(self._path(name))
            at = np.flatnonzero(files == name)
            parts.append(take(record["column"], torch.from_numpy(self._pos[slots[at]])))
            order.append(at)
        column = parts[0] if len(parts) == 1 else concat(parts)
        where = np.concatenate(order)
        if (where[1:] > where[:-1]).all():
            return column
        return take(column, torch.from_numpy(np.argsort(where)))

    def free(self, slots: np.ndarray) -> None:
        slots = slots[self.holds(slots)]
        names, counts = np.unique(self._file[slots], return_counts=True)
        self._file[slots] = -1
        for name, n in zip(names.tolist(), counts.tolist(), strict=True):
            entry = self._files[name]
            entry[0] -= n
            if entry[0] == 0:
                del self._files[name]
                os.unlink(self._path(name))

    def row_bytes(self, slots: np.ndarray) -> np.ndarray:
        """About the bytes of each row (its file's bytes over the rows written to it)."""
        out = np.zeros(len(slots), dtype=np.int64)
        held = self.holds(slots)
        for name in np.unique(self._file[slots[held]]).tolist():
            _, size, rows = self._files[name]
            out[held & (self._file[np.minimum(slots, len(self._file) - 1)] == name)] = \
                size // rows
        return out

    def nbytes(self) -> int:
        return sum(entry[1] for entry in self._files.values())

    def drop(self) -> None:
        self.free(np.flatnonzero(self._file >= 0).astype(np.int64))


def merged(slots: np.ndarray, on_disk: np.ndarray, memory: Callable[[np.ndarray], Column],
           disk: Callable[[np.ndarray], Column]) -> Column:
    """Rows ``slots`` in order, those ``on_disk`` read by ``disk``, the others by
    ``memory``."""
    if on_disk.all():
        return disk(slots)
    if not on_disk.any():
        return memory(slots)
    where = np.concatenate([np.flatnonzero(~on_disk), np.flatnonzero(on_disk)])
    column = concat([memory(slots[~on_disk]), disk(slots[on_disk])])
    return take(column, torch.from_numpy(np.argsort(where)))


class Spill:
    """A unit's budgets, cold fields and disk columns, per partition (module doc)."""

    def __init__(self, spill_dir: str | None = None) -> None:
        self._root = spill_dir
        self._folder = ""  # made on first use
        self._names = itertools.count()
        self.budgets: dict[str, int] = {}
        self.cold: dict[str, frozenset[str]] = {}
        self.columns: dict[str, dict[str, DiskColumn]] = {}

    def set(self, partition: str, budget: int | None, cold: frozenset[str]) -> None:
        known = set(self.budgets) | set(self.cold)
        if partition not in known and len(known) >= MAX_PARTITIONS:
            raise ConfigError(f"partition must be one of the {MAX_PARTITIONS} this unit "
                              f"keeps memory settings for, got a new one {partition!r}")
        if budget is not None:  # None: as it was
            self.budgets[partition] = budget
        self.cold[partition] = self.cold.get(partition, frozenset()) | cold

    def settings(self) -> dict[str, dict[str, object]]:
        """``{partition: {"budget", "cold"}}`` of every partition with a setting."""
        return {p: {"budget": self.budgets.get(p), "cold": sorted(self.cold.get(p, ()))}
                for p in set(self.budgets) | set(self.cold)}

    def is_cold(self, partition: str, field: str) -> bool:
        return field in self.cold.get(partition, ())

    def column(self, partition: str, field: str) -> DiskColumn:
        """The disk column of ``field`` (made on first use)."""
        cols = self.columns.setdefault(partition, {})
        if field not in cols:
            cols[field] = DiskColumn(self._ensure_folder(), self._names)
        return cols[field]

    def on_disk(self, partition: str, field: str) -> DiskColumn | None:
        return self.columns.get(partition, {}).get(field)

    def _ensure_folder(self) -> str:
        if not self._folder:
            root = self._root or tempfile.gettempdir()
            os.makedirs(root, mode=0o700, exist_ok=True)
            self._folder = tempfile.mkdtemp(prefix=f"tq_spill_{os.getpid()}_", dir=root)
        return self._folder

    def check_fits(self, partition: str, need: int, rows: int) -> None:
        """Raise MemoryBudgetTooSmall if a put of ``rows`` rows needs more than the budget
        by itself (``need``: its ``least_bytes``): freeing rows cannot help."""
        budget = self.budgets.get(partition)
        if budget is not None and need > budget:
            raise MemoryBudgetTooSmall(
                f"memory_budget of partition {partition!r} is {budget} bytes, less than "
                f"the {need} bytes this put's {rows} rows need in memory by themselves (a "
                f"store holds at least {MIN_ROWS} rows of each in-memory field): it can "
                f"never fit however many rows are freed (raise memory_budget to at least "
                f"{need}, mark large fields cold, or put fewer rows at a time)")

    def fits(self, partition: str, held: int, need: int) -> bool:
        """True if ``need`` more bytes fit beside ``held`` within the budget (or none)."""
        budget = self.budgets.get(partition)
        return budget is None or held + need <= budget

    def check_room(self, partition: str, held: int, need: int,
                   live: Callable[[], int]) -> None:
        """Raise MemoryBudgetExceeded unless ``need`` more bytes fit beside ``held``
        (``live()``: the bytes of those that live rows hold, for the message)."""
        if not self.fits(partition, held, need):
            budget = self.budgets[partition]
            rows = live()
            raise MemoryBudgetExceeded(
                f"memory_budget of partition {partition!r} is {budget} bytes; its stores "
                f"take {held} ({rows} held by live rows, {held - rows} room reserved in "
                f"stores of at least {MIN_ROWS} rows that grow ahead of their rows) and must grow "
                f"by {need} for this put, and nothing more can spill (the put is made "
                f"again within its timeout, as acks free rows; or mark large fields cold, "
                f"declare consumers, bound rows with capacity=, or raise memory_budget)")

    def spilled(self, partition: str) -> int:
        return sum(c.nbytes() for c in self.columns.get(partition, {}).values())

    def drop(self, partition: str) -> None:
        for col in self.columns.pop(partition, {}).values():
            col.drop()

    def free(self, partition: str, slots: np.ndarray) -> None:
        for col in self.columns.get(partition, {}).values():
            col.free(slots)

    def close(self) -> None:
        self.columns.clear()
        if self._folder:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = ""
