"""How many steps a StreamingDataset yields, when that is known.

Known for a declared ``rows_per_epoch`` (an epoch is ``ceil(rows_per_epoch /
(batch_size * dp_size))`` steps, ``floor`` with ``drop_last``; epochs are aligned
to multiples of that, so a resumed loader finishes the epoch it was in), and for
closed partitions: the steps already formed plus the full steps the rows left
still form, plus a short last step unless ``drop_last`` (when the rows left are at
least one per rank). Rows a sampler discards (staleness, dynamic filtering,
incomplete groups) make this an upper bound; for the sequential sampler and
complete fixed-size groups it is exact. Otherwise ``len()`` raises
LengthUnknownError (a TypeError, as ``len()`` of an iterator does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tq_stream.client import Client
from tq_stream.connection.connection import Connection
from tq_stream.errors import LengthUnknownError


def steps_for_rows(rows: int, batch_size: int, dp_size: int, drop_last: bool) -> int:
    """Steps that ``rows`` rows form."""
    full, left = divmod(rows, batch_size * dp_size)
    return full + (1 if left >= dp_size and not drop_last else 0)


class Steps(Protocol):
    """What the step count needs of a dataset (``StreamingDataset`` has it)."""

    @property
    def connection(self) -> Connection: ...
    @property
    def partitions(self) -> Sequence[str]: ...
    @property
    def task(self) -> str: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def dp_size(self) -> int: ...
    @property
    def drop_last(self) -> bool: ...
    @property
    def rows_per_epoch(self) -> int | None: ...


def epoch_steps(dataset: Steps) -> int | None:
    """Steps of one declared epoch (None without ``rows_per_epoch``)."""
    if dataset.rows_per_epoch is None:
        return None
    per = int(dataset.batch_size) * int(dataset.dp_size)
    n = int(dataset.rows_per_epoch)
    steps: int = max(1, n // per if dataset.drop_last else -(-n // per))
    return steps


def epoch_end(dataset: Steps, start_step: int) -> int | None:
    """The first step after the epoch ``start_step`` is in (None: no declared epoch)."""
    size = epoch_steps(dataset)
    return None if size is None else (start_step // size + 1) * size


def known_steps(dataset: Steps) -> int:
    """``len(dataset)`` (see the module docstring).

    Raises:
        LengthUnknownError: no ``rows_per_epoch`` and a partition is still open.
    """
    size = epoch_steps(dataset)
    if size is not None:
        return size
    client = Client(dataset.connection)
    total = 0
    for partition in dataset.partitions:
        info = client.task_rows(partition, dataset.task)
        if not info["closed"]:
            raise LengthUnknownError(
                f"len() needs a known number of steps: partition {partition!r} must be "
                f"closed (stream.close_partition) or the dataset must declare "
                f"rows_per_epoch=N, got an open partition with {info['remaining']} rows "
                f"left for task {dataset.task!r}")
        total += info["formed"] + steps_for_rows(info["remaining"], dataset.batch_size,
                                                 dataset.dp_size, dataset.drop_last)
    return total
