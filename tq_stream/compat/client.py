"""``TransferQueueClient``: the low-level client that ``tq.get_client()`` returns.

verl's worker-group bridge (``verl/utils/transferqueue_utils.py``) awaits its
``async_*`` methods from event loops of its own; each runs the blocking tq_stream call
in the runtime's bounded thread pool, so the caller's loop keeps running. NeMo-RL calls
the synchronous ones (``get_meta``, ``kv_retrieve_keys``, ``check_consumption_status``);
``get_meta``'s semantics are in ``compat/consume.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tensordict import TensorDict

from tq_stream.compat import consume, ops
from tq_stream.compat.meta import BatchMeta
from tq_stream.compat.runtime import Runtime


class TransferQueueClient:
    """Async access by BatchMeta (see module docstring)."""

    def __init__(self, runtime: Runtime) -> None:
        self._rt = runtime

    async def async_kv_retrieve_meta(self, keys: list[str] | str, partition_id: str,
                                     create: bool = False) -> BatchMeta:
        """BatchMeta of ``keys`` in key order (missing ones created tag-only if ``create``)."""
        return await self._rt.run(ops.retrieve_meta, self._rt, keys, partition_id, create)

    async def async_kv_retrieve_keys(self, global_indexes: list[int] | int,
                                     partition_id: str) -> list[str]:
        """Keys of ``global_indexes`` in index order."""
        return await self._rt.run(ops.retrieve_keys, self._rt, global_indexes, partition_id)

    async def async_get_data(self, metadata: BatchMeta) -> TensorDict:
        """The fields of ``metadata``'s rows."""
        return await self._rt.run(ops.get_data, self._rt, metadata)

    async def async_put(self, data: TensorDict, metadata: BatchMeta | None = None,
                        partition_id: str | None = None, data_parser: Any = None) -> BatchMeta:
        """Write ``data`` to ``metadata``'s rows; returns the BatchMeta with the new fields."""
        data = ops.parse_fields(data, data_parser)
        return await self._rt.run(ops.put_data, self._rt, data, metadata, partition_id)

    async def async_kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, Any]]:
        return await self._rt.run(ops.kv_list, self._rt, partition_id)

    async def async_clear_keys(self, keys: Sequence[str], partition_id: str) -> None:
        await self._rt.run(ops.clear, self._rt, keys, partition_id)

    async def async_get_meta(self, data_fields: list[str], batch_size: int, partition_id: str,
                             mode: str = "fetch", task_name: str | None = None,
                             sampling_config: dict[str, Any] | None = None) -> BatchMeta:
        return await self._rt.run(self.get_meta, data_fields, batch_size, partition_id, mode,
                                  task_name, sampling_config)

    async def async_check_consumption_status(self, task_name: str, partition_id: str) -> bool:
        return await self._rt.run(consume.consumed, self._rt, task_name, partition_id)

    # ------------------------------------------------------------------ sync
    def get_meta(self, data_fields: list[str], batch_size: int, partition_id: str,
                 mode: str = "fetch", task_name: str | None = None,
                 sampling_config: dict[str, Any] | None = None) -> BatchMeta:
        """The next ``batch_size`` ready rows ``task_name`` has not consumed (now consumed);
        an empty BatchMeta under ``polling_mode`` when too few are ready."""
        return consume.get_meta(self._rt, data_fields, batch_size, partition_id, mode,
                                task_name)

    def check_consumption_status(self, task_name: str, partition_id: str) -> bool:
        """True iff the partition has rows and ``task_name`` consumed all of them."""
        return consume.consumed(self._rt, task_name, partition_id)

    def kv_retrieve_keys(self, global_indexes: list[int] | int, partition_id: str) -> list[str]:
        return ops.retrieve_keys(self._rt, global_indexes, partition_id)

    def kv_retrieve_meta(self, keys: list[str] | str, partition_id: str,
                         create: bool = False) -> BatchMeta:
        return ops.retrieve_meta(self._rt, keys, partition_id, create)

    def get_data(self, metadata: BatchMeta) -> TensorDict:
        return ops.get_data(self._rt, metadata)

    def put(self, data: TensorDict, metadata: BatchMeta | None = None,
            partition_id: str | None = None,
            data_parser: Callable[[dict[str, Any]], None] | None = None) -> BatchMeta:
        return ops.put_data(self._rt, ops.parse_fields(data, data_parser), metadata,
                            partition_id)

    def kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, Any]]:
        return ops.kv_list(self._rt, partition_id)

    def get_partition_list(self) -> list[str]:
        return list(self._rt.get().stats())

    def close(self) -> None:
        """Nothing to release: the runtime owns the connections."""

