"""StreamingDataLoader: a real torch DataLoader over a StreamingDataset, plus acks.

The loader wraps (does not subclass) ``torch.utils.data.DataLoader``. It acks a
batch in the training process when the next batch is requested (or when
``ack()`` is called), so rows are acked only after the training step that used
them, whichever worker process fetched them. ``state_dict()`` has no side
effects.

A loop left by ``break`` or ``return`` counts its last batch as trained (acked
when the loader is iterated again); a loop left by an exception (or in any way not
known to be a jump, see ``release``) gives it back, so iterating the loader again
trains it first. ``release()`` gives a batch back on purpose. A DataLoader worker
that dies is a ``StateError`` naming task and rank, raised when the next batch is
asked for even if it died during the training step; one that lives but delivers
nothing within ``timeout`` is a ``WorkerStalled`` (see ``datasets.workers``).

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

import atexit
import logging
import uuid
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from tensordict import TensorDict
from torch.utils.data import DataLoader

from tq_stream.client import Client
from tq_stream.datasets import at_yield, loop_exit, worker_deaths
from tq_stream.datasets.batch import batch_meta, copy_meta, loader_step
from tq_stream.datasets.minibatch import minibatches
from tq_stream.datasets.saved_state import LOADER_KEYS, loader_loaded, take_over
from tq_stream.datasets.streaming import RELAY, StreamingDataset
from tq_stream.datasets.unacked import UnackedBatches
from tq_stream.datasets.workers import (
    check_start_method,
    stall_timeout,
    stop_workers,
    worker_failure,
)
from tq_stream.errors import (
    ConfigError,
    StateError,
    TQError,
    check_positive,
)

logger = logging.getLogger(__name__)
_open: weakref.WeakSet[StreamingDataLoader] = weakref.WeakSet()  # open iterations


@atexit.register
def _close_open_loops() -> None:
    """At interpreter exit, close every open iteration while modules still work (their
    generators would otherwise be closed during finalization, with globals gone). Its
    batches stay leased: they come back once the leases expire."""
    for loader in list(_open):
        loader.close_at_exit()


def _identity(batch: TensorDict) -> TensorDict:
    return batch


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
        timeout: (with workers) seconds to wait for a batch from the workers before
            ``WorkerStalled``: a worker that lives but delivers neither a batch nor an
            error is stuck. Default: the dataset's timeout + 5 s + 15 s (fork) or
            120 s (spawn, forkserver: a worker imports torch again first); a value
            given must exceed the dataset's timeout + 5 s.
    """

    STATE_KEYS = LOADER_KEYS

    def __init__(self, dataset: StreamingDataset, num_workers: int = 0,
                 multiprocessing_context: str | None = None,
                 prefetch_factor: int | None = None, pin_memory: bool = False,
                 timeout: float | None = None) -> None:
        if not isinstance(dataset, StreamingDataset):
            raise ConfigError(f"dataset must be a StreamingDataset, got {type(dataset).__name__}")
        self.dataset = dataset
        dataset.auto_ack = False
        self.num_workers = check_positive("num_workers", num_workers, allow_zero=True)
        if num_workers and dataset.connection.mode == "embedded":
            raise ConfigError(f"num_workers must be 0 with an embedded stream (its controller "
                              f"lives in this process), got {num_workers}; use "
                              f"tq.init(mode='local') for worker processes")
        # pinning happens here, not in torch's pin thread, whose copy would drop the meta
        self._pin = bool(pin_memory) and torch.cuda.is_available()
        self._kwargs: dict[str, Any] = {"batch_size": None, "num_workers": num_workers,
                                        "collate_fn": _identity}
        if num_workers:
            method = check_start_method(multiprocessing_context)
            self._kwargs["multiprocessing_context"] = multiprocessing_context
            self._kwargs["prefetch_factor"] = prefetch_factor or 2
            # torch's own wait for a batch: without it, a stuck worker is waited for forever
            self._kwargs["timeout"] = stall_timeout(timeout, dataset.timeout + RELAY, method)
        elif timeout is not None:
            raise ConfigError(f"timeout bounds the wait for DataLoader workers, so it needs "
                              f"num_workers >= 1 (with 0, the dataset's timeout bounds "
                              f"every wait), got timeout={timeout!r} with num_workers=0")
        self._client = Client(dataset.connection)
        self._next_step = dataset.start_step
        self._unacked = UnackedBatches(self._client, dataset.task, dataset.dp_rank,
                                       len(dataset.partitions))
        self._yielded = False  # a batch was yielded (``_next_step`` is then the next one)
        self._saved_done: list[tuple[str, int]] = []  # yielded before a loaded state
        self._predecessor: str | None = None  # the session of a loaded state's iteration
        self._rows: Counter[str] = Counter()  # rows yielded per partition
        self._versions = at_yield.TrainerVersion(self._client, dataset.partitions, dataset.task)
        self._live: Callable[[], Any] = lambda: None  # the open iteration, if any
        self._released = False  # release() was called in the open iteration
        self._closing = False  # __iter__ closes an earlier iteration still open
        self._exiting = False  # the interpreter exits: neither ack nor give back
        self._undecided: list[int] = []  # steps of a loop that ended neither way

    def _ack_saved(self) -> None:
        """Batches yielded before the restored state_dict was taken count as trained:
        ack them if no one did (a crash after the save, before the next batch)."""
        steps, self._saved_done = self._saved_done, []
        self.dataset.ack_saved(self._client, steps)

    def __iter__(self) -> Iterator[TensorDict]:
        """A new iteration (see the module docstring). An earlier one still open (its
        generator kept alive, e.g. by a traceback) is closed first, as not finished:
        its batch out in the loop is given back."""
        earlier = self._live()
        if earlier is not None:
            self._closing = True
            try:
                earlier.close()
            finally:
                self._closing = False
        if self._undecided:
            raise StateError(
                f"the last loop over the loader of task {self.dataset.task!r} (rank "
                f"{self.dataset.dp_rank}) ended neither by break/return nor by an "
                f"exception (a wrapper such as islice or zip ended it, or its iterator was "
                f"dropped or replaced), so whether step(s) {self._undecided} were trained "
                f"is unknown: call loader.ack() if they were, or loader.release() if not, "
                f"then iterate again")
        batches = self._iterate()
        self._live = weakref.ref(batches)
        _open.add(self)
        return batches

    def close_at_exit(self) -> None:
        """Close the open iteration, if any, as the interpreter exits (see
        ``_close_open_loops``): nothing is acked or given back."""
        live = self._live()
        if live is not None:
            self._exiting = True
            live.close()

    def _iterate(self) -> Iterator[TensorDict]:
        ds = self.dataset
        ds.register()
        ds.session = uuid.uuid4().hex
        take_over(ds.connection.controller(), self._predecessor, ds.session)
        self._predecessor = None
        self._ack_saved()
        self.ack()  # batches whose ack failed as an earlier loop was left by a break
        self._released = False
        ds.start_step = self._next_step
        ds.plan = ds.resume_plan()
        for p in ds.partitions:  # what workers fetched ahead and this process yields
            self._unacked.hold(ds.connection.keeper().hold(p, ds.task, ds.session,
                                                           ds.lease_timeout))
        batches = iter(DataLoader(ds, **self._kwargs))
        step, skip = ds.plan  # the step this iteration yields next
        deaths = worker_deaths.Deferral()
        if self.num_workers:
            worker_deaths.guard()  # torch's SIGCHLD handler is set now
        jumped = False  # closed by a break/return in the loop body (GeneratorExit)
        done: bool | None = True  # left by a break/return or ran to the end; False:
        # by an exception; None: neither is known (see ``loop_exit.verdict``)
        try:
            while True:
                try:
                    # Acks come before waiting: the end of a stream waits for every ack.
                    # torch's SIGCHLD handler raises a worker's death in whatever this
                    # thread runs: here, the ack or the fetch; while a batch is out in
                    # the training step, it is kept in `deaths` and raised here.
                    # The turn first: while a batch is unacked, a wait for a step held
                    # for its turn knows the trainer is alive (``TurnNotReached``).
                    self._versions.reading(step)
                    self.ack()
                    deaths.check()
                    batch = next(batches)
                except StopIteration:
                    return
                except (RuntimeError, OSError) as exc:
                    if not self.num_workers or isinstance(exc, TQError):
                        raise
                    stop_workers(batches)  # torch's SIGCHLD handler would raise later
                    raise worker_failure(exc, ds.task, ds.dp_rank,
                                         self._kwargs["timeout"]) from exc
                checked = at_yield.recheck(ds, batch, self._versions.version)
                if checked is None:  # re-formed for this version with no row left
                    step = loader_step(batch) + 1
                    while step in skip:
                        step += 1
                    continue
                batch = checked
                if self._pin:
                    batch = copy_meta(batch, batch.pin_memory())
                self._unacked.batches.append(batch)
                self._next_step = step = loader_step(batch) + 1
                while step in skip:
                    step += 1
                self._yielded = True
                self._rows[batch_meta(batch).partition] += len(batch_meta(batch))
                deaths.out(True)
                resumed = loop_exit.resumed_at()
                try:
                    yield batch
                except GeneratorExit:
                    # who dropped the iterator: a break/return, or an exception (or
                    # anything else: then the batch is not known to be trained)
                    try:
                        done = True if self._exiting else \
                            None if self._closing else loop_exit.verdict(resumed)
                    except Exception:  # noqa: BLE001 — at interpreter exit: not known
                        done = None
                    jumped = done is True and not self._exiting
                    raise
                finally:
                    deaths.out(False)
                if self._released:
                    raise StateError(
                        f"release() must be followed by leaving the loop (break), got the "
                        f"next batch of task {ds.task!r} (rank {ds.dp_rank}) asked for; "
                        f"iterate the loader again: the released batches come first")
        finally:
            try:
                if done is None and self._unacked:  # the next iteration asks the user
                    self._undecided = self._unacked.steps()
                elif not done:
                    self._give_back()
                elif jumped:
                    self._unacked.ack_left()
            except TypeError:  # interpreter exit: module globals are gone already; the
                pass  # batch stays leased and comes back once its lease expires
            self._cancel(ds.session)
            if self.num_workers:  # now, not in torch's __del__: a garbage collection may
                stop_workers(batches)  # run that in any thread, which then joins them

    def release(self) -> None:
        """Give back every batch yielded and not acked: it is not trained. Its rows go,
        unchanged, to the next iteration of this rank, which starts with it. Call it
        right before leaving the loop (``break``); asking the same iteration for
        another batch afterwards is a StateError.

        A loop left by ``break`` or ``return`` counts its last batch as trained: it is
        acked as the loop is left (an ack that fails then is logged and retried by
        ``ack()`` or the next iteration); a loop left by an exception does not (its
        batch comes again first), nor does ``close()`` of its iterator. Where the
        loader cannot tell (a wrapper such as ``itertools.islice`` or ``zip`` that stops
        on its own, an iterator dropped, or replaced by a new ``iter(loader)``), the next iteration
        is a StateError until ``ack()`` (trained) or ``release()`` (not trained) says
        which. ``next(iter(loader))`` counts as trained (see
        ``tq_stream.datasets.loop_exit``)."""
        self._give_back(quiet=False)
        self._undecided = []
        self._released = True

    def _give_back(self, quiet: bool = True) -> None:
        """Release the yielded-unacked batches; the loader resumes at the first of them."""
        steps = self._unacked.steps()
        if steps:
            self._next_step = steps[0]
        self._unacked.give_back(quiet)

    def _cancel(self, session: str) -> None:
        """End the iteration's waits in every worker, so workers stop by themselves
        when the loop stops (torch's shutdown would wait for each, then kill it)."""
        try:
            self.dataset.connection.controller().cancel(session=session)
        except Exception as exc:  # a closed stream: nothing waits any more
            if logger is not None:  # None while the interpreter shuts down
                logger.debug("cancelling loader session %s: %s", session, exc)

    def __len__(self) -> int:
        """Batches per epoch: see ``StreamingDataset.__len__``."""
        return len(self.dataset)

    def __bool__(self) -> bool:
        return True

    def ack(self, batch: TensorDict | None = None) -> None:
        """Ack ``batch`` (default: every batch yielded and not yet acked).

        Raises:
            LeaseTakenOver: a batch's lease lapsed (this process stopped renewing it for
                longer than ``lease_timeout``: paused, frozen) and another reader took
                its rows: they are that reader's, this batch is dropped from the
                loader's unacked ones (raised once)."""
        try:
            self._unacked.ack(batch)
        finally:
            if not self._unacked:
                self._undecided = []

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
        self._versions.set(version, at)

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
        fully acked, skipping steps acked since it was saved.

        Loading it is taking over: the resumed loader's first iteration ends the
        session of the iteration that saved it (``session``), so the steps it held come
        to the resumed loader at once, even if that iteration never ended (a trainer
        that hung or was killed, whose lease would otherwise live ``lease_timeout``);
        a predecessor still running is fenced (its acks raise ``LeaseTakenOver``)."""
        ds = self.dataset
        yielded = [[p, s] for p, s in self._saved_done] + [
            [m.partition, m.step] for m in (batch_meta(b) for b in self._unacked.batches)]
        session = ds.session if self._live() is not None else None
        return {"partition": ds.partition, "task": ds.task, "dp_rank": ds.dp_rank,
                "step": self._next_step, "yielded": yielded, "session": session}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from a saved state (see ``state_dict``)."""
        ds = self.dataset
        self._next_step, self._saved_done, self._predecessor = loader_loaded(
            (ds.partition, ds.task, ds.dp_rank), state)
        self._unacked.batches = []

    def stats(self) -> dict[str, Any]:
        """This loader's task counters per partition (handed out, acked, discarded by
        reason...) and the rows this loader yielded from each partition."""
        ds = self.dataset
        everything: dict[str, Any] = dict(self.dataset.connection.controller().stats())
        return {
            "rows": {p: self._rows[p] for p in ds.partitions},
            "tasks": {p: everything.get(p, {}).get("tasks", {}).get(ds.task, {})
                      for p in ds.partitions},
        }
