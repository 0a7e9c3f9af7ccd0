"""What a task's sampler sees of a partition, and the check of what it answers.

Plain functions over a ``PartitionMeta`` and a ``TaskState`` (lock held): the
ready rows as ``Candidates``, the rows not ready yet, and the rule a sampler's
``Selection`` must keep (one non-empty share per DP rank, disjoint, of available
rows).
"""

from __future__ import annotations

import numpy as np

from tq_stream.controller.partition import PartitionMeta
from tq_stream.controller.task import NEW, TaskState
from tq_stream.errors import StateError
from tq_stream.samplers.base import Candidates, Selection


def candidates(part: PartitionMeta, state: TaskState, dp_size: int, step: int,
               limit: int | None = None, index: np.ndarray | None = None) -> Candidates:
    """The ready rows (``index``: those rows instead) as a sampler sees them."""
    if index is None:
        index = state.queue.ordered(limit)
    tags = part.tags
    return Candidates(
        index=index, ready_time=part.write_time[index], dp_size=dp_size,
        closed=part.closed, pending=pending(part, state) if part.closed else 0,
        version=state.version, turn_version=state.version_at(step), step=step,
        partition=part.name,
        _tags=tags.get, _has_tag=tags.columns.__contains__,
    )


def pending(part: PartitionMeta, state: TaskState) -> int:
    """Live rows that are neither available nor handed out: not yet ready."""
    n = min(part.size, state.state.shape[0])
    return int(np.count_nonzero(part.row_mask(n) & (state.state[:n] == NEW)
                                & ~state.queue.avail[:n]))


def check_selection(state: TaskState, sel: Selection, dp_size: int) -> None:
    """StateError unless ``sel`` is ``dp_size`` non-empty, disjoint shares of rows
    available to ``state``."""
    rows = sel.rows
    ok = (len(sel.shares) == dp_size and all(len(s) for s in sel.shares)
          and (len(rows) == 1 or len(np.unique(rows)) == len(rows))
          and bool(state.queue.avail[rows].all()))
    if not ok:
        raise StateError(
            f"sampler {type(state.sampler).__name__} must return {dp_size} non-empty, "
            f"disjoint shares of available rows, got shares of sizes "
            f"{[len(s) for s in sel.shares]}"
        )
