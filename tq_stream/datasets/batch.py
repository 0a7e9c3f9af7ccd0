"""Batches as the loader yields them: a TensorDict of the requested fields only.

The rows' BatchMeta (keys, tags, step) and the loader step ride on the TensorDict as
a plain instance attribute, not as entries, so ``batch.keys()`` are the requested
fields and ``model(**batch)`` works. The attribute survives the DataLoader's
identity collate and the pickling that carries a batch out of a worker process
(tensordict's reducer keeps the instance dict).

TensorDict operations that build a new TensorDict (``batch[:2]``, ``batch.split(2)``,
``batch.to(device)``, ``clone()``) do not carry it: ``batch_meta`` of such a batch
raises an error pointing at ``select_rows`` / ``split_rows``, which slice the rows
and their meta together (jagged fields included). ``batch_meta`` also checks that
the meta still describes as many rows as the batch holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase

from tq_stream.buffers import indexable
from tq_stream.errors import ConfigError
from tq_stream.meta import BatchMeta

_ATTR = "_tq_batch"  # the instance attribute holding a batch's _Attached


@dataclass(frozen=True)
class _Attached:
    meta: BatchMeta
    step: int


def attach_meta(td: TensorDict, meta: BatchMeta, step: int | None = None) -> TensorDict:
    """Attach ``meta`` and the loader step (which differs from ``meta.step`` when a
    loader reads several partitions) to a batch; returns ``td``."""
    rows = td.batch_size[0] if td.batch_size else 0
    if len(meta) != rows:
        raise ConfigError(f"meta must describe the batch's {rows} rows, got {len(meta)}")
    td.__dict__[_ATTR] = _Attached(meta, meta.step if step is None else int(step))
    return td


def copy_meta(source: TensorDictBase, target: TensorDictBase) -> TensorDictBase:
    """Attach the meta of ``source`` to ``target``, a TensorDict of the same rows
    (e.g. ``source.pin_memory()``); returns ``target``."""
    info = _attached(source)
    return attach_meta(target, info.meta, info.step)


def _attached(batch: TensorDictBase) -> _Attached:
    info = batch.__dict__.get(_ATTR) if isinstance(batch, TensorDictBase) else None
    if not isinstance(info, _Attached):
        raise ConfigError(
            f"batch must be a batch a StreamingDataLoader yielded, or made from one with "
            f"tq.select_rows / tq.split_rows; got a {type(batch).__name__} without row "
            f"metadata (indexing, split, .to() and clone() build a new TensorDict that does "
            f"not carry it: call tq.batch_meta(batch) before, or slice with tq.select_rows)"
        )
    rows = batch.batch_size[0] if batch.batch_size else 0
    if rows != len(info.meta):
        raise ConfigError(
            f"batch metadata describes {len(info.meta)} rows but the batch holds {rows}: "
            f"slice batches with tq.select_rows / tq.split_rows to keep them consistent"
        )
    return info


def batch_meta(batch: TensorDictBase) -> BatchMeta:
    """The BatchMeta (keys, tags, step) of a batch yielded by a StreamingDataLoader.

    Raises:
        ConfigError: if ``batch`` carries no metadata (e.g. it was indexed with
            ``batch[:2]``; use ``tq.select_rows``) or metadata for other rows.
    """
    return _attached(batch).meta


def loader_step(batch: TensorDictBase) -> int:
    """The loader step that produced ``batch``."""
    return _attached(batch).step


def _take(key: str, value: object, pos: torch.Tensor) -> torch.Tensor | TensorDictBase:
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            rows = value.unbind()
            picked = [rows[i] for i in pos.tolist()]
            if not picked:  # no rows: an empty jagged tensor of the same row shape
                return torch.nested.nested_tensor_from_jagged(
                    value.values()[:0], torch.zeros(1, dtype=torch.int64))
            return torch.nested.nested_tensor(picked, layout=torch.jagged)
        return indexable(value).index_select(0, pos).view(value.dtype)
    if isinstance(value, NonTensorStack):
        items = value.tolist()
        return NonTensorStack.from_list([items[i] for i in pos.tolist()])
    if isinstance(value, TensorDictBase) and not isinstance(value, NonTensorData):
        return _take_rows(value, pos)
    raise ConfigError(f"batch field {key!r} must be a tensor, NonTensorStack or TensorDict "
                      f"to select rows of, got {type(value).__name__}")


def _take_rows(td: TensorDictBase, pos: torch.Tensor) -> TensorDict:
    """Rows ``pos`` of every field; a NonTensorData (one value for the whole batch, as
    the entries of a ``shared="index"`` read: ``<f>_index`` is a row field and keeps
    pointing into them) is kept whole, not copied."""
    out = TensorDict({}, batch_size=[len(pos)])
    for key in td.keys():
        value = td.get(key)
        if isinstance(value, NonTensorData):
            out.set_non_tensor(key, value.data)
        else:
            out.set(key, _take(key, value, pos))
    return out


def select_rows(batch: TensorDictBase, positions: Sequence[int] | torch.Tensor) -> TensorDict:
    """Rows ``positions`` of a loader batch, with its meta sliced to match.

    Args:
        positions: integer row positions (or a boolean mask) into ``batch``.
    """
    info = _attached(batch)
    pos = torch.as_tensor(positions)
    if pos.dtype == torch.bool:
        if pos.shape != (len(info.meta),):
            raise ConfigError(f"a mask must have {len(info.meta)} entries, got "
                              f"{tuple(pos.shape)}")
        pos = torch.nonzero(pos).flatten()
    pos = pos.to(torch.int64).flatten()
    n = len(info.meta)
    if len(pos) and (int(pos.min()) < -n or int(pos.max()) >= n):
        raise ConfigError(f"positions must be in [0, {n}), got {pos.tolist()[:8]}")
    pos = torch.where(pos < 0, pos + n, pos)
    out = _take_rows(batch, pos)
    return attach_meta(out, info.meta.select(pos.numpy()), info.step)


def split_rows(batch: TensorDictBase, split_size: int | Sequence[int]) -> list[TensorDict]:
    """``batch.split(split_size)`` that keeps each part's meta (see ``select_rows``).

    Args:
        split_size: rows per part (the last part may be shorter), or the list of part
            sizes (summing to the batch's rows).
    """
    n = len(_attached(batch).meta)
    if isinstance(split_size, int) and not isinstance(split_size, bool):
        if split_size < 1:
            raise ConfigError(f"split_size must be an int >= 1, got {split_size}")
        sizes = [min(split_size, n - s) for s in range(0, n, split_size)]
    else:
        sizes = list(split_size)  # type: ignore[arg-type]  # an int was handled above
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in sizes) \
                or sum(sizes) != n:
            raise ConfigError(f"split_size must be an int >= 1 or sizes >= 0 summing to "
                              f"the batch's {n} rows, got {split_size!r}")
    bounds = torch.cumsum(torch.tensor([0, *sizes]), 0).tolist()
    pairs = zip(bounds[:-1], bounds[1:], strict=True)
    return [select_rows(batch, torch.arange(a, b)) for a, b in pairs]
