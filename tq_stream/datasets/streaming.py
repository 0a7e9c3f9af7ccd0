"""StreamingDataset: an IterableDataset that yields this rank's ready batches.

Step n of a task is one batch per DP rank; this dataset asks the controller
for steps ``s, s + 1, ...`` for its ``dp_rank`` (DataLoader worker w of k takes
every k-th of them), so the replicas of a rank get identical batches and
different ranks disjoint ones. ``s`` is the first step this rank has not fully
acked (``first_unfinished``), and later steps already acked are skipped, so a
fresh or restarted loader resumes where the last one stopped. A background
thread prefetches up to ``prefetch`` batches (metadata and bytes) ahead
(``datasets.prefetch``).

Each iteration is one consumer session: its leases are renewed by the
process's heartbeat (``tq_stream.leases``) for as long as it runs, and its
waits are cancelled when it stops.

When iterated directly, a batch is acked when the next one is requested; a
``StreamingDataLoader`` turns that off and acks in the training process.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from tensordict import TensorDict
from torch.utils.data import IterableDataset, get_worker_info

from tq_stream.client import Client
from tq_stream.config import DEFAULT_PREFETCH
from tq_stream.connection.connection import Connection
from tq_stream.convert import check_ragged, check_shared_read
from tq_stream.datasets import exit_stop, saved_state, worker_imports
from tq_stream.datasets.batch import batch_meta, loader_step
from tq_stream.datasets.length import epoch_end, known_steps
from tq_stream.datasets.prefetch import (
    END,
    STOP_CHECK,
    Failure,
    Item,
    ReadSpec,
    StepReader,
    drain,
    produce,
)
from tq_stream.errors import (
    ConfigError,
    StateError,
    WaitTimeout,
    check_name,
    check_positive,
    check_replica,
    check_timeout,
    format_seconds,
)
from tq_stream.samplers.base import Sampler
from tq_stream.samplers.partition import PartitionSampler

if TYPE_CHECKING:
    from tq_stream.client import Client
    from tq_stream.stream import Stream

# Batches a DataLoader worker keeps unacked: the default prefetch_factor (2) + 1, so a
# batch is acked only after the training loop asked for the one after it.
WORKER_ACK_LAG = 3
# Seconds the iterator waits for its prefetch thread beyond ``timeout`` (whose own waits
# each end within ``timeout``): so a live iterator, in a DataLoader worker too, hands
# over a batch or an error within ``timeout + RELAY``.
RELAY = 5.0
logger = logging.getLogger(__name__)


class StreamingDataset(IterableDataset[TensorDict]):
    """Per-rank batches of ready rows (see module docstring).

    A ``StreamingDataLoader`` drives it through ``register``, ``ack_saved`` and
    ``resume_plan`` (then ``start_step``, ``session`` and ``plan``) before each iteration.

    Args:
        stream: a Stream handle (or its ``connection``): the dataset keeps its
            ``connection``, which DataLoader workers reopen.
        partition: where to read.
        task: the consumer task's name.
        fields: the fields every batch carries.
        batch_size: rows per rank per step.
        sampler: which rows form a step (default: SequentialSampler).
        dp_rank: this rank's data-parallel index.
        dp_size: the DP world size.
        replicas: how many ranks share this ``dp_rank`` (TP/PP peers); a row is
            acked when all of them acked it.
        replica: which of those peers this is (``0 <= replica < replicas``); each
            acks for itself, so a double ack by one peer counts once. Required when
            ``replicas > 1`` (ConfigError otherwise): it is not derived from
            torch.distributed, whose rank layout only the framework knows. Two live
            consumers reading one (task, dp_rank, replica) are refused (see
            ``Client.get_meta``).
        timeout: seconds to wait for one batch before WaitTimeout. A batch fetched
            ahead and held for its turn (``StalenessSampler``) waits for the trainer
            to reach it as long as the trainer acks a batch at least once per
            ``timeout``: a training step must be shorter than it.
        lease_timeout: seconds rows stay leased before they are handed out again.
        drop_last: when the partition is closed, drop a short last step
            (counted as discarded, reason "tail") instead of handing it out.
        ragged, shared: how ragged and multi-ragged fields are read ("nested", "padded",
            "list": ``convert.to_tensordict``), and shared fields ("rows": per row;
            "index": once per entry plus ``f + "_index"``; ``Client.get_data``).
        prefetch: batches fetched ahead in the background (>= 1).
        rows_per_epoch: declare an epoch of this many rows (all ranks together): an
            iteration ends after ``len(dataset)`` steps (see ``datasets.length``);
            without it ``len()`` works once the partitions are closed.

    Example:
        >>> ds = tq.StreamingDataset(stream, "train", "actor", ["input_ids"], batch_size=16,
        ...                          dp_rank=rank, dp_size=world)
        >>> for batch in tq.StreamingDataLoader(ds): ...
    """

    STOP_CHECK = STOP_CHECK  # seconds: how soon a stopped prefetch thread notices

    def __init__(self, stream: Stream | Connection, partition: str | list[str] | None, task: str,
                 fields: Sequence[str], batch_size: int,
                 sampler: Sampler | PartitionSampler | None = None, dp_rank: int = 0,
                 dp_size: int = 1, replicas: int = 1, replica: int | None = None,
                 timeout: float | None = None,
                 lease_timeout: float | None = None, drop_last: bool = False,
                 ragged: str = "nested", prefetch: int = DEFAULT_PREFETCH,
                 rows_per_epoch: int | None = None, shared: str = "rows") -> None:
        super().__init__()
        worker_imports.preload()  # before any DataLoader worker of it is forked
        self.connection = stream if isinstance(stream, Connection) else stream.connection
        self._router = sampler if isinstance(sampler, PartitionSampler) else None
        if self._router is not None:
            if partition is not None and partition != self._router.partitions:
                raise ConfigError(f"partition must be None (or {self._router.partitions}) "
                                  f"with a PartitionSampler, got {partition!r}")
            self.partitions = list(self._router.partitions)
        else:
            self.partitions = [check_name("partition", partition)]
        # One name for state dicts and messages; "a,b" for a multi-partition loader.
        self.partition = ",".join(self.partitions)
        self._ends: dict[str, int] = {}
        self.task = check_name("task", task)
        if isinstance(fields, str) or not fields:
            raise ConfigError(f"fields must be a non-empty list of field names, got {fields!r}")
        self.fields = [check_name("fields[]", f) for f in fields]
        self.batch_size = check_positive("batch_size", batch_size)
        self.dp_size = check_positive("dp_size", dp_size)
        if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or \
                not 0 <= dp_rank < dp_size:
            raise ConfigError(f"dp_rank must be an int in [0, {dp_size}), got {dp_rank!r}")
        self.dp_rank = dp_rank
        self.replicas = check_positive("replicas", replicas)
        self.replica = check_replica(replica, self.replicas)
        if sampler is not None and self._router is None:
            if not isinstance(sampler, Sampler):
                raise ConfigError(f"sampler must be a tq_stream.samplers.Sampler, got "
                                  f"{sampler!r}")
            sampler.check_batch(self.batch_size)
        self.sampler = sampler
        self.timeout = self.connection.config.timeout if timeout is None else \
            check_timeout("timeout", timeout)
        self.lease_timeout = self.connection.config.lease_timeout if lease_timeout is None \
            else check_timeout("lease_timeout", lease_timeout)
        self.drop_last = bool(drop_last)
        self.ragged, self.shared = check_ragged(ragged), check_shared_read(shared)
        self.prefetch = check_positive("prefetch", prefetch)
        self.rows_per_epoch = None if rows_per_epoch is None else \
            check_positive("rows_per_epoch", rows_per_epoch)
        self.start_step = 0  # a multi-partition loader's resume step (its own numbering)
        self.auto_ack = True
        self.session: str | None = None  # set by a loader for its iteration (and workers)
        self.worker_ack_lag = WORKER_ACK_LAG
        self._pending: collections.deque[TensorDict] = collections.deque()
        self._saved_done: list[tuple[str, int]] = []  # yielded before a loaded state
        self._session: str | None = None  # of the last iteration (its state names it)
        self._predecessor: str | None = None  # the session of a loaded state
        self.plan: tuple[int, frozenset[int]] | None = None  # (first step, steps to skip)
        self._registered = False

    def __len__(self) -> int:
        """Steps of an epoch (``rows_per_epoch``), or in all of closed partitions.

        Raises:
            LengthUnknownError: (a TypeError) if neither is known.
        """
        return known_steps(self)

    def __bool__(self) -> bool:  # not len(): a dataset of an open stream is still truthy
        return True

    def register(self) -> None:
        """Declare the task on the controller (done on first iteration)."""
        if not self._registered:
            for p in self.partitions:
                sampler = self._router.sampler_for(p) if self._router is not None \
                    else self.sampler if isinstance(self.sampler, Sampler) else None
                Client(self.connection).register_task(
                    p, self.task, self.fields, self.batch_size, dp_size=self.dp_size,
                    replicas=self.replicas, lease_timeout=self.lease_timeout,
                    drop_last=self.drop_last, sampler=sampler)
            self._registered = True

    def resume_plan(self) -> tuple[int, frozenset[int]]:
        """(first step, later steps to skip) for this rank, from the controller."""
        if self._router is not None:  # loader steps of its own numbering: from state
            return self.start_step, frozenset()
        where = Client(self.connection).first_unfinished(self.partitions[0], self.task,
                                                      self.dp_rank, self.replica)
        return int(where["step"]), frozenset(int(s) for s in where["skip"])

    def _steps(self, plan: tuple[int, frozenset[int]]) -> Iterator[int]:
        info = get_worker_info()
        if info is not None and self.connection.mode == "embedded":
            raise StateError("an embedded stream must not be read from DataLoader worker "
                             "processes (num_workers > 0); use tq.init(mode='local')")
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        step, skip = plan
        end = epoch_end(self, step)  # None unless rows_per_epoch declares an epoch
        if workers > 1 and self.plan is None:
            # Workers that each asked the controller where to resume (no loader computed
            # one plan for all) may have asked at different moments: they split steps by
            # number from a base they share, each skipping its own steps already done.
            for s in range(self.start_step + worker, 1 << 62, workers):
                if end is not None and s >= end:
                    return
                if s >= step and s not in skip:
                    yield s
            return
        position = 0
        while end is None or step < end:
            if step not in skip:
                if position % workers == worker:
                    yield step
                position += 1
            step += 1

    # -- the torchdata Stateful protocol (``datasets.saved_state``)
    def state_dict(self) -> dict[str, Any]:
        """Who this dataset reads for, the batches it yielded and has not acked (a
        ``StatefulDataLoader`` snapshots this in each worker with every batch it hands
        over; under a ``StreamingDataLoader``, which acks and keeps its batches itself,
        none) and the session of its iteration. No side effects."""
        return saved_state.saved(self._reader(), list(map(batch_meta, self._pending)),
                                 self._session)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``: the batches it lists as yielded count as trained
        (acked at the next iteration's start), which first takes over from the session
        that saved it (its claims end: ``saved_state``); the rest resumes at the first
        step this rank has not acked, so nothing acked comes again and nothing leased
        is lost."""
        self._saved_done, self._predecessor = saved_state.loaded(self._reader(), state)
        self.plan = None

    def _reader(self) -> saved_state.Reader:
        return (self.partition, self.task, self.dp_rank, self.replica)

    def ack_saved(self, client: Client,
                  steps: Sequence[tuple[str, int]] | None = None) -> None:
        """Ack the batches a loaded state lists as yielded, if nobody did (a crash after
        the save, before their ack); each (partition, step) once.

        Args:
            client: the client of the iteration about to start.
            steps: the (partition, step) pairs of the loader's own loaded state, which
                replace those of the dataset's (None: the dataset's own).
        """
        todo = self._saved_done if steps is None else list(steps)
        self._saved_done = []
        saved_state.ack_saved(client, self.task, self.dp_rank, self.replica, self.timeout,
                              todo)

    def __iter__(self) -> Iterator[TensorDict]:
        self.register()
        out: queue.Queue[Item] = queue.Queue(maxsize=self.prefetch + 1)
        stop = threading.Event()
        room = threading.Semaphore(self.prefetch)
        client = Client(self.connection, session=self.session)  # one session per iteration
        saved_state.take_over(self.connection.controller(), self._predecessor, client.session)
        self._predecessor, self._session = None, client.session
        self.ack_saved(client)  # before the plan: those steps are done
        plan = self.plan if self.plan is not None else self.resume_plan()
        reader = StepReader(ReadSpec(self.task, self.dp_rank, self.replica, self.timeout,
                                     self.fields, self.ragged, self.shared),
                            client, self.partitions, self._router, self._ends)
        skip_acked = self.plan is None and get_worker_info() is not None
        thread = threading.Thread(
            target=produce, args=(reader, client, self._steps(plan), out, stop, room,
                                  skip_acked),
            daemon=True, name=f"tq-prefetch-{self.task}-{self.dp_rank}")
        thread.start()
        exit_stop.track(stop, thread, client.cancel)  # not inside torch at exit
        single = get_worker_info() is None
        # yielded, not acked yet: iterated directly, a batch is acked when the next is
        # asked for; in a DataLoader worker, only once WORKER_ACK_LAG later batches were
        # asked for (the loader then has handed it to the training loop and got the next)
        pending: collections.deque[TensorDict] = collections.deque()
        self._pending = pending
        lag = 1 if single else self.worker_ack_lag
        finished = False  # the prefetch thread ended on its own: no wait to cancel
        try:
            while True:
                while self.auto_ack and len(pending) >= lag:  # before waiting
                    client.ack(batch_meta(pending.popleft()))
                try:
                    item = out.get(timeout=self.timeout + RELAY)
                except queue.Empty:
                    raise WaitTimeout(
                        f"no batch of task {self.task!r} arrived within timeout="
                        f"{format_seconds(self.timeout)} (+{format_seconds(RELAY)}) from the "
                        f"prefetch thread") from None
                room.release()
                if item is END:
                    finished = True
                    return
                if isinstance(item, Failure):
                    finished = True
                    raise item.exc
                assert isinstance(item, TensorDict)  # the rest are batches (``produce``)
                if self.auto_ack:  # else the loader acks it, and alone keeps it till then
                    pending.append(item)
                if single:
                    self.start_step = loader_step(item) + 1
                yield item
        finally:
            stop.set()
            # a worker's unacked batches may not have reached the training loop: they
            # stay leased (and come again) unless the stream ended normally
            self._stop(client, out, thread, list(pending) if single or finished else [],
                       cancel=not finished)
            try:
                exit_stop.untrack(thread)
            except (AttributeError, TypeError):  # interpreter exit: the module is gone
                pass
            pending.clear()

    def _stop(self, client: Client, out: queue.Queue[Item], thread: threading.Thread,
              done: list[TensorDict], cancel: bool = True) -> None:
        """End an iteration: ack its last batch (when iterated directly), cancel the
        prefetch thread's wait, hand back what it fetched ahead. Runs when a generator
        is closed or collected, so it reports failures (a closed stream, a dead
        controller) in the log instead of raising them there. ``cancel=False`` when the
        thread already ended: the session is shared with the other DataLoader workers,
        whose waits must go on (one worker reaching the end of an epoch first must not
        cut another's last step short)."""
        try:
            for batch in done if self.auto_ack else []:
                client.ack(batch_meta(batch))
            if cancel:
                client.cancel()
            drain(out, client)
            # the thread ends within one get_data once cancelled; joining it means no
            # stale prefetch can claim a step a new iterator reads
            thread.join(timeout=self.STOP_CHECK + 30.0)
            drain(out, client)
        except Exception as exc:
            logger.debug("stopping the iterator of task %r rank %d: %s", self.task,
                         self.dp_rank, exc)
