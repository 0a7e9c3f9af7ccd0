"""Reading TransferQueue fields whose rows are stored under several physical names
(``variants``), and refusing the put that would make a row ambiguous.

A row holds each field under one physical name: ``check_rewrite`` refuses a put that
would give it a second one (``x@object`` beside ``x``), since no stored name says
which of the two was written last, and a process that never saw the new name would
read the old one. ``read`` looks at each requested row's stored names (one controller
call for these keys, not the partition), so it never takes a name some row holds
beside another: such a row (left by a writer that had not seen the other name) is a
StateError, never a guess.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from tensordict import NonTensorStack, TensorDict

from tq_stream import fieldpath
from tq_stream.compat import values, variants
from tq_stream.errors import KeyConflictError, SchemaError, StateError

if TYPE_CHECKING:
    from tq_stream.meta import BatchMeta
    from tq_stream.stream import Stream

Column = torch.Tensor | NonTensorStack  # one field of a read, all rows


def _held(row_fields: Sequence[str], hidden: str) -> dict[str, list[str]]:
    """Logical field -> the physical names one row holds it under."""
    out: dict[str, list[str]] = {}
    for f in row_fields:
        if f != hidden:
            out.setdefault(variants.logical(f), []).append(f)
    return out


def _describe(name: str, fixed: Mapping[str, str]) -> str:
    if variants.SEP in name:
        return name.split(variants.SEP, 1)[1]
    return fixed.get(name, "the type its first write fixed")


def check_rewrite(stream: Stream, partition: str, keys: Sequence[str],
                  names: Mapping[str, str], fixed: Mapping[str, str]) -> None:
    """Raise SchemaError if a put of ``names`` (logical -> physical) would store a field
    of an existing row under a second physical name.

    Checked when a field of the put has another physical name the writer knows of
    (``fixed``: the partition's fixed schemas as this process sees them).
    """
    known = {variants.logical(p) for p in fixed if variants.SEP in p}
    watch = {n: p for n, p in names.items() if p != n or n in known}
    if not watch:
        return
    try:
        rows = stream.kv.list(partition, keys)
    except KeyConflictError:  # no such partition yet: no row to rewrite
        return
    for row in rows:
        for name, held in _held(row["fields"], "").items():
            other = [p for p in held if name in watch and p != watch[name]]
            if other:
                raise SchemaError(
                    f"field {name!r} of key {row['key']!r} in partition {partition!r} holds "
                    f"{_describe(other[0], fixed)} from an earlier put, got "
                    f"{_describe(watch[name], fixed)}: a row's field keeps one type until "
                    f"the row is cleared (its old value would be read by processes that do "
                    f"not know the new type); kv_clear the key and put the row again")


def read(stream: Stream, keys: list[str], partition: str, fields: list[str] | None,
         hidden: str) -> TensorDict:
    """Fields (logical names; None: every field all of ``keys`` hold) of ``keys``, each
    packed row by row where rows hold it under different physical names.

    Raises:
        KeyConflictError: a key has no row.
        StateError: a row lacks a field, or holds one under two physical names.
    """
    rows = stream.kv.list(partition, keys)
    if len(rows) != len(keys):
        present = {r["key"] for r in rows}
        raise KeyConflictError(f"keys must exist in partition {partition!r}, missing "
                               f"{[k for k in keys if k not in present][:5]}")
    held = [_held(r["fields"], hidden) for r in rows]
    if fields is None:
        fields = [f for f in held[0] if all(f in h for h in held[1:])]
        if not fields:
            raise StateError(f"keys {keys[:5]} of partition {partition!r} must share a written "
                             f"field to be read; they have tags only")
    groups = {name: _groups(name, keys, held, partition) for name in fields}
    single = {name: next(iter(g)) for name, g in groups.items() if len(g) == 1}
    out = TensorDict({}, batch_size=[len(keys)])
    if single:  # one columnar read of every field all rows hold under one name
        whole = stream.kv.get_batch(keys, list(single.values()), partition=partition)
        for name, p in single.items():
            out.set(name, _decoded(whole.get(p), p, len(keys)))
    for name in fields:
        if name not in single:
            out.set(name, _packed(stream, keys, partition, groups[name]))
    return TensorDict({name: out.get(name) for name in fields}, batch_size=[len(keys)])


def single_names(held: Mapping[str, int], n: int, fields: list[str] | None,
                 hidden: str) -> dict[str, str] | None:
    """Logical -> physical name of each field to read when every one of the ``n`` rows
    holds it under the same one name (``held``: physical field -> how many of the rows
    hold it, ``KV.locate``); None when some field needs the row-by-row ``read`` (held
    under several names, or not by every row) or is a parent path.

    ``fields`` None: the fields every row holds. A field held under one name by only
    some rows is not one of them; one held under two names may be, row by row.
    """
    by: dict[str, list[tuple[str, int]]] = {}
    for p, count in held.items():
        if fieldpath.SEP in p:  # nested fields: as ``read`` (and the core) resolve them
            return None
        if p != hidden:
            by.setdefault(variants.logical(p), []).append((p, count))
    if fields is None:
        fields = [name for name, ps in by.items() if len(ps) > 1 or ps[0][1] == n]
    out = {}
    for name in fields:
        ps = by.get(name, ())
        if len(ps) != 1 or ps[0][1] != n:
            return None
        out[name] = ps[0][0]
    return out or None


def read_single(stream: Stream, meta: BatchMeta, names: Mapping[str, str]) -> TensorDict:
    """``read`` of fields every row holds under one name (``single_names``): one
    columnar read of the rows ``meta`` placed (``KV.locate``)."""
    whole = stream.kv.read(meta, list(names.values()))
    if all(name == p for name, p in names.items()):
        return whole
    n = len(meta)
    return TensorDict({name: _decoded(whole.get(p), p, n) for name, p in names.items()},
                      batch_size=[n])


def _groups(name: str, keys: list[str], held: list[dict[str, list[str]]],
            partition: str) -> dict[str, list[int]]:
    """Physical name -> positions of the rows that hold field ``name`` under it."""
    out: dict[str, list[int]] = {}
    for i, (key, h) in enumerate(zip(keys, held, strict=True)):
        names = h.get(name, [])
        if len(names) > 1:
            raise StateError(f"field {name!r} of key {key!r} in partition {partition!r} must "
                             f"hold one type to be read; the row was overwritten with another "
                             f"type ({names}) and which write is the last is unknown: "
                             f"kv_clear it and put it again")
        if not names:
            raise StateError(f"field {name!r} must be written before it is read; key {key!r} "
                             f"of partition {partition!r} holds none")
        out.setdefault(names[0], []).append(i)
    return out


def _decoded(value: Column, physical: str, n: int) -> Column:
    if physical.endswith(variants.SEP + variants.ENCODED):
        return NonTensorStack(*values.decode_rows(variants.rows_of_column(value, n)))
    return value


def _packed(stream: Stream, keys: list[str], partition: str,
            groups: dict[str, list[int]]) -> Column:
    """One field whose rows hold it under the physical names ``groups``, row by row."""
    rows: list[Any] = [None] * len(keys)
    for p, pos in groups.items():
        got = stream.kv.get_batch([keys[i] for i in pos], [p], partition=partition).get(p)
        vals = variants.rows_of_column(got, len(pos))
        if p.endswith(variants.SEP + variants.ENCODED):
            vals = values.decode_rows(vals)
        for i, v in zip(pos, vals, strict=True):
            rows[i] = v
    return variants.pack(rows)
