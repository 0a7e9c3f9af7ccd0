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

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tensordict import TensorDict

from tq_stream import placement
from tq_stream.backends.base import occupancy
from tq_stream.convert import to_columns, to_tensordict
from tq_stream.errors import ConfigError, check_name
from tq_stream.meta import BatchMeta
from tq_stream.protocols import ControllerAPI
from tq_stream.samplers.base import Sampler

if TYPE_CHECKING:
    from tq_stream.stream import Stream


class Client:
    """Explicit calls on a Stream's controller and storage units (see module doc)."""

    def __init__(self, stream: Stream) -> None:
        self._stream = stream

    @property
    def _controller(self) -> ControllerAPI:
        return self._stream._controller()

    def register_task(self, partition: str, task: str, fields: Sequence[str], batch_size: int,
                      dp_size: int = 1, replicas: int = 1, lease_timeout: float = 300.0,
                      drop_last: bool = False, sampler: Sampler | None = None) -> None:
        """Declare a consumer task (idempotent; every rank passes the same settings)."""
        self._controller.register_task(
            partition=partition, task=task, fields=list(fields), batch_size=batch_size,
            dp_size=dp_size, replicas=replicas, lease_timeout=lease_timeout,
            drop_last=drop_last, sampler=sampler,
        )

    def get_meta(self, partition: str, task: str, step: int, dp_rank: int = 0,
                 timeout: float | None = None) -> BatchMeta:
        """The rows of ``step`` for ``dp_rank`` (waits up to ``timeout`` for them)."""
        timeout = self._stream.config.timeout if timeout is None else timeout
        d = self._controller.get_meta(partition=partition, task=task, step=step,
                                      dp_rank=dp_rank, timeout=timeout)
        return BatchMeta.from_dict(d)

    def get_data(self, meta: BatchMeta, fields: Sequence[str] | None = None,
                 ragged: str = "nested") -> TensorDict:
        """The values of ``fields`` (default: ``meta.fields``) of meta's rows."""
        fields = list(meta.fields if fields is None else fields)
        cols = placement.load(self._stream._units(), meta.partition, meta.unit, meta.slot, fields,
                              occupancy(meta.index, meta.generation), meta.schemas)
        return to_tensordict(cols, len(meta), ragged=ragged)

    def put_data(self, meta: BatchMeta, data: Any, timeout: float | None = None) -> None:
        """Write new fields (or overwrite fields) of meta's rows.

        Raises:
            StateError: if some of meta's rows were freed meanwhile (acked by every
                task, or cleared); nothing is written then, no row is re-created.
        """
        cols = to_columns(data, len(meta))
        self._stream.writer(meta.partition)._write(list(meta.keys), cols, None, timeout,
                                                   expect=meta.generation)

    def ack(self, meta: BatchMeta) -> int:
        """This rank is done with meta's rows; returns how many rows became acked."""
        self._check_step(meta, "ack")
        return self._controller.ack(partition=meta.partition, task=meta.task, step=meta.step,
                                    dp_rank=meta.dp_rank, index=meta.index,
                                    generation=meta.generation)

    def release(self, meta: BatchMeta) -> None:
        """Give meta's unacked rows back; they are handed out again later."""
        self._check_step(meta, "release")
        self._controller.release(partition=meta.partition, task=meta.task, step=meta.step,
                                 dp_rank=meta.dp_rank, index=meta.index,
                                 generation=meta.generation)

    def renew(self, meta: BatchMeta) -> None:
        """Extend the lease on meta's step."""
        self._check_step(meta, "renew")
        self._controller.renew(partition=meta.partition, task=meta.task, step=meta.step)

    def clear(self, target: BatchMeta | Sequence[str], partition: str | None = None) -> int:
        """Free rows: a meta's rows, or ``keys`` of ``partition``."""
        if isinstance(target, BatchMeta):
            return self._controller.clear(partition=target.partition, keys=list(target.keys))
        if isinstance(target, str):
            target = [target]
        return self._controller.clear(partition=check_name("partition", partition),
                                      keys=list(target))

    def set_version(self, partition: str, task: str, version: int) -> None:
        self._controller.set_version(partition=partition, task=task, version=version)

    def _check_step(self, meta: BatchMeta, what: str) -> None:
        if not meta.task or meta.step < 0:
            raise ConfigError(f"{what} needs a meta from get_meta (with task and step), got "
                              f"task={meta.task!r} step={meta.step}")


__all__ = ["Client"]
