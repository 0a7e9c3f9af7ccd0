"""Reading rows by key: lookup, locate, listing, keys, placement and the stats of a
partition, as functions of its ``PartitionMeta`` (and its tasks' ``TaskState``).

The Controller calls them with its lock held and changes nothing through them; what
changes rows (``clear``, ``set_tags``) stays in the Controller.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tq_stream import fieldpath
from tq_stream.controller.partition import PartitionMeta
from tq_stream.controller.report import add_measurements
from tq_stream.controller.task import TaskState
from tq_stream.controller.timings import Timings
from tq_stream.errors import KeyConflictError, StateError
from tq_stream.messages.reads import Found, Located, TagColumns


def lookup(part: PartitionMeta, keys: Sequence[str],
           fields: Sequence[str] | None = ()) -> Found:
    """Placement of existing ``keys`` whose ``fields`` are all written.

    ``fields=None`` means every field written for all of ``keys``; a parent path
    (``"obs"``) means every field under it (``fieldpath.resolve``).
    """
    idx = existing(part, keys)
    if fields is None:
        fields = [f for f, r in part.ready.items() if r[idx].all()]
        if not fields:
            raise StateError(f"keys {list(keys)[:5]} of partition {part.name!r} "
                             f"must share a written field to be read, they share none")
    else:  # a parent path "obs" reads every field under it
        fields = fieldpath.resolve(fields, part.ready)
    for f in fields:
        r = part.ready.get(f)
        if r is None or not r[idx].all():
            bad = [k for k, i in zip(keys, idx.tolist(), strict=True)
                   if r is None or not r[i]][:5]
            raise StateError(f"field {f!r} must be written before it is read; "
                             f"it is not for keys {bad} of partition {part.name!r}")
    return Found(**placement(part, idx, fields))


def locate(part: PartitionMeta, keys: Sequence[str]) -> Located:
    """Where existing ``keys`` live and how many of them hold each field, for a reader
    that picks its fields from what its rows hold.

    Returns ``lookup``'s placement without tags or a field check: ``fields`` is
    empty, ``held`` maps each field some of ``keys`` hold to how many hold it
    (``len(keys)``: all), ``schemas`` covers those fields.
    """
    idx = existing(part, keys)
    held = {}
    for f, r in part.ready.items():
        count = int(np.count_nonzero(r[idx]))
        if count:
            held[f] = count
    return Located(
        partition=part.name, index=idx, keys=part.keys[idx].tolist(),
        unit=part.unit[idx], slot=part.slot[idx], generation=part.generation[idx],
        fields=[], held=held,
        schemas={f: part.schemas[f].to_dict() for f in held if f in part.schemas},
        shared=part.shared.describe(part, idx, list(held)))


def placement(part: PartitionMeta, idx: np.ndarray, fields: Sequence[str]) -> dict[str, Any]:
    """The fields of a ``Found`` (or a ``StepMeta``'s) for rows ``idx``, by name: where
    they live; a parent path in ``fields`` is given as the fields under it, so a reader
    of ``"obs"`` reads ``"obs.image"`` and ``"obs.state"``."""
    fields = fieldpath.resolve(fields, part.schemas)
    return {
        "partition": part.name, "index": idx,
        "keys": [part.keys[idx[0]]] if len(idx) == 1 else part.keys[idx].tolist(),
        "unit": part.unit[idx], "slot": part.slot[idx], "generation": part.generation[idx],
        "tags": part.tags.rows_as_dicts(idx),
        "fields": list(fields),
        "schemas": {f: part.schemas[f].to_dict() for f in fields if f in part.schemas},
        "shared": part.shared.describe(part, idx, fields),
    }


def list_rows(part: PartitionMeta, keys: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Every row: key, tags and the fields written; oldest (first created) first.
    ``keys``: only those rows, in ``keys`` order (a key with no row is left out)."""
    if keys is None:
        rows = part.oldest_first(part.shared.rows(np.flatnonzero(part.used)))
    else:
        rows = part.lookup(list(keys))
        rows = rows[rows >= 0]
    tags = part.tags.rows_as_dicts(rows)
    return [{"key": part.keys[r], "tags": t, "fields": part.fields_of(r)}
            for r, t in zip(rows.tolist(), tags, strict=True)]


def list_tags(part: PartitionMeta) -> TagColumns:
    """Keys and tags of every row, oldest first, as columns (cheap to send)."""
    rows = part.oldest_first(part.shared.rows(np.flatnonzero(part.used)))
    tags = part.tags
    cols: dict[str, list[Any]] = {}
    for name in tags.columns:
        present = tags.present[name][rows]
        if present.any():
            pos = np.flatnonzero(present)
            cols[name] = [pos, tags.values(name, rows[pos])]
    return TagColumns(keys=part.keys[rows].tolist(), tags=cols)


def keys_of(part: PartitionMeta, index: Sequence[int]) -> list[str]:
    """Keys of rows ``index`` (a BatchMeta's ``index``), which must still exist."""
    idx = np.asarray(index, dtype=np.int64)
    ok = (idx >= 0) & (idx < part.size)
    ok[ok] = part.used[idx[ok]]
    if not ok.all():
        raise KeyConflictError(f"index must name live rows of partition {part.name!r}, "
                               f"got {idx[~ok].tolist()[:5]}")
    keys: list[str] = part.keys[idx].tolist()
    return keys


def partition_stats(part: PartitionMeta, tasks: Mapping[str, TaskState],
                    timings: Timings, now: float) -> dict[str, Any]:
    """Rows, fields, writer waits and per-task counters, rates and timings of one
    partition (the keys are documented by ``tq_stream.stats.PartitionStats``)."""
    out: dict[str, Any] = {
        "rows": part.live - part.shared.count, "capacity": part.capacity,
        "closed": part.closed, "shared": part.shared.stats(),
        "consumers": None if part.consumers is None else list(part.consumers),
        "rows_lost": part.lost.rows, "lost_writes_skipped": part.lost.skipped,
        "held": held(part, tasks),
        "fields": {f: s.describe() for f, s in part.schemas.items()},
        "tasks": {t: s.stats(now) for t, s in tasks.items()},
    }
    add_measurements(out, part, dict(tasks), timings, now)
    return out


def held(part: PartitionMeta, tasks: Mapping[str, TaskState]) -> dict[str, int]:
    """Why live rows are not freed: per declared consumer, the rows it has not acked
    or discarded yet; ``"undeclared"`` for a partition without declared consumers
    (its rows stay until cleared)."""
    rows = part.shared.rows(np.flatnonzero(part.used))
    if part.consumers is None:
        return {"undeclared": len(rows)}
    out = {}
    for name in part.consumers:
        task = tasks.get(name)
        out[name] = len(rows) if task is None else len(rows) - len(task.finished_rows(rows))
    return out


def existing(part: PartitionMeta, keys: Sequence[str]) -> np.ndarray:
    """Row index of each of ``keys``; KeyConflictError naming the first missing ones
    (a shared entry's own key names no row)."""
    idx = part.lookup(list(keys))
    if part.shared.count:
        idx[idx >= 0] = np.where(part.shared.entry[idx[idx >= 0]], -1, idx[idx >= 0])
    if (idx < 0).any():
        missing = [k for k, i in zip(keys, idx.tolist(), strict=True) if i < 0][:5]
        raise KeyConflictError(f"keys must exist in partition {part.name!r}, missing {missing}")
    return idx


__all__ = ["existing", "held", "keys_of", "list_rows", "list_tags", "locate", "lookup",
           "partition_stats", "placement"]
