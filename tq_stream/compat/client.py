"""``TransferQueueClient``: the low-level client that ``tq.get_client()`` returns.

verl's worker-group bridge (``verl/utils/transferqueue_utils.py``) awaits four of its
methods from event loops of its own; each runs the blocking tq_stream call in the
runtime's bounded thread pool, so the caller's loop keeps running.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tensordict import TensorDict

from tq_stream.compat import ops
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

    async def async_kv_list(self, partition_id: str | None = None) -> dict[str, dict]:
        return await self._rt.run(ops.kv_list, self._rt, partition_id)

    async def async_clear_keys(self, keys: Sequence[str], partition_id: str) -> None:
        await self._rt.run(ops.clear, self._rt, keys, partition_id)

    def close(self) -> None:
        """Nothing to release: the runtime owns the connections."""

