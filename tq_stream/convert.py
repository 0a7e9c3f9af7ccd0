"""User data <-> normalized columns.

In: a ``TensorDict`` with batch size ``[n]``, or a dict of field -> value where
a value is a tensor ``[n, ...]`` (dense), a jagged nested tensor (ragged), a
list of n tensors (ragged along their first dim; a list of 0-d tensors is
dense; tensors of one ndim >= 2 whose shapes differ after the first dim, or a
strided nested tensor of such rows, are multi-ragged, every dim varying), a
``Ragged`` column (values and offsets, as ``columns.Ragged`` holds them), a
``MultiRagged`` column (``MultiRagged.from_list(rows, fixed_dims=...)`` says which
dims every row shares), or a list of n plain values. A single row
(``keys`` a str) is a dict of field -> one row's value; a row's tensor counts as
a list of one tensor.

The kind of a column follows the form of the input, never the lengths that
happen to be in one batch: a list of equal-length tensors is still ragged.
A field keeps the schema its first write fixed; a later write in the other
form is converted when the data fits (``columns.coerce``): a dense ``[n, L, ...]``
tensor into a ragged field, or ragged rows all of length ``L`` into a dense
``[L, ...]`` field.

Out: a ``TensorDict`` of batch size ``[n]``; ragged fields come back as jagged
nested tensors (or padded dense tensors, or lists of rows), multi-ragged fields as
strided nested tensors (or padded, or lists of rows), object fields as
``NonTensorStack``.

Nested: a nested TensorDict (or a dict of fields inside a batch dict) is stored as
flat fields ``"obs.image"``; fields with a ``"."`` come back nested (``fieldpath``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, cast

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase

from tq_stream import fieldpath
from tq_stream.columns import (
    Column,
    Ragged,
    column_len,
    dtype_name,
    flat_plain,
    schema_of,
)
from tq_stream.errors import ConfigError, SchemaError, check_name
from tq_stream.multiragged import MultiRagged
from tq_stream.object_stack import object_stack
from tq_stream.schemas import FieldSchema

_PLAIN = (str, int, float, bool, bytes, type(None))
def _check_plain(field: str, value: object, depth: int = 0) -> None:
    if isinstance(value, _PLAIN):
        return
    if depth < 8 and isinstance(value, list | tuple):
        for v in value:
            _check_plain(field, v, depth + 1)
        return
    if depth < 8 and isinstance(value, dict) and all(isinstance(k, str) for k in value):
        for v in value.values():
            _check_plain(field, v, depth + 1)
        return
    raise SchemaError(
        f"field {field!r} values must be tensors or plain values (str, int, float, bool, "
        f"bytes, None, lists/dicts of those), got {type(value).__name__}: {value!r:.80}"
    )


def _check_tensor(field: str, t: torch.Tensor, layout: torch.layout | None = None) -> None:
    """Raise SchemaError unless ``t`` is a dense tensor holding data (not sparse, not on
    the meta device), the only kind a storage unit can copy (``layout``: ``t.layout``,
    when the caller has it: each look into a nested tensor costs ~10 us)."""
    layout = t.layout if layout is None else layout
    if layout not in (torch.strided, torch.jagged):
        raise SchemaError(f"field {field!r} must be a dense (strided) tensor, got layout "
                          f"{layout}; call .to_dense() first")
    if t.device.type == "meta":
        raise SchemaError(f"field {field!r} must be a tensor with data, got a tensor on "
                          f"device meta (shape {list(t.shape)}, no values)")


def _from_list(field: str, rows: list[Any]) -> Column:
    tensors = [issubclass(k, torch.Tensor) for k in set(map(type, rows))]  # no call per row
    if tensors and all(tensors):
        for r in rows:
            _check_tensor(field, r)
        if any(r.is_nested for r in rows):
            raise SchemaError(f"field {field!r} rows must be plain tensors, got a nested one")
        rows = [r.detach().cpu() for r in rows]
        tails = {(r.dtype, tuple(r.shape[1:]), r.dim() == 0) for r in rows}
        if len(tails) != 1:
            if len({(r.dtype, r.dim()) for r in rows}) == 1 and rows[0].dim() >= 2:
                return MultiRagged.from_list(rows, field=field)  # e.g. images [3, H, W]
            raise SchemaError(f"field {field!r} rows must share dtype and ndim (and, to be "
                              f"ragged in the first dim only, the shape after it), got "
                              f"{sorted(map(str, tails))[:4]}")
        if rows[0].dim() == 0:
            return torch.stack(rows)
        return Ragged.from_list([r.contiguous() for r in rows])
    if any(tensors):
        raise SchemaError(f"field {field!r} must not mix tensors and plain values")
    if not flat_plain(rows):  # the common column needs no walk per row
        for r in rows:
            _check_plain(field, r)
    return list(rows)


class _Jagged(Protocol):
    """What a ``torch.jagged`` nested tensor has beyond ``torch.Tensor``'s stubs."""

    def lengths(self) -> torch.Tensor | None: ...
    def offsets(self) -> torch.Tensor: ...


def _from_nested(field: str, value: torch.Tensor, layout: torch.layout) -> Column:
    """A nested tensor (of ``layout``) as a Ragged column with offsets from 0 (views and
    holes resolved); a strided one whose rows differ after the first dim as a
    MultiRagged column."""
    if layout != torch.jagged:
        return _from_list(field, list(value.unbind()))
    ragged = [i for i, d in enumerate(value.shape) if not isinstance(d, int)]
    if ragged != [1]:
        raise SchemaError(f"field {field!r} must be ragged in the dim after the batch dim, "
                          f"got a nested tensor ragged in dim {ragged[0] if ragged else None}")
    jagged = cast(_Jagged, value)
    if jagged.lengths() is not None:  # a non-contiguous view (e.g. narrow): gather its rows
        return Ragged.from_list([r.detach().cpu().contiguous() for r in value.unbind()])
    offsets = jagged.offsets().detach().cpu().to(torch.int64)
    values = value.values()  # detached here, not the nested tensor: several times cheaper
    values = (values.detach() if values.requires_grad else values).cpu()
    lo, hi = int(offsets[0]), int(offsets[-1])
    if lo or hi != values.shape[0]:
        values, offsets = values[lo:hi], offsets - lo
    return Ragged(values.contiguous(), offsets)


def to_column(field: str, value: object, n: int) -> Column:
    """Normalize one field's values for ``n`` rows."""
    col: Column
    if isinstance(value, MultiRagged):
        col = _checked(field, value)
    elif isinstance(value, Ragged):
        col = _checked_ragged(field, value)
    elif isinstance(value, torch.Tensor):
        layout = value.layout
        _check_tensor(field, value, layout)
        if layout is torch.jagged or value.is_nested:  # is_nested of a jagged one: ~6 us
            col = _from_nested(field, value, layout)
        elif value.dim() == 0:
            raise SchemaError(f"field {field!r} must have a leading batch dim of {n}, "
                              f"got a 0-d tensor")
        else:
            col = value.detach().cpu()
    elif isinstance(value, NonTensorStack):
        col = _from_list(field, value.tolist())
    elif isinstance(value, NonTensorData):
        data = value.data
        col = _from_list(field, list(data) if isinstance(data, list) else [data] * n)
    elif isinstance(value, np.ndarray):
        if value.dtype.kind in "OUS":  # objects, str, bytes: plain values per row
            col = _from_list(field, value.tolist())
        else:
            col = torch.from_numpy(np.ascontiguousarray(value))
    elif isinstance(value, list | tuple):
        col = _from_list(field, list(value))
    else:
        raise SchemaError(f"field {field!r} must be a tensor, a nested tensor, or a list of "
                          f"{n} rows, got {type(value).__name__}")
    if column_len(col) != n:
        raise SchemaError(
            f"field {field!r} must have {n} rows (one per key), got {column_len(col)}"
        )
    return col


def _checked(field: str, value: MultiRagged) -> MultiRagged:
    """A user's MultiRagged column, checked, its tensors on the CPU."""
    bad = value.problem()
    if bad:
        raise SchemaError(f"field {field!r} must be a well-formed MultiRagged column: {bad}")
    _check_tensor(field, value.values)
    return MultiRagged(value.values.detach().cpu().contiguous(), value.shapes.cpu(), value.dims)


def _checked_ragged(field: str, value: Ragged) -> Ragged:
    """A user's Ragged column, checked, its tensors on the CPU."""
    values, offsets = value.values, value.offsets
    if not isinstance(values, torch.Tensor) or not isinstance(offsets, torch.Tensor) or \
            values.dim() < 1 or offsets.dtype != torch.int64 or offsets.dim() != 1 or \
            not offsets.numel():
        raise SchemaError(f"field {field!r} must be a Ragged of values [total, ...] and int64 "
                          f"offsets [n + 1], got {value!r:.120}")
    _check_tensor(field, values)
    offsets = offsets.detach().cpu()
    if int(offsets[0]) != 0 or int(offsets[-1]) != values.shape[0] or \
            bool((offsets[1:] < offsets[:-1]).any()):
        raise SchemaError(f"field {field!r} must have Ragged offsets from 0 to the values' "
                          f"length {values.shape[0]}, non-decreasing, got "
                          f"{offsets.tolist()[:8]}")
    return Ragged(values.detach().cpu().contiguous(), offsets)


def _is_nested(value: object) -> bool:
    return isinstance(value, TensorDictBase) and not isinstance(
        value, NonTensorData | NonTensorStack)


def _flatten(items: Mapping[Any, Any], out: dict[str, Any], prefix: str = "",
             dicts: bool = True) -> dict[str, Any]:
    """Nested TensorDicts (and, with ``dicts``, dicts) as flat ``"a.b"`` fields."""
    for key, value in items.items():
        name = fieldpath.join(key) if isinstance(key, tuple) else key
        check_name("field name", name)
        path = fieldpath.check_path(prefix + name)
        plain_dict = isinstance(value, Mapping) and not isinstance(value, TensorDictBase)
        if _is_nested(value) or (dicts and plain_dict):
            sub = {k: value.get(k) for k in value.keys()} if _is_nested(value) else value
            if not sub:
                raise SchemaError(f"field {path!r} must hold at least one nested field, "
                                  f"got an empty {type(value).__name__}")
            _flatten(sub, out, path + fieldpath.SEP, dicts)
        elif path in out:
            raise SchemaError(f"field {path!r} is given twice (as nested keys and as a "
                              f"dotted name)")
        else:
            out[path] = value
    fieldpath.check_paths(out)
    return out


# What a put takes: a TensorDict ``[n]`` or a dict of fields (``to_columns``, which
# checks any value), or for one key its row's values without a batch dim (``single_row``).
RowData = TensorDictBase | Mapping[str, object]


def to_columns(data: object, n: int) -> dict[str, Column]:
    """Normalize a TensorDict / dict of n rows into columns (field names checked;
    nested TensorDicts and dicts become ``"a.b"`` fields, see ``fieldpath``)."""
    if type(data) is dict:  # the common case first: no ABC checks
        items = dict(data)
    elif isinstance(data, TensorDictBase):
        if data.batch_size and data.batch_size[0] != n:
            raise SchemaError(f"data must have batch size [{n}] (one row per key), got "
                              f"{list(data.batch_size)}")
        items = {k: data.get(k) for k in data.keys()}
    elif isinstance(data, Mapping):
        items = dict(data)
    else:
        raise ConfigError(f"data must be a TensorDict or a dict of fields, got "
                          f"{type(data).__name__}")
    if not items:
        raise ConfigError("data must contain at least one field, got none")
    plain = _plain_tensors(items, n)
    if plain is not None:
        return plain
    return {name: to_column(name, value, n) for name, value in _flatten(items, {}).items()}


def _plain_tensors(items: dict[Any, Any], n: int) -> dict[str, Column] | None:
    """``items`` as they are when every value is a plain CPU tensor of ``n`` rows that
    needs no autograd, under a name without a ``"."``: then ``to_column`` would change
    nothing (its ``detach`` makes an alias). None: take the general path. The common
    put, made cheap: on a small put the checks of the general path cost more than the
    bytes (each torch call is tens of microseconds when its code is not in the caches).
    """
    for name, value in items.items():
        if type(value) is not torch.Tensor or type(name) is not str or not name or \
                fieldpath.SEP in name or value.requires_grad or not value.is_cpu or \
                value.layout is not torch.strided or value.is_nested or \
                value.shape[:1] != (n,):
            return None
    return items


def single_row(data: object) -> dict[str, Column]:
    """One row's values (no batch dim) as columns of one row (a nested TensorDict is
    nested fields; a dict is one plain value)."""
    if isinstance(data, TensorDictBase):
        data = {k: data.get(k) for k in data.keys()}
    if not isinstance(data, Mapping):
        raise ConfigError(f"data for one key must be a dict of fields, got {type(data).__name__}")
    if not data:
        raise ConfigError("data must contain at least one field, got none")
    out = {}
    for name, value in _flatten(data, {}, dicts=False).items():
        if isinstance(value, np.ndarray) and value.dtype.kind not in "OUS":
            value = torch.from_numpy(np.ascontiguousarray(value))
        if isinstance(value, torch.Tensor) and value.is_nested:
            raise SchemaError(f"field {name!r} of one row must be a plain tensor (its row), "
                              f"got a nested tensor; use a list of keys to put many rows")
        out[name] = to_column(name, value if isinstance(value, MultiRagged) else [value], 1)
    return out


def schemas_of(columns: Mapping[str, Column]) -> dict[str, dict[str, Any]]:
    return {f: {"kind": "dense", "dtype": dtype_name(c.dtype), "shape": list(c.shape[1:])}
            if type(c) is torch.Tensor else schema_of(c).to_dict()  # dense: the common case
            for f, c in columns.items()}


RAGGED = ("nested", "padded", "list")  # how ragged and multi-ragged fields are read
SHAPE = "_shape"  # ragged="padded": the rows' shapes of multi-ragged field f, as f + SHAPE


def check_ragged(ragged: str) -> str:
    if ragged not in RAGGED:
        raise ConfigError(f"ragged must be one of {list(RAGGED)}, got {ragged!r}")
    return ragged


SHARED_READS = ("rows", "index")  # how shared fields are read (``shared_read.py``)


def check_shared_read(shared: object) -> str:
    if shared not in SHARED_READS:
        raise ConfigError(f"shared must be one of {list(SHARED_READS)}, got {shared!r}")
    return str(shared)


def row_list(rows: list[torch.Tensor]) -> NonTensorStack:
    """Per-row tensors as the value a TensorDict holds (``ragged="list"``)."""
    return NonTensorStack(*[NonTensorData(r) for r in rows])


def to_value(column: Column, schema: FieldSchema | None = None, ragged: str = "nested") -> Any:
    """A column as the value a TensorDict holds."""
    if isinstance(column, torch.Tensor):
        return column
    if isinstance(column, Ragged):
        if ragged == "padded":
            return column.to_padded()
        if ragged == "list":
            return row_list([column.row(i) for i in range(len(column))])
        return column.to_nested()
    if isinstance(column, MultiRagged):
        if ragged == "padded":
            return column.to_padded()
        if ragged == "list":
            return row_list(column.rows())  # views of the values read
        return column.to_nested()
    return object_stack(column)


def to_tensordict(columns: Mapping[str, Column], n: int, ragged: str = "nested") -> TensorDict:
    """Assemble columns of ``n`` rows into a TensorDict of batch size ``[n]``.

    ``ragged``: ragged and multi-ragged fields as nested tensors ("nested": jagged for
    ragged fields, strided for multi-ragged ones), dense tensors padded with zeros at
    the end of each dim ("padded"; a multi-ragged field ``f`` also gives its rows'
    shapes, int64 ``[n, ndim]``, as ``f + "_shape"``), or a list of one tensor per row
    ("list"; a multi-ragged field's rows are views of the bytes read).
    """
    check_ragged(ragged)
    td = TensorDict({}, batch_size=[n])
    if any(fieldpath.SEP in name for name in columns):
        fieldpath.check_paths(columns)
    for name, col in columns.items():
        td.set(_key(name), to_value(col, ragged=ragged))
        if ragged == "padded" and isinstance(col, MultiRagged):
            if name + SHAPE in columns:
                raise SchemaError(f"field {name!r} read with ragged='padded' gives its rows' "
                                  f"shapes as {name + SHAPE!r}, a field read too")
            td.set(_key(name + SHAPE), col.shapes)
    return td


def _key(name: str) -> str | tuple[str, ...]:
    return tuple(name.split(fieldpath.SEP)) if fieldpath.SEP in name else name
