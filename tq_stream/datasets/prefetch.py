"""Prefetch: the background thread of one ``StreamingDataset`` iteration.

It asks the controller for this rank's steps (``StepReader.fetch``: get_meta, then
get_data) only when the queue has room, so at most ``prefetch`` batches wait ahead of
the one being consumed, and hands each over through that queue: a batch, ``END``
(nothing more), or a ``Failure`` (an exception, re-raised in the consumer). A step
whose share for this rank died with its storage unit is skipped.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from tensordict import TensorDict

from tq_stream.client import Client
from tq_stream.datasets.batch import attach_meta, batch_meta
from tq_stream.errors import LeaseError, StateError, TurnNotReached, WaitTimeout
from tq_stream.meta import BatchMeta
from tq_stream.samplers.partition import PartitionSampler

logger = logging.getLogger(__name__)

STOP_CHECK = 0.2  # seconds: how soon a stopped prefetch thread notices
class _Lost:
    """A step whose share for this rank died with its storage unit (``_LOST``)."""


_LOST = _Lost()


class End:
    """The iteration is over (``END``, the one instance)."""


END = End()


class Failure:
    """An exception raised in the prefetch thread, re-raised in the consumer."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


Item = TensorDict | Failure | End  # what the queue carries


@dataclass(frozen=True)
class ReadSpec:
    """Whose batches a prefetch thread reads, and how (``StreamingDataset``'s args)."""

    task: str
    dp_rank: int
    replica: int
    timeout: float
    fields: Sequence[str]
    ragged: str
    shared: str


class StepReader:
    """Reads one step of this rank: from its one partition, or, for a multi-partition
    loader, from where its ``router`` sends it (``ends``: where partitions ended for
    every rank, kept by the dataset across iterations)."""

    def __init__(self, spec: ReadSpec, client: Client, partitions: Sequence[str],
                 router: PartitionSampler | None, ends: dict[str, int]) -> None:
        self._spec, self._client = spec, client
        self._partitions, self._router, self._ends = partitions, router, ends

    def wait_meta(self, partition: str, step: int, stop: threading.Event) -> BatchMeta | None:
        """get_meta for ``step``: one wait of up to ``timeout`` seconds, ended early
        (None) when the iterator stops and cancels its session."""
        spec = self._spec
        deadline = time.monotonic() + spec.timeout
        timeout = spec.timeout  # the caller's, as WaitTimeout names it; less on a retry
        while True:
            if stop.is_set():
                return None
            try:
                return self._client.get_meta(partition, spec.task, step, spec.dp_rank,
                                             timeout, replica=spec.replica)
            except TurnNotReached:
                # a step fetched ahead waits for the trainer to reach it: its own wait of
                # ``timeout`` starts again. Bounded: the controller says so only while
                # the trainer is alive and acked (or read) a batch within the timeout;
                # a trainer that stopped gets the WaitTimeout naming the turn instead
                deadline = time.monotonic() + spec.timeout
                timeout = spec.timeout
                continue
            except WaitTimeout:
                # Before the deadline, a timeout is a broken connection, not a wait that
                # ran out: the controller died and may be restarting. Ask again.
                if time.monotonic() >= deadline - STOP_CHECK:
                    raise
                logger.warning("waiting for step %d of task %r (rank %d) broke off; asking "
                               "again", step, spec.task, spec.dp_rank)
                stop.wait(STOP_CHECK)
                timeout = max(0.001, deadline - time.monotonic())

    def fetch(self, step: int, stop: threading.Event) -> TensorDict | _Lost | None:
        """Step ``step``'s batch; None at the end, ``_LOST`` if no row of it survived."""
        if self._router is None:
            meta = self.wait_meta(self._partitions[0], step, stop)
        else:
            meta = self._routed_meta(step, stop)
        if meta is None or meta.end:
            return None
        if not len(meta):
            return _LOST
        meta, td = self._read(meta, stop)
        if meta is None or meta.end:
            return None
        if td is None:
            return _LOST
        return attach_meta(td, meta, step)

    def _read(self, meta: BatchMeta,
              stop: threading.Event) -> tuple[BatchMeta | None, TensorDict | None]:
        """get_data of ``meta``. A read that fails because a row's storage unit died
        asks for the same step again (up to ``timeout`` seconds more): once the
        controller declared the unit lost, the share holds the surviving rows only
        (``(meta, None)`` if none survived)."""
        spec, client = self._spec, self._client
        deadline = None
        while True:
            try:
                return meta, client.get_data(meta, spec.fields, spec.ragged, spec.shared)
            except (StateError, WaitTimeout) as exc:
                now = time.monotonic()
                deadline = now + spec.timeout if deadline is None else deadline
                if stop.is_set() or now >= deadline:
                    raise
                logger.warning("reading step %d of task %r (rank %d) failed (%s); asking "
                               "for the step again", meta.step, spec.task, spec.dp_rank, exc)
                stop.wait(STOP_CHECK)
                again = client.get_meta(meta.partition, spec.task, meta.step, spec.dp_rank,
                                        spec.timeout, replica=spec.replica)
                if again is None or again.end:
                    return again, None
                if not len(again):
                    return again, None
                meta = again

    def _routed_meta(self, step: int, stop: threading.Event) -> BatchMeta | None:
        """The meta of loader ``step`` of a multi-partition loader (None at its end)."""
        assert self._router is not None
        while True:
            route = self._router.route(step, self._ends)
            if route is None:
                return None
            meta = self.wait_meta(route[0], route[1], stop)
            if meta is None or not meta.end:
                return meta
            self._ends[route[0]] = meta.step  # ended there for every rank: route again


def produce(reader: StepReader, client: Client, steps: Iterator[int],
            out: queue.Queue[Item], stop: threading.Event, room: threading.Semaphore,
            skip_acked: bool) -> None:
    """The prefetch thread: fetch ``steps`` into ``out`` while ``room`` allows.
    ``skip_acked``: a step acked meanwhile (a DataLoader worker's, of a loaded state)
    is skipped instead of failing the iteration."""
    try:
        for step in steps:
            # fetch (and lease) a step only when the queue has room for it, so at
            # most `prefetch` batches wait ahead of the one being consumed
            while not room.acquire(timeout=0.1):
                if stop.is_set():
                    return
            try:
                item = reader.fetch(step, stop)
            except LeaseError:
                if not skip_acked:
                    raise
                room.release()  # acked meanwhile (a loaded state's batch): skip it
                continue
            if isinstance(item, _Lost):  # nothing to train on: the next step instead
                room.release()
                continue
            if not offer(out, stop, END if item is None else item):
                if isinstance(item, TensorDict):  # nobody will read it: hand it back
                    client.release(batch_meta(item))
                return
            if item is None:
                return
        offer(out, stop, END)  # the declared epoch is over
    except BaseException as exc:  # travels to the consumer as a value
        offer(out, stop, Failure(exc))


def offer(out: queue.Queue[Item], stop: threading.Event, item: Item) -> bool:
    """Put ``item`` in ``out`` unless ``stop`` is set first (False then)."""
    while not stop.is_set():
        try:
            out.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def drain(out: queue.Queue[Item], client: Client) -> None:
    """Hand back the batches left in ``out`` (nobody will read them)."""
    while True:
        try:
            item = out.get_nowait()
        except queue.Empty:
            return
        if isinstance(item, TensorDict):
            client.release(batch_meta(item))
