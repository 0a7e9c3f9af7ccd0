"""Moving a batch's column bytes to and from the storage units that hold its rows.

Rows of one batch may live in several units. Writes split the columns by
unit; reads fetch every unit's part (concurrently when there are several)
and put the rows back in batch order with one copy per field.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import torch

from tq_stream.backends.base import StorageUnit
from tq_stream.backends.shared import GathersInto
from tq_stream.buffers import POOL
from tq_stream.columns import Column, Ragged, concat, dtype_from_name, span, take
from tq_stream.multiragged import MultiRagged

_POOL: ThreadPoolExecutor | None = None
_POOL_PID = -1


def _pool() -> ThreadPoolExecutor:
    # A pool inherited through fork has no threads in the child: make a new one there.
    global _POOL, _POOL_PID
    if _POOL is None or _POOL_PID != os.getpid():
        _POOL = ThreadPoolExecutor(max_workers=8, thread_name_prefix="tq-io")
        _POOL_PID = os.getpid()
    return _POOL


def _groups(unit: np.ndarray) -> list[tuple[int, np.ndarray]]:
    if len(unit) == 1:  # one row (small operations): skip the sort
        return [(int(unit[0]), np.zeros(1, dtype=np.int64))]
    units = np.unique(unit)
    if len(units) == 1:
        return [(int(units[0]), np.arange(len(unit)))]
    return [(int(u), np.flatnonzero(unit == u)) for u in units.tolist()]


_T = TypeVar("_T")
_R = TypeVar("_R")


def _map(fn: Callable[[_T], _R], items: list[_T]) -> list[_R]:
    if len(items) == 1:
        return [fn(items[0])]
    return list(_pool().map(fn, items))


def _part(generations: np.ndarray | None, pos: np.ndarray) -> np.ndarray | None:
    return None if generations is None else generations[pos]


def store(units: Sequence[Any], partition: str, unit: np.ndarray, slot: np.ndarray,
          columns: Mapping[str, Column], generations: np.ndarray | None = None) -> None:
    """Write ``columns`` (rows aligned with ``unit``/``slot``) into their units.

    ``generations``: the rows' occupancy tokens (``backends.base.occupancy``).
    """
    if len(unit) == 1:  # one row (a small put): one unit, no grouping
        units[int(unit[0])].put(partition, slot, columns, generations)
        return
    groups = _groups(unit)
    if len(groups) == 1:
        units[groups[0][0]].put(partition, slot, columns, generations)
        return

    def put(group: tuple[int, np.ndarray]) -> None:
        u, pos = group
        if int(pos[-1]) - int(pos[0]) == len(pos) - 1:  # a run (``_groups`` sorts): views
            part = {f: span(c, int(pos[0]), int(pos[-1]) + 1) for f, c in columns.items()}
        else:
            tpos = torch.from_numpy(pos)
            part = {f: take(c, tpos) for f, c in columns.items()}
        units[u].put(partition, slot[pos], part, _part(generations, pos))

    _map(put, groups)


def _tiles(groups: list[tuple[int, np.ndarray]]) -> list[int] | None:
    """The groups in batch order when each is a run of consecutive rows (the
    controller places a put's rows in one block per unit), so their parts joined in
    that order are the batch: no gather. None when some group is not a run."""
    if any(int(pos[-1]) - int(pos[0]) != len(pos) - 1 for _, pos in groups):
        return None
    return sorted(range(len(groups)), key=lambda i: int(groups[i][1][0]))


def _in_batch_order(joined: Column, groups: list[tuple[int, np.ndarray]]) -> Column:
    """Rows joined group after group, put back in batch order."""
    order = np.argsort(np.concatenate([pos for _, pos in groups]), kind="stable")
    if isinstance(joined, Ragged | MultiRagged):
        return take(joined, torch.from_numpy(order))
    return [joined[i] for i in order.tolist()]


def _destinations(units: Sequence[StorageUnit], groups: list[tuple[int, np.ndarray]], n: int,
                  fields: Sequence[str], schemas: Mapping[str, Any] | None
                  ) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor] | None]]:
    """Pooled outputs for dense fields, and per group the slices of them that rows of
    the group fill (only where its rows are consecutive in the batch and its unit can
    gather into a given tensor): then each byte is copied once."""
    outs: dict[str, torch.Tensor] = {}
    for f in fields:
        s = (schemas or {}).get(f)
        if s is not None and s.kind == "dense":
            outs[f] = POOL.empty((n, *s.shape), dtype_from_name(s.dtype))
    into: list[dict[str, torch.Tensor] | None] = []
    for u, pos in groups:
        run = len(pos) and int(pos[-1]) - int(pos[0]) == len(pos) - 1
        ok = outs and run and isinstance(units[u], GathersInto)
        into.append({f: t[int(pos[0]) : int(pos[-1]) + 1] for f, t in outs.items()}
                    if ok else None)
    return outs, into


def load(units: Sequence[StorageUnit], partition: str, unit: np.ndarray, slot: np.ndarray,
         fields: Sequence[str], generations: np.ndarray | None = None,
         schemas: Mapping[str, Any] | None = None) -> dict[str, Column]:
    """Read ``fields`` of rows (aligned with ``unit``/``slot``), in that order.

    ``generations``: the rows' occupancy tokens; a row whose slot was cleared or
    reused since raises StateError instead of returning another row's values.
    ``schemas`` (field -> FieldSchema) lets rows from several units land in one
    output with a single copy.
    """
    if len(unit) == 0:
        return {}
    groups = _groups(unit)
    if len(groups) == 1:
        u, pos = groups[0]
        return units[u].get(partition, slot[pos], list(fields), _part(generations, pos))
    outs, into = _destinations(units, groups, len(unit), fields, schemas)

    def fetch(i: int) -> dict[str, Column]:
        u, pos = groups[i]
        args = (partition, slot[pos], list(fields), _part(generations, pos))
        unit = units[u]
        if into[i] and isinstance(unit, GathersInto):
            return unit.get_into(*args, into[i])
        return unit.get(*args)

    parts = _map(fetch, list(range(len(groups))))
    tiles = _tiles(groups)
    out: dict[str, Column] = {}
    for f in fields:
        cols = [p[f] for p in parts]
        if isinstance(cols[0], torch.Tensor):
            first = cols[0]
            res = outs.get(f)
            if res is None or res.dtype != first.dtype or res.shape[1:] != first.shape[1:]:
                res = POOL.empty((len(unit), *first.shape[1:]), first.dtype)
            for (_, pos), c in zip(groups, cols, strict=True):
                part = res[int(pos[0]) : int(pos[-1]) + 1]
                if c.data_ptr() == part.data_ptr() and c.shape == part.shape:
                    continue  # the unit gathered straight into the output
                res[torch.from_numpy(pos)] = c
            out[f] = res
        elif tiles is not None:
            out[f] = concat([cols[i] for i in tiles])  # joined in batch order: no gather
        else:
            out[f] = _in_batch_order(concat(cols), groups)
    return out
