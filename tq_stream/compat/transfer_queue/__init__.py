"""A drop-in ``transfer_queue`` module (TransferQueue 0.1.11's API) over tq_stream.

    import tq_stream.compat
    tq_stream.compat.install()        # now `import transfer_queue as tq` gets this module
    tq.init(conf)                     # driver: starts a deployment
    tq.kv_batch_put(keys=["p0"], partition_id="train", tags=[{"status": "pending"}])

Every function keeps TransferQueue's argument names, defaults and return types
(see ``docs/design.md``, "Compatibility layer"); the blocking work is tq_stream's
controller and storage units. Async functions run their blocking call in a
bounded thread pool, so they work from any event loop.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tensordict import TensorDict

from tq_stream.compat import ops
from tq_stream.compat.client import TransferQueueClient
from tq_stream.compat.meta import BatchMeta, KVBatchMeta
from tq_stream.compat.runtime import RUNTIME
from tq_stream.errors import StateError

METADATA_FILE = "metadata.json"
STATE_FILE = "tq_stream.ckpt"

__version__ = "0.1.11"  # the TransferQueue API this module implements


# ------------------------------------------------------------------ lifecycle
def init(conf: object = None) -> dict[str, Any] | None:
    """Start a deployment (``conf`` given, none running) or attach to the running one.

    Returns:
        the merged config when this call started the deployment, else ``conf``.
    """
    return RUNTIME.init(conf)


def close() -> None:
    """Close this process's handle; the process that started the deployment stops it."""
    RUNTIME.close()


def get_client() -> TransferQueueClient:
    """The low-level async client (``init`` must have been called)."""
    RUNTIME.get(auto=False)
    return TransferQueueClient(RUNTIME)


def get_metrics_endpoint() -> str | None:
    """``host:port`` of the Prometheus endpoint when ``metrics.enabled``, else None."""
    return RUNTIME.metrics_endpoint()


# --------------------------------------------------------------------- KV, sync
def kv_put(key: str, partition_id: str, fields: TensorDict | dict[str, Any] | None = None,
           tag: dict[str, Any] | None = None,
           data_parser: Callable[[Any], Any] | None = None) -> KVBatchMeta:
    """Write one row's ``fields`` (no batch dim; or a TensorDict ``[1]``) and merge ``tag``."""
    return ops.batch_put(RUNTIME, [key], partition_id, _one(fields, data_parser),
                         None if tag is None else [tag])


def kv_batch_put(keys: list[str], partition_id: str, fields: TensorDict | None = None,
                 tags: list[dict[str, Any]] | None = None,
                 data_parser: Callable[[Any], Any] | None = None) -> KVBatchMeta:
    """Write ``fields`` (batch size ``len(keys)``) and merge ``tags`` into ``keys``.

    Returns:
        KVBatchMeta with the merged tags and every field now stored for all ``keys``.
    """
    return ops.batch_put(RUNTIME, keys, partition_id, ops.parse_fields(fields, data_parser),
                         tags)


def kv_batch_get(keys: list[str] | str, partition_id: str,
                 select_fields: list[str] | str | None = None) -> TensorDict:
    """Rows of ``keys`` (in that order) as a TensorDict; ragged fields are jagged."""
    return ops.batch_get(RUNTIME, keys, partition_id, select_fields)


def kv_batch_get_by_meta(meta: KVBatchMeta,
                         select_fields: list[str] | str | None = None) -> TensorDict:
    """``kv_batch_get`` of a KVBatchMeta's keys (``select_fields`` must be in meta.fields)."""
    return kv_batch_get(meta.keys, _meta_partition(meta), _meta_fields(meta, select_fields))


def kv_list(partition_id: str | None = None) -> dict[str, dict[str, Any]]:
    """``{partition_id: {key: tags}}`` of one partition or of all of them."""
    return ops.kv_list(RUNTIME, partition_id)


def kv_clear(keys: list[str] | str, partition_id: str) -> None:
    """Remove ``keys`` (tags and data); unknown keys are ignored."""
    ops.clear(RUNTIME, keys, partition_id)


# -------------------------------------------------------------------- KV, async
async def async_kv_put(key: str, partition_id: str,
                       fields: TensorDict | dict[str, Any] | None = None,
                       tag: dict[str, Any] | None = None,
                       data_parser: Callable[[Any], Any] | None = None) -> KVBatchMeta:
    return await RUNTIME.run(kv_put, key, partition_id, fields, tag, data_parser)


async def async_kv_batch_put(keys: list[str], partition_id: str,
                             fields: TensorDict | None = None,
                             tags: list[dict[str, Any]] | None = None,
                             data_parser: Callable[[Any], Any] | None = None) -> KVBatchMeta:
    return await RUNTIME.run(kv_batch_put, keys, partition_id, fields, tags, data_parser)


async def async_kv_batch_get(keys: list[str] | str, partition_id: str,
                             select_fields: list[str] | str | None = None) -> TensorDict:
    return await RUNTIME.run(kv_batch_get, keys, partition_id, select_fields)


async def async_kv_batch_get_by_meta(meta: KVBatchMeta,
                                     select_fields: list[str] | str | None = None) -> TensorDict:
    return await RUNTIME.run(kv_batch_get_by_meta, meta, select_fields)


async def async_kv_list(partition_id: str | None = None) -> dict[str, dict[str, Any]]:
    return await RUNTIME.run(kv_list, partition_id)


async def async_kv_clear(keys: list[str] | str, partition_id: str) -> None:
    await RUNTIME.run(kv_clear, keys, partition_id)


# ------------------------------------------------------------------ checkpoints
def save_checkpoint(checkpoint_dir: str | Path, *, include_storage: bool = True,
                    metadata: dict[str, Any] | None = None) -> None:
    """Write every key, tag and stored field to ``checkpoint_dir`` (replaced atomically).

    ``include_storage`` is accepted for compatibility; rows are always saved (as
    TransferQueue does for its in-memory storage).
    """
    stream = RUNTIME.get(auto=False)
    target = Path(checkpoint_dir)
    tmp = target.parent / f"{target.name}.tmp"
    old = target.parent / f"{target.name}.old"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        stream.save(str(tmp / STATE_FILE))
        with open(tmp / METADATA_FILE, "w") as f:
            json.dump({"storage_saved": True, "format": "tq_stream",
                       "user_metadata": metadata or {}}, f, indent=2)
        if target.exists():
            if old.exists():
                shutil.rmtree(old)
            target.rename(old)
        tmp.rename(target)
        if old.exists():
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not target.exists():
            old.rename(target)
        raise


def load_checkpoint(checkpoint_dir: str | Path) -> None:
    """Restore a checkpoint written by ``save_checkpoint`` into this (fresh) deployment.

    Raises:
        FileNotFoundError: no checkpoint at ``checkpoint_dir``.
        StateError: the deployment already has partitions (load before any put).
    """
    from tq_stream.deploy import snapshot

    stream = RUNTIME.get(auto=False)
    target = Path(checkpoint_dir)
    old = target.parent / f"{target.name}.old"
    if not target.exists() and old.exists():  # a save died between its two renames
        old.rename(target)
    for need in (target, target / METADATA_FILE, target / STATE_FILE):
        if not need.exists():
            raise FileNotFoundError(f"checkpoint_dir must hold a tq_stream checkpoint, "
                                    f"missing {need}")
    ctrl = stream.connection.controller()
    if ctrl.partitions():
        raise StateError(f"load_checkpoint must run on a fresh deployment (before any put), "
                         f"but it has partitions {ctrl.partitions()}")
    snapshot.restore(str(target / STATE_FILE), ctrl, stream.connection.units())
    RUNTIME.partitions.clear()
    RUNTIME.schemas.clear()


def _one(fields: Any, data_parser: Any) -> Any:
    if fields is None:
        return None
    return ops.parse_fields(ops.one_row(fields), data_parser)


def _meta_partition(meta: KVBatchMeta) -> str:
    if meta.partition_id is None:
        raise ValueError("meta.partition_id must be set to read by meta, got None")
    return meta.partition_id


def _meta_fields(meta: KVBatchMeta, select_fields: list[str] | str | None) -> list[str] | None:
    fields = ops.as_fields(select_fields)
    if fields is None:
        return meta.fields
    if meta.fields is None or any(f not in meta.fields for f in fields):
        raise ValueError(f"select_fields must be in meta.fields {meta.fields}, got {fields}")
    return fields


__all__ = [
    "BatchMeta", "KVBatchMeta", "TransferQueueClient", "async_kv_batch_get",
    "async_kv_batch_get_by_meta", "async_kv_batch_put", "async_kv_clear", "async_kv_list",
    "async_kv_put", "close", "get_client", "get_metrics_endpoint", "init", "kv_batch_get",
    "kv_batch_get_by_meta", "kv_batch_put", "kv_clear", "kv_list", "kv_put", "load_checkpoint",
    "save_checkpoint",
]
