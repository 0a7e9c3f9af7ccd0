"""Blocking KV operations with TransferQueue's semantics, over a tq_stream Stream.

Tag-only rows: TransferQueue lets a key exist with tags and no field (verl
registers prompts that way). A tq_stream row needs a field, so a tag-only put
writes the one-byte field ``TAG_ONLY_FIELD``; it is never listed, returned or
checkpointed apart from its row. A tags-only put to keys that already exist is
a plain tag merge (``set_tags``, one controller call, no bytes moved).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import NonTensorStack, TensorDict, TensorDictBase

from tq_stream.columns import Ragged, flat_plain
from tq_stream.compat import values, variant_read, variants
from tq_stream.compat.meta import BatchMeta, KVBatchMeta
from tq_stream.compat.runtime import Runtime
from tq_stream.convert import to_column
from tq_stream.errors import ConfigError, KeyConflictError, SchemaError, StateError

PUT_TRIES = 3  # a put refused for a schema learned meanwhile is renamed and tried again

TAG_ONLY_FIELD = "__tq_compat_row__"


def as_keys(keys: str | Sequence[str], name: str = "keys") -> list[str]:
    if isinstance(keys, str):
        return [keys]
    if not isinstance(keys, Sequence):
        raise ConfigError(f"{name} must be a str or a list of str, got {type(keys).__name__}")
    return list(keys)


def as_fields(select_fields: str | Sequence[str] | None) -> list[str] | None:
    if select_fields is None:
        return None
    return [select_fields] if isinstance(select_fields, str) else list(select_fields)


def one_row(fields: TensorDictBase | dict[str, Any]) -> TensorDict:
    """``kv_put``'s ``fields`` (one row without a batch dim) as a TensorDict ``[1]``."""
    if isinstance(fields, TensorDictBase):
        return fields
    if not isinstance(fields, dict):
        raise ConfigError(f"fields must be a dict or a TensorDict, got {type(fields).__name__}")
    batch: dict[str, Any] = {}
    for name, value in fields.items():
        if isinstance(value, torch.Tensor):
            if value.is_nested:
                raise ConfigError(f"fields[{name!r}] must not be a nested tensor in kv_put "
                                  f"(use kv_batch_put for many rows)")
            batch[name] = value.unsqueeze(0)
        else:
            batch[name] = NonTensorStack(value)
    return TensorDict(batch, batch_size=[1])


def per_sample(fields: Any, n: int) -> Any:
    """``fields`` as TransferQueue stores them: every tensor with a per-row dim is ragged.

    TransferQueue keeps one tensor per sample and returns a field's rows as a jagged
    nested tensor whenever they are not scalars, whatever their lengths. tq_stream fixes
    a dense field's shape at its first put, so a batch of one (verl puts one session
    at a time) would pin the length; as a ragged column (a view, no copy) every length
    fits and reads come back in TransferQueue's layout. A jagged nested tensor becomes
    its ragged column here, once (each look into one costs tens of microseconds).
    """
    if fields is None:
        return None
    out: dict[str, Any] = {}
    for name, value in fields.items():
        if isinstance(value, torch.Tensor):
            if value.layout is torch.jagged:
                value = to_column(name, value, n)
            elif not value.is_nested and value.dim() >= 2:
                rows, length = value.shape[0], value.shape[1]
                flat = value.reshape(rows * length, *value.shape[2:])
                value = Ragged(flat, torch.arange(0, rows * length + 1, max(length, 1),
                                                  dtype=torch.int64) if length else
                               torch.zeros(rows + 1, dtype=torch.int64))
        out[name] = value
    return out


def parse_fields(fields: Any, data_parser: Any) -> Any:
    """Apply TransferQueue's ``data_parser`` hook: it edits, in place, a dict of columns
    (dense tensors as they are; nested tensors and non-tensor fields as lists)."""
    if data_parser is None or fields is None:
        return fields
    cols: dict[str, Any] = {}
    for name, value in fields.items():
        if isinstance(value, torch.Tensor):
            cols[name] = list(value.unbind()) if value.is_nested else value
        else:
            cols[name] = value.tolist()
    data_parser(cols)
    return cols


def _visible(fields: list[str]) -> list[str]:
    """The TransferQueue (logical) fields of stored ones, hidden field left out."""
    return list(dict.fromkeys(variants.logical(f) for f in fields if f != TAG_ONLY_FIELD))


def describe(rt: Runtime, keys: list[str],
             partition: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Current (merged) tags of ``keys`` and the fields every one of them has."""
    d = rt.get().connection.controller().lookup(partition=partition, keys=keys, fields=None)
    return d.tags or [], _visible(d.fields)


@dataclass(frozen=True)
class Prepared:
    """A put's fields as tq_stream stores them (``prepare``), and what ``write`` names
    them by."""

    data: dict[str, Any]  # logical name -> value (see ``values``, ``per_sample``)
    encoded: set[str]  # the fields whose rows hold encoded tensors
    descs: dict[str, str]  # logical name -> schema description; "" for nested fields


def prepare(fields: TensorDictBase | dict[str, Any], n: int) -> Prepared:
    """A put's fields as tq_stream stores them, encoded where their rows hold tensors,
    each with its schema description."""
    items = fields.items() if isinstance(fields, dict) else \
        ((k, fields.get(k)) for k in fields.keys())
    out: dict[str, Any] = {}
    encoded: set[str] = set()
    plain: set[str] = set()  # rows of plain values, found so here once per put
    for name, value in items:
        rows = None if isinstance(value, torch.Tensor) else values.rows_of(value, n)
        if rows is not None:
            if len(rows) == n and flat_plain(rows):
                plain.add(name)
            elif values.needs_encoding(rows):
                rows = values.encode_rows(rows)
                encoded.add(name)
            value = rows
        out[name] = value
    data = per_sample(out, n)
    descs = {name: variants.OBJECT if name in plain else
             "" if isinstance(v, TensorDictBase | dict) else variants.describe(name, v, n)
             for name, v in data.items()}
    return Prepared(data, encoded, descs)


def write(rt: Runtime, keys: list[str], partition: str, put: Prepared,
          tags: list[dict[str, Any]] | None) -> dict[str, str]:
    """Put ``put``'s fields (logical names) under the physical name each value's schema
    needs (``variants``); returns logical -> physical names."""
    stream = rt.get()
    data, encoded, descs = put.data, put.encoded, put.descs
    for attempt in range(PUT_TRIES):
        fixed = rt.schemas.fixed(partition)
        names = variants.names_for(fixed, descs, encoded)
        names.update({k: k for k, d in descs.items() if not d})  # nested: as they are
        variant_read.check_rewrite(stream, partition, keys, names, fixed)
        try:
            stream.kv.put_batch(keys, {names[k]: v for k, v in data.items()}, tags=tags,
                                partition=partition)
        except SchemaError:
            if attempt == PUT_TRIES - 1:
                raise
            rt.schemas.refresh(stream, partition)
            continue
        rt.schemas.learn(partition, {names[k]: ("object" if k in encoded else descs[k])
                                     for k in data if names[k] != k})
        return names
    raise AssertionError("unreachable")


def batch_put(rt: Runtime, keys: list[str], partition: str, fields: Any,
              tags: list[dict[str, Any]] | None) -> KVBatchMeta:
    """``kv_batch_put``: write ``fields`` and merge ``tags``; returns the rows' state."""
    if fields is None and tags is None:
        raise ConfigError("kv_batch_put needs fields or tags, got neither")
    keys = as_keys(keys)
    if fields is not None:
        n = fields.batch_size[0] if isinstance(fields, TensorDictBase) and fields.batch_size \
            else None
        if n is not None and n != len(keys):
            raise ConfigError(f"fields must have one row per key ({len(keys)}), got batch "
                              f"size {n}")
    if tags is not None and len(tags) != len(keys):
        raise ConfigError(f"tags must have one dict per key ({len(keys)}), got {len(tags)}")
    stream = rt.get()
    rt.ensure_partition(partition)
    if fields is not None:
        write(rt, keys, partition, prepare(fields, len(keys)), tags)
    else:
        assert tags is not None  # fields or tags: checked above
        try:  # keys that exist: merge the tags, nothing else
            stream.set_tags(partition, keys, tags)
        except KeyConflictError:  # some key (or the partition) is new
            marker = torch.zeros(len(keys), dtype=torch.uint8)
            stream.kv.put_batch(keys, {TAG_ONLY_FIELD: marker}, tags=tags, partition=partition)
    try:
        merged, stored = describe(rt, keys, partition)
    except (KeyConflictError, StateError):  # a consumer freed some rows meanwhile (a
        merged = [dict(t) for t in tags] if tags is not None else [{} for _ in keys]
        stored = [] if fields is None else _visible(list(fields.keys()))  # tq_stream ack)
    return KVBatchMeta(keys=keys, tags=merged, partition_id=partition, fields=stored)


def batch_get(rt: Runtime, keys: str | Sequence[str], partition: str,
              select_fields: str | Sequence[str] | None) -> TensorDict:
    """``kv_batch_get``: rows in ``keys`` order; ``select_fields`` or every common field.

    A field stored under one name for all of ``keys`` is one columnar read, after one
    controller call that says which fields the rows hold (``KV.locate``); one whose
    rows were written with different types is read per group and packed row by row.
    """
    keys = as_keys(keys)
    fields = as_fields(select_fields)
    stream = rt.get()
    if fields is not None and TAG_ONLY_FIELD in fields:
        raise ConfigError(f"select_fields must name stored fields, got {TAG_ONLY_FIELD!r}")
    if keys:
        meta, held = stream.kv.locate(keys, partition)
        names = variant_read.single_names(held, len(keys), fields, TAG_ONLY_FIELD)
        if names is not None:  # the common case: one name per field for every row
            return variant_read.read_single(stream, meta, names)
    if fields is not None and not rt.schemas.has_variants(partition, fields):
        try:  # the common case: every row has each field under its own name
            batch: TensorDict = stream.kv.get_batch(keys, fields, partition=partition)
            return batch
        except StateError:
            pass  # some row holds a field under a variant name: find out below
    return variant_read.read(stream, keys, partition, fields, TAG_ONLY_FIELD)


def list_partition(rt: Runtime, partition: str) -> dict[str, dict[str, Any]]:
    """``{key: tags}`` of every row of ``partition``, oldest first.

    The controller sends keys and tags as columns (``Controller.list_tags``); the
    per-key dicts verl expects are built here, a column at a time.
    """
    d = rt.get().connection.controller().list_tags(partition=partition)
    keys = d.keys
    out: dict[str, dict[str, Any]] = {k: {} for k in keys}
    rows = list(out.values())
    for name, (pos, vals) in d.tags.items():
        if len(vals) == len(rows):  # every row has the tag: no positions to follow
            for row, v in zip(rows, vals, strict=True):
                row[name] = v
        else:
            for p, v in zip(pos.tolist() if hasattr(pos, "tolist") else pos, vals,
                            strict=True):
                rows[p][name] = v
    return out


def kv_list(rt: Runtime, partition: str | None) -> dict[str, dict[str, dict[str, Any]]]:
    """``kv_list``: ``{partition: {key: tags}}`` of one partition or all; a partition that
    does not exist is left out (``{}``), as in TransferQueue."""
    ctrl = rt.get().connection.controller()
    names = ctrl.partitions() if partition is None else [partition]
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name in names:
        try:
            rows = list_partition(rt, name)
        except KeyConflictError:  # no such partition (or it went away meanwhile)
            continue
        out[name] = rows
    return out


def clear(rt: Runtime, keys: str | Sequence[str], partition: str) -> None:
    """``kv_clear``: remove keys (tags and data); unknown keys or partitions are a no-op."""
    keys = as_keys(keys)
    if not keys:
        return
    try:
        rt.get().kv.clear(keys, partition=partition)
    except KeyConflictError:
        pass  # the partition does not exist: nothing to clear


# ------------------------------------------------------------------ BatchMeta side
def retrieve_meta(rt: Runtime, keys: str | Sequence[str], partition: str,
                  create: bool) -> BatchMeta:
    """A BatchMeta of ``keys`` (in key order); missing keys are created tag-only if
    ``create``, else dropped from the result (as TransferQueue does)."""
    keys = as_keys(keys)
    ctrl = rt.get().connection.controller()
    if create:
        missing = _missing(rt, keys, partition)
        if missing:
            batch_put(rt, missing, partition, None, [{} for _ in missing])
    else:
        known = set(keys) - set(_missing(rt, keys, partition))
        keys = [k for k in keys if k in known]
    if not keys:
        return BatchMeta()
    d = ctrl.lookup(partition=partition, keys=keys, fields=None)
    schema = {variants.logical(f): dict(d.schemas.get(f, {}))
              for f in d.fields if f != TAG_ONLY_FIELD}
    return BatchMeta(d.index.tolist(), [partition] * len(keys), schema,
                     custom_meta=d.tags, keys=list(d.keys))


def _missing(rt: Runtime, keys: list[str], partition: str) -> list[str]:
    ctrl = rt.get().connection.controller()
    try:
        ctrl.lookup(partition=partition, keys=keys, fields=())
        return []
    except KeyConflictError:
        pass
    try:
        present = set(list_partition(rt, partition))
    except KeyConflictError:
        return list(keys)
    return [k for k in keys if k not in present]


def retrieve_keys(rt: Runtime, global_indexes: int | Sequence[int], partition: str) -> list[str]:
    idx = [global_indexes] if isinstance(global_indexes, int) else list(global_indexes)
    if not idx:
        return []
    keys: list[str] = rt.get().connection.controller().keys_of(partition=partition, index=idx)
    return keys


def meta_keys(rt: Runtime, meta: BatchMeta) -> dict[str, list[str]]:
    """``{partition: keys}`` of a BatchMeta's rows, in row order per partition."""
    out: dict[str, list[str]] = {}
    if meta.keys is not None:
        for p, k in zip(meta.partition_ids, meta.keys, strict=True):
            out.setdefault(p, []).append(k)
        return out
    for p in dict.fromkeys(meta.partition_ids):
        idx = [i for q, i in zip(meta.partition_ids, meta.global_indexes, strict=True) if q == p]
        out[p] = retrieve_keys(rt, idx, p)
    return out


def get_data(rt: Runtime, meta: BatchMeta) -> TensorDict:
    """The fields ``meta`` names of its rows (one partition per call, as verl uses it)."""
    if meta.size == 0:
        return TensorDict({}, batch_size=[0])
    parts = meta_keys(rt, meta)
    if len(parts) != 1:
        raise ConfigError(f"a BatchMeta must name rows of one partition to be read, got "
                          f"{sorted(parts)}")
    (partition, keys), = parts.items()
    return batch_get(rt, keys, partition, meta.field_names or None)


def put_data(rt: Runtime, data: TensorDict, meta: BatchMeta | None,
             partition: str | None) -> BatchMeta:
    """Write ``data``'s fields to ``meta``'s rows; returns meta with the new fields."""
    if meta is None:
        raise ConfigError(f"async_put needs metadata (a BatchMeta of existing rows), got None "
                          f"(partition_id={partition!r})")
    parts = meta_keys(rt, meta)
    if len(parts) != 1:
        raise ConfigError(f"a BatchMeta must name rows of one partition to be written, got "
                          f"{sorted(parts)}")
    (pid, keys), = parts.items()
    names = write(rt, keys, pid, prepare(data, len(keys)), None)
    out = meta.copy()
    d = rt.get().connection.controller().lookup(partition=pid, keys=keys,
                                                fields=list(names.values()))
    for f, p in names.items():
        out.field_schema[f] = dict(d.schemas.get(p, {}))
    out.keys = list(keys)
    return out
