"""The staleness bound at yield: a batch fetched ahead is checked against the
trainer's version when the loader hands it to the training loop (issue 20 item 2).

A step's share is checked by the controller for a version (``BatchMeta.turn``) when
it is handed out, which for a batch fetched ahead (a prefetch, a DataLoader worker)
is before the trainer set the version it trains the batch with. When the loader's
version is newer than the batch's ``turn``, it asks the controller for the step
again, under the iteration's own session (which holds the claim): the controller
checks the share against the version set for the step and re-forms it if rows went
stale (``controller/turns.py``); the loader reads the new rows. Every TP/PP peer of
the rank sets the same version and so asks again too: the peers get identical rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from tensordict import TensorDict

from tq_stream.client import Client
from tq_stream.datasets.batch import attach_meta, batch_meta, loader_step
from tq_stream.datasets.streaming import StreamingDataset
from tq_stream.errors import TurnNotReached


def behind(batch: TensorDict, version: int | None) -> bool:
    """``batch`` was checked for an older version than the trainer's ``version``."""
    turn = batch_meta(batch).turn
    return turn is not None and version is not None and version > turn


def recheck(dataset: StreamingDataset, batch: TensorDict,
            version: int | None) -> TensorDict | None:
    """``batch`` if it is within the bound at ``version`` (see the module docstring),
    else the step's share as the controller re-formed it, read afresh; None when no
    row is left for this rank in that step (the loader goes on with the next)."""
    if not behind(batch, version):
        return batch
    meta = batch_meta(batch)
    client = Client(dataset.connection, session=dataset.session)
    while True:
        try:
            again = client.get_meta(meta.partition, dataset.task, meta.step,
                                    dataset.dp_rank, dataset.timeout, replica=dataset.replica)
            break
        except TurnNotReached:  # the trainer lives and moves on: ask again (bounded)
            continue
    if again is None or again.end or not len(again):
        return None
    if np.array_equal(again.index, meta.index):
        return batch  # nothing went stale: the rows already read
    td = client.get_data(again, dataset.fields, ragged=dataset.ragged)
    return attach_meta(td, again, loader_step(batch))


class TrainerVersion:
    """The trainer's version a loader of ``task`` set last, and the step it told the
    controller its training loop waits for."""

    def __init__(self, client: Client, partitions: Sequence[str], task: str) -> None:
        self._client, self._partitions, self._task = client, partitions, task
        self.version: int | None = None  # the version set last (``set_version``)
        self._reported: int | None = None  # the step the controller knows we read

    def reading(self, step: int) -> None:
        """Tell the controller the training loop waits for ``step`` now, under the
        version set last: a step formed ahead for a predicted version is then formed
        for the real one (rows in time for it are never dropped on a prediction)."""
        # every loader of the task says so, not only one that set the version itself: a
        # fresh loader after one that did would otherwise leave steps held for a turn
        if len(self._partitions) != 1 or step == self._reported:
            return
        self._client.reading(self._partitions[0], self._task, step)
        self._reported = step

    def set(self, version: int, at: int | None) -> None:
        """Set ``version`` in effect from loader step ``at`` (None: a multi-partition
        loader, whose steps are not the partitions' steps)."""
        for p in self._partitions:
            self._client.set_version(p, self._task, version, at_step=at)
        self.version, self._reported = version, at


__all__ = ["TrainerVersion", "behind", "recheck"]
