"""Client: the low-level API — metadata from the controller, bytes from the units.

Example:
    >>> client = stream.client()
    >>> client.register_task("train", "old_logp", fields=["input_ids"], batch_size=32)
    >>> meta = client.get_meta("train", "old_logp", step=0)
    >>> td = client.get_data(meta)
    >>> client.put_data(meta, {"old_logp": compute(td)})
    >>> client.ack(meta)
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from tensordict import TensorDict

from tq_stream import fieldpath, shared_read
from tq_stream.backends.base import occupancy
from tq_stream.connection import placement
from tq_stream.connection.connection import Connection
from tq_stream.connection.protocols import ControllerAPI
from tq_stream.convert import RowData, to_columns, to_tensordict
from tq_stream.errors import ConfigError, check_name, check_timeout
from tq_stream.leases import Hold
from tq_stream.meta import BatchMeta
from tq_stream.samplers.base import Sampler
from tq_stream.writer import RowWriter


class Client:
    """Explicit calls on a deployment's controller and storage units (see module doc).

    A client is one consumer session: the leases it takes with ``get_meta`` are kept
    alive by the stream's heartbeat for as long as the client exists (keep a reference
    to it while you work on a batch), and expire ``lease_timeout`` seconds after its
    process dies; the rows then go to the next reader of that step and rank.

    Args:
        connection: the deployment to call (``stream.connection``).
        consumer: a stable name for ``get_meta(step=None)`` in a pool of stage workers:
            a restarted worker of the same name first gets back what its dead
            predecessor held, once that lease expired. It does not share: a batch a
            live client holds never goes to another, whatever their names.
        session: the session id (default: a new random one).
    """

    def __init__(self, connection: Connection, consumer: str = "",
                 session: str | None = None) -> None:
        self._conn = connection
        self.consumer = consumer
        self.session = uuid.uuid4().hex if session is None else session
        self._holds: dict[tuple[str, str], Hold] = {}

    @property
    def _controller(self) -> ControllerAPI:
        return self._conn.controller()

    def register_task(self, partition: str, task: str, fields: Sequence[str], batch_size: int,
                      dp_size: int = 1, replicas: int = 1, lease_timeout: float | None = None,
                      drop_last: bool = False, sampler: Sampler | None = None) -> None:
        """Declare a consumer task (idempotent; every rank passes the same settings).
        ``lease_timeout`` defaults to the stream's (``tq.init(lease_timeout=...)``)."""
        if lease_timeout is None:
            lease_timeout = self._conn.config.lease_timeout
        self._controller.register_task(
            partition=partition, task=task, fields=list(fields), batch_size=batch_size,
            dp_size=dp_size, replicas=replicas, lease_timeout=lease_timeout,
            drop_last=drop_last, sampler=sampler,
        )

    def get_meta(self, partition: str, task: str, step: int | None = None, dp_rank: int = 0,
                 timeout: float | None = None,
                 replica: int | None = None) -> BatchMeta | None:
        """The rows of ``step`` for ``dp_rank`` (waits up to ``timeout`` for them).

        ``step=None`` asks for the next batch for this client: for a pool of stage
        workers, each taking the next batch. Two live clients never get the same rows,
        even with the same ``consumer`` name. A dead worker's batch (its lease expired:
        ``lease_timeout`` after its heartbeat stopped, or its client was cancelled)
        goes to the next one that asks, first to a restarted worker of the same
        ``consumer`` name. Pass step numbers for DP lockstep control
        (``first_unfinished`` tells where to resume).

        ``replica`` is which TP/PP peer of ``dp_rank`` reads; required when the task
        has ``replicas > 1`` (ConfigError otherwise). A step, rank and replica another
        live client holds is waited for (a restarted consumer gets it once its dead
        predecessor's lease expired) and refused at ``timeout`` with a ConfigError
        naming ``replica``; a replica's share it acked already is refused (LeaseError).

        Returns:
            the batch's BatchMeta (``meta.end`` once a closed partition is drained), or
            None if ``cancel()`` ended the wait.
        """
        timeout = self._conn.config.timeout if timeout is None else timeout
        check_timeout("timeout", timeout)
        hold = self._hold(partition, task)
        d = self._controller.get_meta(partition=partition, task=task, step=step,
                                      dp_rank=dp_rank, timeout=timeout, replica=replica,
                                      session=self.session, consumer=self.consumer)
        if d is None:
            return None
        lease = d.lease_timeout
        hold.set_lease(self._conn.config.lease_timeout if lease is None else float(lease))
        return BatchMeta.from_reply(d, self.session)

    def first_unfinished(self, partition: str, task: str, dp_rank: int = 0,
                         replica: int | None = None) -> dict[str, Any]:
        """Where a reader of ``dp_rank`` resumes: ``{"step": the first step its rank has
        not fully acked (or ``replica`` has not acked), "skip": later steps already
        acked}``."""
        where = self._controller.first_unfinished(partition=partition, task=task,
                                                  dp_rank=dp_rank, replica=replica)
        return {"step": where.step, "skip": list(where.skip)}

    def cancel(self) -> None:
        """End this client's waiting get_meta calls now (they return None)."""
        self._controller.cancel(session=self.session)

    def _hold(self, partition: str, task: str) -> Hold:
        hold = self._holds.get((partition, task))
        if hold is None:
            lease = self._conn.config.lease_timeout
            hold = self._holds[(partition, task)] = self._conn.keeper().hold(
                partition, task, self.session, lease)
        return hold

    def get_data(self, meta: BatchMeta, fields: Sequence[str] | None = None,
                 ragged: str = "nested", shared: str = "rows") -> TensorDict:
        """The values of ``fields`` (default: ``meta.fields``) of meta's rows; a parent
        path (``"obs"``) reads every field of meta under it, as a nested TensorDict.
        ``shared``: a shared field (``Writer.put_shared``) given to every row ("rows"),
        or once per distinct entry with ``f + "_index"`` per row ("index")."""
        fields = list(meta.fields) if fields is None else \
            fieldpath.resolve(fields, meta.fields)
        if meta.shared is not None or shared != "rows":
            return shared_read.read(self._conn.units(), meta, fields, ragged, shared)
        cols = placement.load(self._conn.units(), meta.partition, meta.unit, meta.slot, fields,
                              occupancy(meta.index, meta.generation), meta.schemas)
        return to_tensordict(cols, len(meta), ragged=ragged)

    def put_data(self, meta: BatchMeta, data: RowData, timeout: float | None = None) -> list[str]:
        """Write new fields (or overwrite fields) of meta's rows; returns the keys of rows
        lost with their storage unit meanwhile, skipped (``Writer.put``).

        Raises:
            StateError: if some of meta's rows were freed meanwhile (acked by every
                task, or cleared); nothing is written then, no row is re-created.
            LeaseTakenOver: meta's lease lapsed (this process stopped renewing it for
                longer than ``lease_timeout``: paused, frozen) and another reader took
                the rows over; nothing is written: that reader's result counts.
        """
        cols = to_columns(data, len(meta))
        rows = RowWriter(self._conn, meta.partition, self._conn.preferred_unit())
        return rows.write(list(meta.keys), cols, None, timeout, expect=meta.generation,
                          holder=_holder(meta))

    def ack(self, meta: BatchMeta) -> int:
        """This replica of meta's rank is done with meta's rows (a second ack is a
        no-op); returns how many rows became acked by every replica. LeaseTakenOver if
        meta's lease lapsed and another reader took the rows over (nothing is acked)."""
        self._check_step(meta, "ack")
        return self._controller.ack(partition=meta.partition, task=meta.task, step=meta.step,
                                    dp_rank=meta.dp_rank, index=meta.index,
                                    generation=meta.generation, replica=meta.replica,
                                    session=meta.session)

    def release(self, meta: BatchMeta) -> None:
        """Stop reading meta's step: its rows go, unchanged, to the next reader of that
        step and rank (or of the next batch)."""
        self._check_step(meta, "release")
        self._controller.release(partition=meta.partition, task=meta.task, step=meta.step,
                                 dp_rank=meta.dp_rank, index=meta.index,
                                 generation=meta.generation, replica=meta.replica,
                                 session=meta.session)

    def renew(self, meta: BatchMeta) -> None:
        """Extend the lease on meta's step now (the heartbeat does this by itself): the
        claim of the session meta was handed to, not a peer's; a LeaseError if that
        claim lapsed and another reader took the share over."""
        self._check_step(meta, "renew")
        self._controller.renew(partition=meta.partition, task=meta.task, step=meta.step,
                               session=meta.session)

    def clear(self, target: BatchMeta | Sequence[str], partition: str | None = None) -> int:
        """Free rows: a meta's rows, or ``keys`` of ``partition``."""
        if isinstance(target, BatchMeta):
            return self._controller.clear(partition=target.partition, keys=list(target.keys))
        if isinstance(target, str):
            target = [target]
        return self._controller.clear(partition=check_name("partition", partition),
                                      keys=list(target))

    def task_rows(self, partition: str, task: str) -> dict[str, Any]:
        """Rows ``task`` will still be handed and steps it formed (see
        ``Controller.task_rows``); read-only."""
        rows = self._controller.task_rows(partition=partition, task=task)
        return {"exists": rows.exists, "closed": rows.closed, "remaining": rows.remaining,
                "formed": rows.formed, "ended": rows.ended}

    def set_version(self, partition: str, task: str, version: int,
                    at_step: int | None = None) -> None:
        """The consumer's policy version, in effect from step ``at_step`` on (see
        ``Controller.set_version``)."""
        self._controller.set_version(partition=partition, task=task, version=version,
                                     at_step=at_step)

    def reading(self, partition: str, task: str, step: int) -> None:
        """The consumer reads ``step`` now (see ``Controller.reading``)."""
        self._controller.reading(partition=partition, task=task, step=step)

    def _check_step(self, meta: BatchMeta, what: str) -> None:
        if not isinstance(meta, BatchMeta):
            raise ConfigError(f"meta must be a BatchMeta from get_meta, got {meta!r:.80}")
        if not meta.task or meta.step < 0:
            raise ConfigError(f"{what} needs a meta from get_meta (with task and step), got "
                              f"task={meta.task!r} step={meta.step}")


__all__ = ["Client"]


def _holder(meta: BatchMeta) -> dict[str, Any] | None:
    """Who writes through ``meta``: its reader, whose lease must still be its own."""
    if not meta.task or not meta.session:
        return None
    return {"task": meta.task, "step": meta.step, "dp_rank": meta.dp_rank,
            "replica": meta.replica, "session": meta.session}
