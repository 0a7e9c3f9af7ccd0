"""StreamingDataLoader: a real torch DataLoader over a StreamingDataset, plus acks.

The loader wraps (does not subclass) ``torch.utils.data.DataLoader``. It acks a
batch in the training process when the next batch is requested (or when
``ack()`` is called), so rows are acked only after the training step that used
them, whichever worker process fetched them. ``state_dict()`` has no side
effects.

Each iteration is a consumer session whose leases the process's heartbeat keeps
alive (workers renew what they fetched ahead, this process what it yielded), so
a slow step never loses its batch; a crashed trainer's rows go to its
replacement. A new iteration, a fresh loader or one restored from an older
``state_dict`` resumes at the first step this rank has not fully acked.

Example:
    >>> loader = tq.StreamingDataLoader(ds, num_workers=0)
    >>> for batch in loader:
    ...     for mb in loader.minibatches(batch, minibatch_size=4, epochs=2, shuffle=True):
    ...         train_step(mb)
    >>> state = loader.state_dict()          # resume later with load_state_dict(state)
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from tensordict import TensorDict
from torch.utils.data import DataLoader

from tq_stream.datasets.batch import batch_meta, loader_step, select_rows
from tq_stream.datasets.streaming import StreamingDataset
from tq_stream.errors import ConfigError, LeaseError, check_positive

logger = logging.getLogger(__name__)


def _identity(batch: Any) -> Any:
    return batch


class StreamingDataLoader:
    """Iterates a StreamingDataset through torch's DataLoader (see module docstring).

    Args:
        dataset: the StreamingDataset to read.
        num_workers: DataLoader worker processes (needs a local or Ray stream).
        multiprocessing_context: "fork", "spawn" or "forkserver" for workers.
        prefetch_factor: batches each worker fetches ahead.
    """

    STATE_KEYS = ("partition", "task", "dp_rank", "step", "yielded")

    def __init__(self, dataset: StreamingDataset, num_workers: int = 0,
                 multiprocessing_context: str | None = None,
                 prefetch_factor: int | None = None, pin_memory: bool = False) -> None:
        if not isinstance(dataset, StreamingDataset):
            raise ConfigError(f"dataset must be a StreamingDataset, got {type(dataset).__name__}")
        self.dataset = dataset
        dataset.auto_ack = False
        self.num_workers = check_positive("num_workers", num_workers, allow_zero=True)
        if num_workers and getattr(dataset.stream, "mode", "") == "embedded":
            raise ConfigError(f"num_workers must be 0 with an embedded stream (its controller "
                              f"lives in this process), got {num_workers}; use "
                              f"tq.init(mode='local') for worker processes")
        self._kwargs: dict[str, Any] = {"batch_size": None, "num_workers": num_workers,
                                        "collate_fn": _identity, "pin_memory": pin_memory}
        if num_workers:
            self._kwargs["multiprocessing_context"] = multiprocessing_context
            self._kwargs["prefetch_factor"] = prefetch_factor or 2
        self._client = dataset.stream.client()
        self._next_step = dataset.start_step
        self._unacked: list[TensorDict] = []
        self._holds: list[Any] = []  # heartbeats of sessions with batches not yet acked
        self._saved_done: list[tuple[str, int]] = []  # yielded before a loaded state
        self._rows: Counter[str] = Counter()  # rows yielded per partition

    def _ack_saved(self) -> None:
        """Batches yielded before the restored state_dict was taken count as trained:
        ack them if no one did (a crash after the save, before the next batch)."""
        ds, todo = self.dataset, self._saved_done
        self._saved_done = []
        for partition, step in todo:
            try:
                meta = self._client.get_meta(partition, ds.task, step, ds.dp_rank,
                                             timeout=ds.timeout, replica=ds.replica)
                if meta is not None and not meta.end:
                    self._client.ack(meta)
            except LeaseError:
                pass  # acked already

    def __iter__(self) -> Iterator[TensorDict]:
        ds = self.dataset
        ds.register()
        self._ack_saved()
        self.ack()  # batches of an earlier iteration: they were yielded, so they are done
        ds.start_step = self._next_step
        ds.session = uuid.uuid4().hex
        ds.plan = ds.resume_plan()
        for p in ds.partitions:  # what workers fetched ahead and this process yields
            self._holds.append(ds.stream._keeper().hold(p, ds.task, ds.session,
                                                        ds.lease_timeout))
        batches = iter(DataLoader(ds, **self._kwargs))
        try:
            while True:
                self.ack()  # before waiting: the end of a stream waits for every ack
                try:
                    batch = next(batches)
                except StopIteration:
                    return
                self._unacked.append(batch)
                self._next_step = loader_step(batch) + 1
                self._rows[batch_meta(batch).partition] += len(batch_meta(batch))
                yield batch
        finally:
            self._cancel(ds.session)

    def _cancel(self, session: str) -> None:
        """End the iteration's waits in every worker, so workers stop by themselves
        when the loop stops (torch's shutdown would wait for each, then kill it)."""
        try:
            self._client._controller.cancel(session=session)
        except Exception as exc:  # a closed stream: nothing waits any more
            logger.debug("cancelling loader session %s: %s", session, exc)

    def ack(self, batch: TensorDict | None = None) -> None:
        """Ack ``batch`` (default: every batch yielded and not yet acked)."""
        todo = self._unacked if batch is None else [batch]
        for b in todo:
            self._client.ack(batch_meta(b))
        self._unacked = [] if batch is None else [
            b for b in self._unacked if all(b is not t for t in todo)]
        if not self._unacked and len(self._holds) > len(self.dataset.partitions):
            for h in self._holds[: -len(self.dataset.partitions)]:  # earlier iterations'
                h.close()
            del self._holds[: -len(self.dataset.partitions)]

    def set_version(self, version: int) -> None:
        """The trainer's current policy version (for staleness-aware samplers); works
        before the first batch too (a resumed trainer sets its version first)."""
        ds = self.dataset
        for p in ds.partitions:
            self._client.set_version(p, ds.task, version)

    def minibatches(self, batch: TensorDict, minibatch_size: int, epochs: int = 1,
                    shuffle: bool = False, seed: int | None = None) -> Iterator[TensorDict]:
        """Re-iterate one batch in mini-batches for several (PPO) epochs."""
        check_positive("minibatch_size", minibatch_size)
        check_positive("epochs", epochs)
        n = batch.batch_size[0]
        gen = torch.Generator().manual_seed(seed if seed is not None else 0)
        for _ in range(epochs):
            order = torch.randperm(n, generator=gen) if shuffle else torch.arange(n)
            for start in range(0, n, minibatch_size):
                yield select_rows(batch, order[start : start + minibatch_size])

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands (no side effects: nothing is acked). A loader
        resumed from it, however old, continues at the first step its rank has not
        fully acked, skipping steps acked since it was saved."""
        ds = self.dataset
        yielded = [[p, s] for p, s in self._saved_done] + [
            [m.partition, m.step] for m in (batch_meta(b) for b in self._unacked)]
        return {"partition": ds.partition, "task": ds.task, "dp_rank": ds.dp_rank,
                "step": self._next_step, "yielded": yielded}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from a saved state (see ``state_dict``)."""
        if set(state) != set(self.STATE_KEYS):
            raise ConfigError(f"state must have keys {sorted(self.STATE_KEYS)}, got "
                              f"{sorted(state)}")
        ds = self.dataset
        mine = (ds.partition, ds.task, ds.dp_rank)
        theirs = (state["partition"], state["task"], state["dp_rank"])
        if mine != theirs:
            raise ConfigError(f"state must come from a loader of (partition, task, dp_rank) "
                              f"{mine}, got {theirs}")
        self._next_step = check_positive("state['step']", state["step"], allow_zero=True)
        self._unacked = []
        self._saved_done = [(str(p), int(s)) for p, s in state["yielded"]]

    def stats(self) -> dict[str, Any]:
        """This loader's task counters per partition (handed out, acked, discarded by
        reason...) and the rows this loader yielded from each partition."""
        ds = self.dataset
        everything = self._client._controller.stats()
        return {
            "rows": {p: self._rows[p] for p in ds.partitions},
            "tasks": {p: everything.get(p, {}).get("tasks", {}).get(ds.task, {})
                      for p in ds.partitions},
        }
