"""MultiRagged: rows of tensors ragged in more than one dim (images, video).

An image field holds ``[3, H, W]`` rows with H and W per row; a video field
``[T, 3, H, W]`` rows with T, H and W per row. A column of n such rows is the
rows' elements one after the other (``values``, 1-D, each row in C order) plus
each row's shape (``shapes``, int64 ``[n, ndim]``); row i is the slice
``values[offsets[i]:offsets[i+1]]`` viewed as ``shapes[i]``, so reading a row
copies nothing.

``dims`` is the field's per-row shape pattern: a size for a dim every row has
(the channels), ``-1`` (shown ``*``) for a dim that varies per row. The schema
``FieldSchema("multiragged", "uint8", (3, -1, -1))`` reads ``uint8[3, *, *]``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tq_stream.buffers import take_spans
from tq_stream.errors import SchemaError
from tq_stream.schemas import ANY, pattern


@dataclass(frozen=True)
class MultiRagged:
    """Rows of one dtype and ndim, ragged in any of their dims.

    Args:
        values: 1-D tensor of every row's elements, row after row.
        shapes: int64 tensor ``[n, ndim]``, row i's shape.
        dims: ``ndim`` sizes, ``-1`` where the size varies per row.

    Example:
        >>> images = [torch.zeros(3, 120, 300, dtype=torch.uint8),
        ...           torch.zeros(3, 240, 100, dtype=torch.uint8)]
        >>> col = MultiRagged.from_list(images, fixed_dims=(0,))
        >>> col.dims, [tuple(r.shape) for r in col.rows()]
        ((3, -1, -1), [(3, 120, 300), (3, 240, 100)])
    """

    values: torch.Tensor
    shapes: torch.Tensor
    dims: tuple[int, ...]

    def __len__(self) -> int:
        return int(self.shapes.shape[0])

    @property
    def lengths(self) -> torch.Tensor:
        """Elements per row (int64 ``[n]``)."""
        return self.shapes.prod(1) if self.dims else torch.ones(len(self), dtype=torch.int64)

    @property
    def offsets(self) -> torch.Tensor:
        """Where each row starts in ``values`` (int64 ``[n + 1]``, from 0)."""
        offsets = torch.zeros(len(self) + 1, dtype=torch.int64)
        torch.cumsum(self.lengths, 0, out=offsets[1:])
        return offsets

    @staticmethod
    def from_list(rows: Sequence[torch.Tensor], fixed_dims: Sequence[int] = (),
                  field: str = "rows") -> MultiRagged:
        """Rows of one dtype and ndim as a column (their elements copied once).

        Args:
            rows: the tensors, one per row.
            fixed_dims: dims whose size every row of the field has (the channels of
                ``[3, H, W]`` images: ``(0,)``); every other dim varies per row.
            field: the name errors give the rows.

        Raises:
            SchemaError: rows of other dtypes or ndims, or a fixed dim that differs.
        """
        if not rows:
            raise SchemaError(f"field {field!r} must hold at least one row, got none")
        first = rows[0]
        kinds = {(r.dtype, r.dim()) for r in rows}
        if len(kinds) != 1:
            raise SchemaError(f"field {field!r} rows must share dtype and ndim, got "
                              f"{sorted(map(str, kinds))[:4]}")
        shapes = torch.tensor([list(r.shape) for r in rows], dtype=torch.int64)
        shapes = shapes.reshape(len(rows), first.dim())
        dims = [ANY] * first.dim()
        for d in fixed_dims:
            if not (isinstance(d, int) and 0 <= d < first.dim()):
                raise SchemaError(f"fixed_dims must be dims of the rows (0..{first.dim() - 1}),"
                                  f" got {list(fixed_dims)}")
            sizes = torch.unique(shapes[:, d]).tolist()
            if len(sizes) != 1:
                raise SchemaError(f"field {field!r} rows must share the size of fixed dim "
                                  f"{d}, got sizes {sizes[:8]}")
            dims[d] = sizes[0]
        values = torch.cat([r.detach().cpu().reshape(-1) for r in rows])
        return MultiRagged(values, shapes, tuple(dims))

    def problem(self) -> str | None:
        """What makes this column malformed, or None (checked on what a user or a peer
        hands in: the rows' elements must add up to ``values``)."""
        values, shapes = self.values, self.shapes
        if not isinstance(values, torch.Tensor) or not isinstance(shapes, torch.Tensor):
            return f"values and shapes must be tensors, got {type(values).__name__} and " \
                   f"{type(shapes).__name__}"
        if values.dim() != 1 or values.layout != torch.strided or values.is_nested:
            return f"values must be a 1-D strided tensor, got shape {list(values.shape)}"
        if shapes.dtype != torch.int64 or shapes.dim() != 2 or \
                shapes.shape[1] != len(self.dims):
            return f"shapes must be int64 [n, {len(self.dims)}], got {shapes.dtype} " \
                   f"{list(shapes.shape)}"
        if not all(type(d) is int and d >= ANY for d in self.dims):
            return f"dims must be sizes or -1, got {list(self.dims)}"
        if len(self) and bool((shapes < 0).any()):
            return "shapes must not be negative"
        bad = self.misfit(self.dims)
        if bad:
            return bad
        total = int(self.lengths.sum())
        if total != values.shape[0]:
            return f"rows hold {total} elements, values has {values.shape[0]}"
        return None

    def misfit(self, dims: Sequence[int]) -> str | None:
        """None if every row fits the pattern ``dims``, else the first row that does not."""
        if len(dims) != len(self.dims):
            return f"rows of {len(self.dims)} dims (the field's have {len(dims)})"
        fixed = [d for d, size in enumerate(dims) if size != ANY]
        if not fixed or not len(self):
            return None
        want = torch.tensor([dims[d] for d in fixed], dtype=torch.int64)
        wrong = (self.shapes[:, fixed] != want).any(1)
        if not bool(wrong.any()):
            return None
        i = int(torch.nonzero(wrong)[0])
        return f"row {i} of shape {self.shapes[i].tolist()} (the field's is {pattern(dims)})"

    def with_dims(self, dims: Sequence[int]) -> MultiRagged | None:
        """The same rows under the pattern ``dims``; None if a row does not fit it."""
        if self.misfit(dims):
            return None
        return MultiRagged(self.values, self.shapes, tuple(dims))

    def row(self, i: int) -> torch.Tensor:
        """Row ``i``, a view of ``values``."""
        lo = int(self.lengths[:i].sum())
        shape = self.shapes[i].tolist()
        return self.values[lo : lo + int(np.prod(shape))].view(shape)

    def rows(self) -> list[torch.Tensor]:
        """Each row as a view of ``values`` (no copy)."""
        bounds = self.offsets.tolist()
        return [self.values[lo:hi].view(shape) for lo, hi, shape in
                zip(bounds[:-1], bounds[1:], self.shapes.tolist(), strict=True)]

    def take(self, positions: torch.Tensor) -> MultiRagged:
        """Rows ``positions`` in one gather (no Python loop over rows)."""
        pos = positions.numpy().astype(np.int64, copy=False)
        values, _ = take_spans(self.values, self.offsets.numpy(), pos)
        return MultiRagged(values, self.shapes[positions], self.dims)

    def span(self, start: int, stop: int) -> MultiRagged:
        """Rows ``start:stop``, sharing ``values``."""
        bounds = self.offsets
        lo, hi = int(bounds[start]), int(bounds[stop])
        return MultiRagged(self.values[lo:hi], self.shapes[start:stop], self.dims)

    @staticmethod
    def concat(columns: Sequence[MultiRagged]) -> MultiRagged:
        return MultiRagged(torch.cat([c.values for c in columns]),
                           torch.cat([c.shapes for c in columns]), columns[0].dims)

    def to_nested(self) -> torch.Tensor:
        """A strided nested tensor of the rows (``torch.nested.nested_tensor``: a copy)."""
        with warnings.catch_warnings():  # "prototype stage": the layout is asked for
            warnings.filterwarnings("ignore", "The PyTorch API of nested tensors")
            return torch.nested.nested_tensor(self.rows())

    def to_padded(self, pad_value: float = 0) -> torch.Tensor:
        """A dense ``[n, *max sizes]`` tensor, each row at the start of every dim."""
        n = len(self)
        top = self.shapes.max(0).values.tolist() if n else [0] * len(self.dims)
        out = self.values.new_full((n, *top), pad_value)
        for i, row in enumerate(self.rows()):
            at: tuple[int | slice, ...] = (i, *(slice(0, s) for s in row.shape))
            out[at] = row
        return out


def from_dense(t: torch.Tensor, dims: Sequence[int]) -> MultiRagged:
    """A dense ``[n, *shape]`` tensor as multi-ragged rows of pattern ``dims``."""
    n = t.shape[0]
    shapes = torch.tensor(list(t.shape[1:]), dtype=torch.int64).expand(n, t.dim() - 1)
    return MultiRagged(t.contiguous().reshape(-1), shapes.contiguous(), tuple(dims))


def from_ragged(values: torch.Tensor, lengths: torch.Tensor,
                dims: Sequence[int]) -> MultiRagged:
    """Ragged rows (``values [total, *tail]``, a length per row, from 0) as multi-ragged
    rows of pattern ``dims``."""
    tail = torch.tensor(list(values.shape[1:]), dtype=torch.int64)
    shapes = torch.cat([lengths.reshape(-1, 1), tail.expand(len(lengths), len(tail))], 1)
    return MultiRagged(values.contiguous().reshape(-1), shapes, tuple(dims))
