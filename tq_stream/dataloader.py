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

from tq_stream.datasets.batch import batch_meta, copy_meta, loader_step
from tq_stream.datasets.minibatch import minibatches
from tq_stream.datasets.streaming import StreamingDataset
from tq_stream.datasets.workers import check_start_method
from tq_stream.errors import ConfigError, StateError, TQError, check_positive

logger = logging.getLogger(__name__)


def _identity(batch: Any) -> Any:
    return batch


def _stop_workers(batches: Any) -> None:
    """Shut a torch DataLoader iterator's workers down now (one of them died)."""
    shutdown = getattr(batches, "_shutdown_workers", None)
    if shutdown is not None:
        try:
            shutdown()
        except Exception:  # noqa: BLE001 — best effort: the error is raised anyway
            pass


class StreamingDataLoader:
    """Iterates a StreamingDataset through torch's DataLoader (see module docstring).

    Args:
        dataset: the StreamingDataset to read.
        num_workers: DataLoader worker processes (needs a local or Ray stream).
        multiprocessing_context: "fork", "spawn" or "forkserver" (or a multiprocessing
            context) for workers; default: the global start method. ``spawn`` works but
            makes each worker import torch and the main module again before its first
            batch (a SpawnStartWarning says so): prefer "fork" or "forkserver".
        pin_memory: copy batches into pinned memory (with CUDA only).
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
        # pinning happens here, not in torch's pin thread, whose copy would drop the meta
        self._pin = bool(pin_memory) and torch.cuda.is_available()
        self._kwargs: dict[str, Any] = {"batch_size": None, "num_workers": num_workers,
                                        "collate_fn": _identity}
        if num_workers:
            check_start_method(multiprocessing_context)
            self._kwargs["multiprocessing_context"] = multiprocessing_context
            self._kwargs["prefetch_factor"] = prefetch_factor or 2
        self._client = dataset.stream.client()
        self._next_step = dataset.start_step
        self._unacked: list[TensorDict] = []
        self._holds: list[Any] = []  # heartbeats of sessions with batches not yet acked
        self._yielded = False  # a batch was yielded (``_next_step`` is then the next one)
        self._saved_done: list[tuple[str, int]] = []  # yielded before a loaded state
        self._rows: Counter[str] = Counter()  # rows yielded per partition
        self._version: int | None = None  # the version set last (``set_version``)
        self._reported: int | None = None  # the step the controller knows we read

    def _ack_saved(self) -> None:
        """Batches yielded before the restored state_dict was taken count as trained:
        ack them if no one did (a crash after the save, before the next batch)."""
        self.dataset._saved_done, self._saved_done = self._saved_done, []
        self.dataset._ack_saved(self._client)

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
        step, skip = ds.plan  # the step this iteration yields next
        try:
            while True:
                try:
                    # Acks come before waiting: the end of a stream waits for every ack.
                    # torch's SIGCHLD handler raises a worker's death in whatever this
                    # thread runs, the ack as well as the fetch.
                    # The turn first: while a batch is unacked, a wait for a step held
                    # for its turn knows the trainer is alive (``TurnNotReached``).
                    self._reading(step)
                    self.ack()
                    batch = next(batches)
                except StopIteration:
                    return
                except (RuntimeError, OSError) as exc:
                    if not self.num_workers or isinstance(exc, TQError):
                        raise
                    _stop_workers(batches)  # torch's SIGCHLD handler would raise later
                    raise StateError(
                        f"a DataLoader worker of task {ds.task!r} (rank {ds.dp_rank}) "
                        f"failed ({type(exc).__name__}: {exc}); iterate the loader again "
                        f"to resume at the first unfinished step (acked batches are not "
                        f"read again)") from exc
                if self._pin:
                    batch = copy_meta(batch, batch.pin_memory())
                self._unacked.append(batch)
                self._next_step = step = loader_step(batch) + 1
                while step in skip:
                    step += 1
                self._yielded = True
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
            if logger is not None:  # None while the interpreter shuts down
                logger.debug("cancelling loader session %s: %s", session, exc)

    def __len__(self) -> int:
        """Batches per epoch: see ``StreamingDataset.__len__``."""
        return len(self.dataset)

    def __bool__(self) -> bool:
        return True

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

    def _reading(self, step: int) -> None:
        """Tell the controller the training loop waits for ``step`` now, under the
        version set last: a step formed ahead for a predicted version is then formed
        for the real one (rows in time for it are never dropped on a prediction)."""
        ds = self.dataset
        if self._version is None or len(ds.partitions) != 1 or step == self._reported:
            return
        self._client.reading(ds.partitions[0], ds.task, step)
        self._reported = step

    def set_version(self, version: int) -> None:
        """The trainer's current policy version (for staleness-aware samplers); works
        before the first batch too (a resumed trainer sets its version first). It is in
        effect from the next batch on, and steps fetched ahead are formed for the
        highest version the trainer may hold at their turn (one change per
        ``steps_per_version`` steps, see ``Stream.set_admission``), so a
        ``StalenessSampler`` bound holds when a batch reaches the training loop, provided
        the trainer changes its version at most that often. Rows that may be stale at
        that predicted version are only held back: the loader tells the controller which
        step the loop waits for, and that step is formed for the version actually set
        (a row is discarded only if stale against it). A trainer may set its version
        every step, every few steps, or never again."""
        ds = self.dataset
        at = None  # a multi-partition loader's steps are not the partitions' steps
        if len(ds.partitions) == 1:
            if self._yielded:
                at = self._next_step
            else:  # before the first batch: where this rank resumes
                ds.register()
                at = ds.resume_plan()[0]
        for p in ds.partitions:
            self._client.set_version(p, ds.task, version, at_step=at)
        self._version, self._reported = version, at

    def minibatches(self, batch: TensorDict, minibatch_size: int | None = None,
                    epochs: int = 1, shuffle: bool = False, seed: int | None = None, *,
                    num_minibatches: int | None = None,
                    drop_last: bool = False) -> Iterator[TensorDict]:
        """Re-iterate one batch in minibatches for several (PPO) epochs, the same number
        on every rank (see ``tq_stream.datasets.minibatch.minibatches``)."""
        return minibatches(batch, minibatch_size, epochs, shuffle, seed,
                           num_minibatches=num_minibatches, drop_last=drop_last)

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
