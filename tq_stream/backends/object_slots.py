"""ObjectSlots: a store of plain Python values per slot (str, numbers, bytes, lists/dicts)."""

from __future__ import annotations

import copy

import numpy as np

from tq_stream.backends.alloc import MIN_ROWS, check_written, grown, mark_written
from tq_stream.columns import SCALARS


def _own(value: object) -> object:
    """A copy of a mutable plain value (lists/dicts), so storage and callers never share it.

    The exact plain containers are rebuilt here, much cheaper than ``deepcopy`` (a row
    is copied on every put and get); anything else (a dict subclass) is deep-copied.
    """
    kind = type(value)
    if kind in SCALARS:
        return value
    if kind is dict and isinstance(value, dict):  # exactly a dict (isinstance: for mypy)
        if set(map(type, value.values())) <= SCALARS:  # flat: one C-level copy
            return dict(value)
        return {k: _own(v) for k, v in value.items()}
    if kind is list and isinstance(value, list):
        return list(value) if set(map(type, value)) <= SCALARS else [_own(v) for v in value]
    if kind is tuple and isinstance(value, tuple):
        return value if set(map(type, value)) <= SCALARS else tuple(_own(v) for v in value)
    return copy.deepcopy(value) if isinstance(value, list | dict | tuple) else value


def _own_all(values: list[object]) -> list[object]:
    """``[_own(v) for v in values]``, skipping the calls when every value is a scalar."""
    return list(values) if set(map(type, values)) <= SCALARS else [_own(v) for v in values]


class ObjectSlots:
    """Plain Python values (str, numbers, bytes, lists/dicts) per slot.

    Containers are copied on the way in and out: mutating a value passed to
    ``put`` or returned by ``get`` never changes what is stored.
    """

    def __init__(self) -> None:
        self.data = np.empty(MIN_ROWS, dtype=object)
        self.written = np.zeros(MIN_ROWS, dtype=bool)

    def put(self, slots: np.ndarray, values: list[object]) -> None:
        cap = self.data.shape[0]
        top = int(slots.max())
        if top >= cap:
            self.data = np.concatenate([self.data, np.empty(grown(cap, top + 1) - cap, object)])
        if len(values) != len(slots):
            raise ValueError(f"values must have one entry per slot ({len(slots)}), got "
                             f"{len(values)}")
        # fromiter keeps each value whole (an array built from nested lists would not)
        self.data[slots] = np.fromiter(_own_all(values), dtype=object, count=len(values))
        self.written = mark_written(self.written, slots, True)

    def get(self, slots: np.ndarray) -> list[object]:
        check_written(self.written, slots)
        return _own_all(self.data[slots].tolist())

    def free(self, slots: np.ndarray) -> None:
        slots = slots[slots < self.data.shape[0]]
        self.data[slots] = None
        self.written[slots[slots < self.written.shape[0]]] = False

    def nbytes(self) -> int:
        return self.data.nbytes
