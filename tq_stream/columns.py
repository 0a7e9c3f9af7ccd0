"""Column values: the one normalized form every layer below the writer uses.

A batch of n rows of one field travels (to storage, over the wire, out of
storage) as exactly one of:

- ``torch.Tensor`` of shape ``[n, *shape]``: a fixed-shape field;
- ``Ragged(values, offsets)``: a variable-length field; row i is
  ``values[offsets[i]:offsets[i+1]]`` (ragged along the first per-row dim);
- ``MultiRagged(values, shapes, dims)``: rows ragged in several dims (images,
  video), see ``tq_stream.multiragged``;
- ``list`` of n plain Python values (str, int, float, bool, bytes, None,
  lists/dicts of those): a non-tensor field.

``FieldSchema`` records what the first write of a field fixed: its kind, dtype
and per-row shape (for ragged fields, the shape after the ragged dim; for
multi-ragged fields every dim, -1 where it varies per row).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np
import torch

from tq_stream.buffers import indexable, take_spans
from tq_stream.errors import SchemaError
from tq_stream.multiragged import MultiRagged, from_dense, from_ragged
from tq_stream.schemas import FieldSchema, coercible

Column = Any  # torch.Tensor | Ragged | MultiRagged | list; a type alias kept loose for
# msgspec-free layers

# The exact types of the plain scalars an object column holds (immutable, so shared as
# they are); a set of a column's types is checked against it in C.
SCALARS = frozenset({str, int, float, bool, bytes, type(None)})


CONTAINERS = frozenset({dict, list, tuple})


def flat_plain(rows: list[Any], containers: frozenset[type] = CONTAINERS) -> bool:
    """True if every row is a scalar, or a container (of ``containers``: dict with str
    keys, list, tuple) of scalars, all of exact types: the rows a non-tensor field
    usually holds, checked without a Python call per row. False says nothing (a
    deeper value may still be plain)."""
    kinds = set(map(type, rows))
    if kinds <= SCALARS:
        return True
    if not kinds <= SCALARS | containers:
        return False
    if kinds == {dict}:  # the common column of containers: every row a dict
        dicts, seqs = rows, []
    else:
        dicts = [r for r in rows if type(r) is dict]
        seqs = [r for r in rows if type(r) is list or type(r) is tuple]
    keys = set(map(type, chain.from_iterable(dicts)))  # chained in C, no call per row
    inner = set(map(type, chain.from_iterable(map(dict.values, dicts))))
    inner.update(map(type, chain.from_iterable(seqs)))
    return keys <= {str} and inner <= SCALARS


@dataclass(frozen=True)
class Ragged:
    """Variable-length rows: ``values[offsets[i]:offsets[i+1]]`` is row i.

    Args:
        values: tensor ``[total, *tail]`` of all rows concatenated.
        offsets: int64 tensor ``[n + 1]``, starting at 0, non-decreasing.
    """

    values: torch.Tensor
    offsets: torch.Tensor

    def __len__(self) -> int:
        return int(self.offsets.numel()) - 1

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def row(self, i: int) -> torch.Tensor:
        return self.values[int(self.offsets[i]) : int(self.offsets[i + 1])]

    @staticmethod
    def from_list(rows: list[torch.Tensor]) -> Ragged:
        lengths = torch.tensor([int(r.shape[0]) for r in rows], dtype=torch.int64)
        offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        values = torch.cat(rows) if rows else torch.empty(0)
        return Ragged(values, offsets)

    def to_nested(self) -> torch.Tensor:
        """A jagged-layout nested tensor sharing ``values``. Its row-length bounds are
        given: without them, ``to_padded_tensor`` pads to the total length."""
        if not len(self):
            return torch.nested.nested_tensor_from_jagged(self.values, offsets=self.offsets)
        lengths = self.lengths
        return torch.nested.nested_tensor_from_jagged(
            self.values, offsets=self.offsets, min_seqlen=int(lengths.min()),
            max_seqlen=int(lengths.max()))

    def to_padded(self, pad_value: float = 0) -> torch.Tensor:
        """A dense ``[n, max_len, *tail]`` tensor, rows padded at the end."""
        n = len(self)
        lengths = self.lengths
        max_len = int(lengths.max()) if n else 0
        out = self.values.new_full((n, max_len, *self.values.shape[1:]), pad_value)
        if n and max_len:
            pos = torch.arange(max_len).expand(n, max_len)
            mask = pos < lengths.unsqueeze(1)
            out[mask] = self.values
        return out




def dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


_DTYPE_NAMES: dict[torch.dtype, str] = {}  # dtype -> its name, as they are asked for


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise SchemaError(f"dtype must name a torch dtype, got {name!r}")
    return dtype


def schema_of(column: Column) -> FieldSchema:
    """The schema a normalized column implies."""
    if isinstance(column, torch.Tensor):
        return FieldSchema("dense", dtype_name(column.dtype), tuple(column.shape[1:]))
    if isinstance(column, Ragged):
        values = column.values
        return FieldSchema("ragged", dtype_name(values.dtype), tuple(values.shape[1:]))
    if isinstance(column, MultiRagged):
        return FieldSchema("multiragged", dtype_name(column.values.dtype), column.dims)
    return FieldSchema("object")


def coerce(column: Column, fixed: FieldSchema) -> Column | None:
    """``column`` converted to the ``fixed`` schema of its field, or None if it does not fit.

    A dense ``[n, L, *tail]`` tensor becomes ragged rows of length ``L``; ragged rows
    that all have length ``L`` become a dense ``[n, L, *tail]`` tensor; dense, ragged
    or multi-ragged rows whose shapes fit a multi-ragged field become its rows.
    """
    given = schema_of(column)
    if given == fixed:
        return column
    if not coercible(fixed, given):
        return None
    if fixed.kind == "multiragged":
        return _as_multiragged(column).with_dims(fixed.shape)
    if isinstance(column, torch.Tensor):
        n, length = column.shape[0], column.shape[1]
        offsets = torch.arange(n + 1, dtype=torch.int64) * length
        return Ragged(column.reshape(n * length, *column.shape[2:]), offsets)
    assert isinstance(column, Ragged)
    length = fixed.shape[0]
    if not bool((column.lengths == length).all()):
        return None
    lo = int(column.offsets[0])
    values = column.values[lo : lo + len(column) * length]
    return values.reshape(len(column), length, *values.shape[1:])


def coerced(cols: dict[str, Column], fixed: dict[str, Any]) -> dict[str, Column]:
    """Columns converted to their fields' fixed schemas (dicts; SchemaError if one
    cannot be)."""
    out = dict(cols)
    for name, schema in fixed.items():
        want = FieldSchema.from_dict(schema)
        col = coerce(cols[name], want)
        if col is None:
            raise SchemaError(f"field {name!r} must be {want.describe()} (fixed by its first "
                              f"write), got {misfit(cols[name], want)}")
        out[name] = col
    return out


def _as_multiragged(column: Column) -> MultiRagged:
    if isinstance(column, torch.Tensor):
        return from_dense(column, (-1,) * (column.dim() - 1))
    if isinstance(column, Ragged):
        lo, hi = int(column.offsets[0]), int(column.offsets[-1])
        return from_ragged(column.values[lo:hi], column.lengths, (-1,) * column.values.dim())
    assert isinstance(column, MultiRagged)
    return column


def misfit(column: Column, fixed: FieldSchema) -> str:
    """What of ``column`` keeps it from its field's ``fixed`` schema (``coerce`` gave None)."""
    if fixed.kind == "multiragged":
        return _as_multiragged(column).misfit(fixed.shape) or schema_of(column).describe()
    lengths = sorted(set(column.lengths.tolist())) if isinstance(column, Ragged) else []
    return f"ragged rows of lengths {lengths[:8]}"


def column_len(column: Column) -> int:
    return column.shape[0] if isinstance(column, torch.Tensor) else len(column)


def take(column: Column, positions: torch.Tensor) -> Column:
    """Rows ``positions`` of a normalized column (a gather, not a view)."""
    if isinstance(column, torch.Tensor):
        return indexable(column).index_select(0, positions).view(column.dtype)
    if isinstance(column, Ragged):
        return _take_ragged(column, positions)
    if isinstance(column, MultiRagged):
        return column.take(positions)
    return [column[i] for i in positions.tolist()]


def _take_ragged(column: Ragged, positions: torch.Tensor) -> Ragged:
    """Rows ``positions`` of ``column`` in one gather (no Python loop over rows)."""
    pos = positions.numpy().astype(np.int64, copy=False)
    values, offsets = take_spans(column.values, column.offsets.numpy(), pos)
    return Ragged(values, torch.from_numpy(offsets))


def span(column: Column, start: int, stop: int) -> Column:
    """Rows ``start:stop`` of a normalized column, sharing its values (no copy of them)."""
    if isinstance(column, torch.Tensor):
        return column[start:stop]
    if isinstance(column, Ragged):
        offsets = column.offsets[start : stop + 1]
        return Ragged(column.values[int(offsets[0]) : int(offsets[-1])], offsets - offsets[0])
    if isinstance(column, MultiRagged):
        return column.span(start, stop)
    return column[start:stop]


def concat(columns: list[Column]) -> Column:
    """Concatenate normalized columns of one field."""
    first = columns[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(columns)
    if isinstance(first, Ragged):
        values = torch.cat([c.values[int(c.offsets[0]) : int(c.offsets[-1])] for c in columns])
        parts, base = [torch.zeros(1, dtype=torch.int64)], 0
        for c in columns:
            parts.append(c.offsets[1:] - c.offsets[0] + base)
            base += int(c.offsets[-1] - c.offsets[0])
        return Ragged(values, torch.cat(parts))
    if isinstance(first, MultiRagged):
        return MultiRagged.concat(columns)
    out: list[Any] = []
    for c in columns:
        out.extend(c)
    return out
