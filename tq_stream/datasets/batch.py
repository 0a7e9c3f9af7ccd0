"""Batches as the loader yields them: a TensorDict plus the rows' BatchMeta.

The meta (keys, tags, step) rides in the TensorDict as a non-tensor entry
named ``META_KEY``; ``batch_meta(batch)`` reads it and ``select_rows`` slices
a batch together with its meta (jagged fields included).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tensordict import NonTensorStack, TensorDict

from tq_stream.errors import ConfigError
from tq_stream.meta import BatchMeta

META_KEY = "_meta"


STEP_KEY = "_step"


def attach_meta(td: TensorDict, meta: BatchMeta, step: int | None = None) -> TensorDict:
    """Attach ``meta`` and the loader step (which differs from ``meta.step`` when a
    loader reads several partitions) to a batch."""
    td.set_non_tensor(META_KEY, meta)
    td.set_non_tensor(STEP_KEY, meta.step if step is None else int(step))
    return td


def loader_step(batch: TensorDict) -> int:
    """The loader step that produced ``batch``."""
    step = batch.get_non_tensor(STEP_KEY, default=None)
    return batch_meta(batch).step if step is None else int(step)


def batch_meta(batch: TensorDict) -> BatchMeta:
    """The BatchMeta (keys, tags, step) of a batch yielded by a StreamingDataLoader."""
    meta = batch.get_non_tensor(META_KEY, default=None)
    if not isinstance(meta, BatchMeta):
        raise ConfigError(f"batch must come from a StreamingDataset (it carries "
                          f"{META_KEY!r}), got keys {sorted(batch.keys())}")
    return meta


def _take(value: Any, pos: torch.Tensor) -> Any:
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            rows = value.unbind()
            picked = [rows[i] for i in pos.tolist()]
            return torch.nested.nested_tensor(picked, layout=torch.jagged) if picked \
                else value
        return value.index_select(0, pos)
    if isinstance(value, NonTensorStack):
        items = value.tolist()
        return NonTensorStack.from_list([items[i] for i in pos.tolist()])
    raise ConfigError(f"batch values must be tensors or NonTensorStack, got {type(value)}")


def select_rows(batch: TensorDict, positions: Sequence[int] | torch.Tensor) -> TensorDict:
    """Rows ``positions`` of a loader batch, with its meta sliced to match."""
    pos = torch.as_tensor(positions, dtype=torch.int64)
    meta = batch_meta(batch)
    out = TensorDict({}, batch_size=[len(pos)])
    for key in batch.keys():
        if key not in (META_KEY, STEP_KEY):
            out.set(key, _take(batch.get(key), pos))
    return attach_meta(out, meta.select(pos.numpy()), loader_step(batch))
