"""Reading shared fields: each distinct entry of a batch is loaded once, then either
given to every row that names it (``shared="rows"``, the default: readers, samplers
and DataLoaders see a plain field) or given once with an index
(``shared="index"``: ``td[f]`` holds the distinct entries, ``td[f + "_index"]`` the
position of each row's entry in them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDict

from tq_stream.backends.base import occupancy
from tq_stream.columns import Column, Ragged, take
from tq_stream.connection import placement
from tq_stream.convert import SHAPE, check_shared_read, row_list, to_tensordict, to_value
from tq_stream.errors import SchemaError, StateError
from tq_stream.meta import BatchMeta
from tq_stream.multiragged import MultiRagged

INDEX = "_index"


def read(units: Sequence[Any], meta: BatchMeta, fields: Sequence[str], ragged: str,
         shared: str = "rows") -> TensorDict:
    """``fields`` of meta's rows as a TensorDict ``[len(meta)]`` (see module doc)."""
    if meta.shared is None or (check_shared_read(shared) == "rows" and ragged != "list"):
        return to_tensordict(columns(units, meta, fields), len(meta), ragged=ragged)
    cols, entries, names, pos = _load(units, meta, fields)
    if shared == "index":
        return _indexed(cols, entries, names, pos, len(meta), ragged)
    views = {f: _entry_rows(entries[f]) for f in names}  # "list": no copy of an entry
    for f, rows in views.items():
        if rows is None:
            cols[f] = expand(entries[f], pos)
    td = to_tensordict({f: cols[f] for f in fields if f in cols}, len(meta), ragged=ragged)
    picked = pos.tolist()
    for f, rows in views.items():
        if rows is not None:
            td.set(f, row_list([rows[p] for p in picked]))
    return td


def _entry_rows(col: Column) -> list[torch.Tensor] | None:
    """Each entry of a ragged column as a view of the values read (None: not ragged)."""
    if isinstance(col, MultiRagged):
        return col.rows()
    if isinstance(col, Ragged):
        return [col.row(i) for i in range(len(col))]
    return None


def columns(units: Sequence[Any], meta: BatchMeta,
            fields: Sequence[str]) -> dict[str, Column]:
    """``fields`` of meta's rows as columns, each shared one given to every row."""
    cols, entries, names, pos = _load(units, meta, fields)
    for f in names:
        cols[f] = expand(entries[f], pos)
    return {f: cols[f] for f in fields}


def expand(col: Column, pos: torch.Tensor) -> Column:
    """Row i of the result is entry ``pos[i]`` of ``col``: dense rows in one gather,
    ragged ones as one ``torch.cat`` of views of the entries (a copy per row, no
    per-element index as ``take`` builds)."""
    if isinstance(col, MultiRagged):
        ends = torch.cumsum(col.shapes.prod(dim=1), 0).tolist()
        views = [col.values[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]
        picked = pos.tolist()
        values = torch.cat([views[p] for p in picked]) if picked else col.values[:0]
        return MultiRagged(values, col.shapes[pos], col.dims)
    if isinstance(col, Ragged):
        off = col.offsets.tolist()
        picked = pos.tolist()
        values = torch.cat([col.values[off[p]:off[p + 1]] for p in picked]) if picked \
            else col.values[:0]
        lengths = (col.offsets[1:] - col.offsets[:-1])[pos]
        return Ragged(values, torch.cat([torch.zeros(1, dtype=torch.int64),
                                         torch.cumsum(lengths, 0)]))
    return take(col, pos)


def _load(units: Sequence[Any], meta: BatchMeta, fields: Sequence[str]) -> tuple[
        dict[str, Column], dict[str, Column], list[str], torch.Tensor]:
    """Meta's own fields per row, the shared ones once per distinct entry, their names,
    and each row's position among the entries."""
    refs = meta.shared
    names = [] if refs is None else [f for f in fields if f in refs.fields]
    own = [f for f in fields if f not in names]
    cols = placement.load(units, meta.partition, meta.unit, meta.slot, own,
                          occupancy(meta.index, meta.generation), meta.schemas) if own else {}
    if refs is None or not names:
        return cols, {}, [], torch.zeros(0, dtype=torch.int64)
    if len(meta) and (refs.pos < 0).any():
        bad = [k for k, p in zip(meta.keys, refs.pos.tolist(), strict=True) if p < 0][:5]
        raise StateError(f"rows must name a shared entry to read shared fields {names}, "
                         f"rows {bad} of partition {meta.partition!r} name none")
    entries = placement.load(units, meta.partition, refs.unit, refs.slot, names,
                             occupancy(refs.index, refs.generation), meta.schemas)
    return cols, entries, names, torch.from_numpy(refs.pos.copy())


def _indexed(cols: dict[str, Column], entries: dict[str, Column], names: list[str],
             pos: torch.Tensor, n: int, ragged: str) -> TensorDict:
    shaped = [f for f in names if ragged == "padded" and isinstance(entries[f], MultiRagged)]
    for f in names:
        for extra in [INDEX, SHAPE] if f in shaped else [INDEX]:
            if f + extra in cols or f + extra in entries:
                raise SchemaError(f"shared field {f!r} read with shared='index' gives "
                                  f"{f + extra!r}, a field read too")
        cols[f + INDEX] = pos
    td = to_tensordict(cols, n, ragged=ragged)
    for f in names:  # one value for the batch each: select_rows keeps them whole
        td.set_non_tensor(f, _once(entries[f], ragged))
        col = entries[f]
        if f in shaped and isinstance(col, MultiRagged):  # each entry's shape
            td.set_non_tensor(f + SHAPE, col.shapes)
    return td


def _once(col: Column, ragged: str) -> torch.Tensor | list[Any]:
    """The distinct entries of a shared field: a tensor (nested, padded), or a list."""
    if isinstance(col, list):
        return list(col)
    rows = _entry_rows(col) if ragged == "list" else None
    return to_value(col, ragged=ragged) if rows is None else rows


__all__ = ["columns", "expand", "read"]
