"""TagTable: small per-row metadata as typed numpy columns.

A tag's column type follows its values: bool -> bool, int -> int64,
float (or int mixed with float) -> float64, anything else (str, None, bool
mixed with numbers...) -> object; a column only ever widens along
bool/int -> float -> object, and bool never mixes with numbers (True must not
read back as 1.0). ``present`` marks the rows that have a tag, so int and bool
columns keep their exact values; ``get`` shows a row without the tag as NaN (None
for bool and object columns), so a missing value is always visible to samplers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from tq_stream.checks import TagValue
from tq_stream.errors import ConfigError

_ENTRY_KEYS = {"kind", "rows", "values"}


def _kind_of(values: list[TagValue]) -> str:
    kinds = {type(v) for v in values}
    if kinds == {bool}:
        return "bool"
    if kinds <= {int}:
        return "int"
    if kinds <= {int, float}:
        return "float"
    return "object"


_DTYPES = {"bool": np.bool_, "int": np.int64, "float": np.float64, "object": object}
_RANK = {"bool": 0, "int": 1, "float": 2, "object": 3}


def _missing(kind: str) -> Any:
    return np.nan if kind == "float" else None


class TagTable:
    """Columns of tags for rows ``0..capacity-1``; ``present`` marks set cells."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.columns: dict[str, np.ndarray] = {}
        self.present: dict[str, np.ndarray] = {}
        self.kinds: dict[str, str] = {}
        # cells set from a Python int: a float column (ints mixed with floats) gives
        # them back as ints, exact up to 2**53 (an all-int column is exact anyway)
        self.ints: dict[str, np.ndarray] = {}

    def grow(self, capacity: int) -> None:
        extra = capacity - self.capacity
        for name, col in self.columns.items():
            kind = self.kinds[name]
            if kind in ("float", "object"):
                pad: np.ndarray = np.full(extra, _missing(kind), dtype=_DTYPES[kind])
            else:
                pad = np.zeros(extra, dtype=col.dtype)
            self.columns[name] = np.concatenate([col, pad])
            self.present[name] = np.concatenate([self.present[name], np.zeros(extra, bool)])
            self.ints[name] = np.concatenate([self.ints[name], np.zeros(extra, bool)])
        self.capacity = capacity

    def _column(self, name: str, kind: str) -> np.ndarray:
        old = self.kinds.get(name)
        if old is None:
            fill = _missing(kind)
            col: np.ndarray = np.full(self.capacity, fill, dtype=_DTYPES[kind]) \
                if fill is not None or kind == "object" else \
                np.zeros(self.capacity, dtype=_DTYPES[kind])
            self.columns[name], self.present[name], self.kinds[name] = col, \
                np.zeros(self.capacity, bool), kind
            self.ints[name] = np.zeros(self.capacity, bool)
        elif kind != old and old != "object":
            if "bool" in (kind, old) or "object" in (kind, old):
                self._promote(name, "object")
            elif _RANK[kind] > _RANK[old]:
                self._promote(name, kind)
        return self.columns[name]

    def _promote(self, name: str, kind: str) -> None:
        col, present = self.columns[name], self.present[name]
        new: np.ndarray = np.full(self.capacity, _missing(kind), dtype=_DTYPES[kind])
        if kind == "object":
            rows = np.flatnonzero(present)
            for r, v in zip(rows.tolist(), self.values(name, rows), strict=True):
                new[r] = v
        else:
            new[present] = col[present]
        self.columns[name], self.kinds[name] = new, kind

    def set(self, rows: np.ndarray, tags: list[dict[str, TagValue]]) -> None:
        """Set (merge) ``tags[i]`` on row ``rows[i]``."""
        names: dict[str, tuple[list[int], list[TagValue]]] = {}
        for r, row in zip(rows.tolist(), tags, strict=True):
            for k, v in row.items():
                pos, vals = names.setdefault(k, ([], []))
                pos.append(r)
                vals.append(v)
        for name, (pos, vals) in names.items():
            kind = _kind_of(vals)
            col = self._column(name, kind)
            idx = np.asarray(pos, dtype=np.int64)
            if self.kinds[name] == "object":
                for i, v in zip(pos, vals, strict=True):
                    col[i] = v
            else:
                col[idx] = vals
            self.present[name][idx] = True
            self.ints[name][idx] = [type(v) is int for v in vals]

    def clear(self, rows: np.ndarray) -> None:
        for name, col in self.columns.items():
            self.present[name][rows] = False
            self.ints[name][rows] = False
            kind = self.kinds[name]
            if kind in ("float", "object"):
                col[rows] = _missing(kind)

    def get(self, name: str, rows: np.ndarray) -> np.ndarray:
        values: np.ndarray = self.columns[name][rows]
        kind = self.kinds[name]
        if kind in ("int", "bool"):
            present = self.present[name][rows]
            if not present.all():  # show the missing rows (exact values stay in the column)
                values = values.astype(np.float64 if kind == "int" else object)
                values[~present] = np.nan if kind == "int" else None
        return values

    def values(self, name: str, rows: np.ndarray) -> list[Any]:
        """Python values of column ``name`` at ``rows`` (rows that have the tag); a cell
        set from an int is an int again, also in a float column."""
        values: list[Any] = self.columns[name][rows].tolist()
        if self.kinds[name] == "float":
            for i in np.flatnonzero(self.ints[name][rows]).tolist():
                values[i] = int(values[i])
        return values

    def rows_as_dicts(self, rows: np.ndarray) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [{} for _ in range(len(rows))]
        for name in self.columns:
            present = self.present[name][rows]
            if not present.any():
                continue
            values = self.values(name, rows)
            for i in np.flatnonzero(present).tolist():
                out[i][name] = values[i]
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            name: {"kind": self.kinds[name], "rows": np.flatnonzero(self.present[name]),
                   "values": self.values(name, np.flatnonzero(self.present[name]))}
            for name in self.columns
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for name, entry in state.items():
            if not isinstance(entry, Mapping) or set(entry) != _ENTRY_KEYS \
                    or entry["kind"] not in _DTYPES:
                raise ConfigError(f"tag state {name!r} must be a dict with keys "
                                  f"{sorted(_ENTRY_KEYS)} and a known kind, got {entry!r:.80}")
        for name, entry in state.items():
            rows = np.asarray(entry["rows"], dtype=np.int64)
            kind = entry["kind"]
            col = self._column(name, kind)
            if kind == "object":
                for r, v in zip(rows.tolist(), entry["values"], strict=True):
                    col[r] = v
            else:
                col[rows] = entry["values"]
            self.present[name][rows] = True
            self.ints[name][rows] = [type(v) is int for v in entry["values"]]
