"""ArenaWrite: the rows of one ragged or multi-ragged field a same-host writer copies
into a unit's arena itself (``DirectWrites.prepare_write``'s ``arenas``).

On the wire a write is ``[kind, dtype, shape, sizes]``:

- ``"ragged"``: ``shape`` is the per-value tail, ``sizes`` the rows' offsets (int64
  ``[n + 1]`` from 0);
- ``"multiragged"``: ``shape`` is the field's dims (``-1`` where a size varies),
  ``sizes`` the rows' shapes (int64 ``[n, ndim]``).

The writer builds it from the column it holds (``ArenaWrite.of``, or None where the
column's values do not add up: that put goes over the socket, which says what is
wrong); the unit checks what it receives (``ArenaWrite.parse``) before any memory is
placed, reserves the rows in its arena (``place``) and answers where their values go.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tq_stream.backends.alloc import Alloc
from tq_stream.backends.slabs import MultiRaggedArena, RaggedArena, Store
from tq_stream.columns import Column, Ragged, dtype_from_name, dtype_name
from tq_stream.errors import ConfigError
from tq_stream.multiragged import MultiRagged
from tq_stream.schemas import ANY

KINDS = ("ragged", "multiragged")
MAX_BYTES = 4 << 30  # values one write may place: what one put message to a unit may carry


@dataclass(frozen=True)
class ArenaWrite:
    """The rows of one field to place in an arena (see the module docstring)."""

    kind: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    sizes: np.ndarray
    total: int  # values (of ``shape``) the rows hold

    @staticmethod
    def of(column: Column) -> ArenaWrite | None:
        """The write of a ragged or multi-ragged column (None for other kinds, and for a
        column whose values are not exactly its rows' values)."""
        if isinstance(column, Ragged):
            offsets = column.offsets.numpy().astype(np.int64, copy=False)
            lo, hi = int(offsets[0]), int(offsets[-1])
            if lo < 0 or hi > column.values.shape[0]:
                return None
            return ArenaWrite("ragged", column.values.dtype, tuple(column.values.shape[1:]),
                              offsets - lo, hi - lo)
        if isinstance(column, MultiRagged):
            total = int(column.lengths.sum())
            if column.values.dim() != 1 or total != column.values.shape[0]:
                return None
            return ArenaWrite("multiragged", column.values.dtype, tuple(column.dims),
                              column.shapes.numpy(), total)
        return None

    @property
    def nbytes(self) -> int:
        """Bytes of the rows' values."""
        tail = self.shape if self.kind == "ragged" else ()
        return self.total * math.prod(tail) * self.dtype.itemsize

    def values(self, column: Column) -> torch.Tensor:
        """The values of ``column`` (the one this write was made ``of``) to copy."""
        if isinstance(column, Ragged):
            lo = int(column.offsets[0])
            values: torch.Tensor = column.values[lo : lo + self.total]
        else:
            values = column.values
        return values

    def wire(self) -> list[object]:
        return [self.kind, dtype_name(self.dtype), list(self.shape), self.sizes]

    @staticmethod
    def parse(field: str, raw: object, rows: int) -> ArenaWrite:
        """A received write of ``rows`` rows, checked.

        Raises:
            ConfigError: naming the field, the rule and the value.
        """
        where = f"arenas[{field!r}]"
        if not (isinstance(raw, list | tuple) and len(raw) == 4 and raw[0] in KINDS
                and isinstance(raw[1], str) and isinstance(raw[2], list | tuple)
                and all(type(d) is int for d in raw[2])):
            raise ConfigError(f"{where} must be [kind in {list(KINDS)}, dtype, shape, sizes], "
                              f"got {str(raw)[:80]}")
        kind, dtype, shape = raw[0], dtype_from_name(raw[1]), tuple(raw[2])
        sizes = np.asarray(raw[3])
        if sizes.dtype != np.int64:
            raise ConfigError(f"{where} sizes must be int64, got {sizes.dtype}")
        if kind == "ragged":
            total = _ragged_total(where, shape, sizes, rows)
        else:
            total = _multi_total(where, shape, sizes, rows)
        write = ArenaWrite(kind, dtype, shape, sizes, total)
        if write.nbytes > MAX_BYTES:
            raise ConfigError(f"{where} must place at most {MAX_BYTES} bytes, got "
                              f"{write.nbytes}")
        return write

    def fits(self, store: Store) -> bool:
        """True if ``store`` is the arena these rows go in as they are."""
        if self.kind == "ragged":
            return isinstance(store, RaggedArena) and store.dtype == self.dtype and \
                tuple(store.tail) == self.shape
        return isinstance(store, MultiRaggedArena) and store.elems.dtype == self.dtype and \
            tuple(store.dims) == self.shape

    def new_store(self, alloc: Alloc) -> Store:
        if self.kind == "ragged":
            return RaggedArena(self.dtype, self.shape, alloc)
        return MultiRaggedArena(self.dtype, self.shape, alloc)

    def place(self, store: Store, slots: np.ndarray) -> int:
        """Reserve the rows in ``store`` (``fits``); where their values go."""
        if isinstance(store, RaggedArena):
            return store.reserve(slots, self.sizes, self.total)
        if isinstance(store, MultiRaggedArena):
            return store.reserve(slots, self.sizes)
        raise ConfigError(f"a {self.kind} write must go to an arena, got {type(store).__name__}")


def appended(columns: object) -> dict[str, int]:
    """Values each ragged or multi-ragged column of a put appends to its arena."""
    if not isinstance(columns, dict):
        return {}
    return {f: int(c.values.shape[0]) for f, c in columns.items()
            if isinstance(c, Ragged | MultiRagged)}


def _ragged_total(where: str, tail: Sequence[int], offsets: np.ndarray, rows: int) -> int:
    if any(d < 0 for d in tail):
        raise ConfigError(f"{where} tail must be sizes >= 0, got {list(tail)}")
    if offsets.shape != (rows + 1,) or offsets[0] != 0 or \
            bool((offsets[1:] < offsets[:-1]).any()):
        raise ConfigError(f"{where} offsets must be {rows + 1} non-decreasing ints from 0, "
                          f"got shape {list(offsets.shape)} starting {offsets[:3].tolist()}")
    return int(offsets[-1])


def _multi_total(where: str, dims: Sequence[int], shapes: np.ndarray, rows: int) -> int:
    if any(d < ANY for d in dims):
        raise ConfigError(f"{where} dims must be sizes or -1, got {list(dims)}")
    if shapes.shape != (rows, len(dims)) or bool((shapes < 0).any()):
        raise ConfigError(f"{where} shapes must be [{rows}, {len(dims)}] sizes >= 0, got "
                          f"shape {list(shapes.shape)}")
    if float(shapes.astype(np.float64).prod(1).sum()) > MAX_BYTES:
        raise ConfigError(f"{where} shapes must hold at most {MAX_BYTES} elements, got more")
    fixed = [d for d, size in enumerate(dims) if size != ANY]
    if fixed and bool((shapes[:, fixed] != np.asarray(dims)[fixed]).any()):
        raise ConfigError(f"{where} shapes must fit dims {list(dims)}, got one that does not")
    return int(shapes.prod(1).sum()) if dims else rows
