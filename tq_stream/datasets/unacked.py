"""UnackedBatches: the batches a loader yielded that the training loop has not acked.

A ``StreamingDataLoader`` acks them when the next batch is asked for (or on ``ack()``),
acks the last one of a loop left by ``break`` (``ack_left``), and gives them back when
the loop is left by an exception or by ``release()`` (``give_back``). It also keeps the
lease holds of the iterations they came from: a hold goes once no batch of its
iteration is left unacked.
"""

from __future__ import annotations

import logging

from tensordict import TensorDict

from tq_stream.client import Client
from tq_stream.datasets.batch import batch_meta, loader_step
from tq_stream.errors import LeaseTakenOver
from tq_stream.leases import Hold

logger = logging.getLogger(__name__)


class UnackedBatches:
    """The yielded, unacked batches of one loader of ``task`` (rank ``dp_rank``),
    reading ``partitions`` partitions through ``client``."""

    def __init__(self, client: Client, task: str, dp_rank: int, partitions: int) -> None:
        self._client, self._task, self._rank = client, task, dp_rank
        self._partitions = partitions
        self.batches: list[TensorDict] = []
        self._holds: list[Hold] = []  # heartbeats of sessions with batches not yet acked

    def __len__(self) -> int:
        return len(self.batches)

    def steps(self) -> list[int]:
        """The loader steps of the batches, sorted."""
        return sorted({loader_step(b) for b in self.batches})

    def hold(self, hold: Hold) -> None:
        """Keep ``hold`` (a new iteration's, of one partition) while batches need it."""
        self._holds.append(hold)

    def ack(self, batch: TensorDict | None = None) -> None:
        """Ack ``batch`` (default: every batch). Raises LeaseTakenOver (once) for a batch
        another reader took over; that batch is dropped all the same."""
        todo = self.batches if batch is None else [batch]
        taken: LeaseTakenOver | None = None
        for b in todo:
            try:
                self._client.ack(batch_meta(b))
            except LeaseTakenOver as exc:  # not this loader's to ack any more
                taken = taken or exc
        self.batches = [] if batch is None else [
            b for b in self.batches if all(b is not t for t in todo)]
        n = self._partitions
        if not self.batches and len(self._holds) > n:
            for h in self._holds[:-n]:  # earlier iterations'
                h.close()
            del self._holds[:-n]
        if taken is not None:
            raise taken

    def ack_left(self) -> None:
        """Ack the batches of a loop left by ``break``/``return`` right there: a process
        that exits after the loop must not leave them leased, to be trained again by the
        next reader once the lease expires. An ack that fails here (the generator is
        closing: nothing can be raised at the ``break``) is logged; the batches stay
        unacked, and ``ack()`` or the next iteration acks them."""
        try:
            self.ack()
        except Exception as exc:  # noqa: BLE001 — logged; retried by ack()/iteration
            if logger is not None:  # None while the interpreter shuts down
                logger.warning("acking step(s) %s of task %r (rank %d) after the loop was "
                               "left: %s; call loader.ack() (the next iteration also "
                               "acks them)", self.steps(), self._task, self._rank, exc)

    def give_back(self, quiet: bool = True) -> None:
        """Release the batches. ``quiet``: a closing generator logs a failed release (the
        lease then expires and the rows come back after ``lease_timeout``) instead of
        raising."""
        todo, self.batches = self.batches, []
        for b in todo:
            try:
                self._client.release(batch_meta(b))
            except Exception as exc:
                if not quiet:
                    raise
                if logger is not None:  # None while the interpreter shuts down
                    logger.warning("giving back step %d of task %r: %s (its rows come "
                                   "back once its lease expires)", batch_meta(b).step,
                                   self._task, exc)
