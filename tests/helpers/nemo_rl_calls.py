"""NeMo-RL's data-plane calls on ``transfer_queue``, in the order its TransferQueue
adapter (github NVIDIA-NeMo/RL, ``nemo_rl/data_plane/adapters/transfer_queue.py``)
makes them. Written here from reading that adapter; none of its code is copied.

``DataPlane`` is what the tests drive: driver bootstrap (package config + overlay),
partition warm-up, put, claim by polling ``get_meta``, read, consumption check, clear.
"""

from __future__ import annotations

import time
from importlib import resources
from typing import Any

import torch
from tensordict import TensorDict


def driver_conf(capacity: int = 1024, units: int = 1, extra: dict | None = None) -> Any:
    """The default ``config.yaml`` of the package merged with NeMo-RL's overlay."""
    import transfer_queue
    from omegaconf import OmegaConf

    base = OmegaConf.load(str(resources.files("transfer_queue") / "config.yaml"))
    overlay = {"controller": {"polling_mode": True},
               "backend": {"storage_backend": "SimpleStorage",
                           "SimpleStorage": {"total_storage_size": capacity,
                                             "num_data_storage_units": units}}}
    assert transfer_queue.__name__  # imported as a package, as NeMo-RL does
    return OmegaConf.merge(base, overlay, extra or {})


def patch_actor_options(runtime_env: dict) -> list[str]:
    """Wrap ``.options`` of the two actor classes (as NeMo-RL adds its runtime_env);
    returns the classes that could not be patched."""
    missing = []
    for module, name in (("transfer_queue.storage.simple_storage", "SimpleStorageUnit"),
                         ("transfer_queue.controller", "TransferQueueController")):
        try:
            cls = getattr(__import__(module, fromlist=[name]), name)
        except ImportError:
            missing.append(name)
            continue
        if not hasattr(cls, "options"):
            missing.append(name)
            continue
        original = cls.options

        def patched(*args, _original=original, **kwargs):
            kwargs.setdefault("runtime_env", runtime_env)
            return _original(*args, **kwargs)

        cls.options = patched
    return missing


class DataPlane:
    """One process's data-plane client over ``transfer_queue`` (driver or worker)."""

    def __init__(self, tq: Any, conf: Any = None, bootstrap: bool = True,
                 poll_s: float = 0.01) -> None:
        self.tq = tq
        if bootstrap:
            tq.init(conf=conf)
        else:
            tq.init()
        self.poll_s = poll_s

    def register_partition(self, partition_id: str, fields: list[str]) -> None:
        key = f"__schema__:{partition_id}:{time.time_ns()}"
        warm = TensorDict({f: torch.zeros(1) for f in fields}, batch_size=[1])
        self.tq.kv_batch_put(keys=[key], partition_id=partition_id, fields=warm, tags=[{}])
        self.tq.kv_clear(keys=[key], partition_id=partition_id)

    def put_samples(self, keys: list[str], partition_id: str, fields: TensorDict | None,
                    tags: list[dict] | None = None) -> None:
        self.tq.kv_batch_put(keys=list(keys), partition_id=partition_id,
                             fields=None if fields is None else fields.detach(),
                             tags=[{} for _ in keys] if tags is None else tags)

    def claim_meta(self, partition_id: str, task_name: str, fields: list[str],
                   batch_size: int, dp_rank: int | None = None, blocking: bool = True,
                   timeout_s: float = 30.0) -> tuple[list[str], list[dict]]:
        client = self.tq.get_client()
        sampling = {} if dp_rank is None else {"dp_rank": dp_rank}
        deadline = time.time() + timeout_s
        while True:
            meta = client.get_meta(data_fields=list(fields), batch_size=int(batch_size),
                                   partition_id=partition_id, task_name=task_name,
                                   mode="fetch", sampling_config=sampling)
            if meta.size > 0:
                break
            if not blocking:
                return [], []
            if time.time() >= deadline:
                raise TimeoutError(f"claim_meta({partition_id}, {task_name}) timed out")
            time.sleep(self.poll_s)
        keys = client.kv_retrieve_keys(global_indexes=list(meta.global_indexes),
                                       partition_id=partition_id)
        tags = list(meta.custom_meta) if meta.custom_meta else [{} for _ in keys]
        return keys, tags

    def get_samples(self, keys: list[str], partition_id: str, fields: list[str]) -> TensorDict:
        return self.tq.kv_batch_get(keys=list(keys), partition_id=partition_id,
                                    select_fields=fields)

    def consumed(self, partition_id: str, tasks: list[str]) -> bool:
        client = self.tq.get_client()
        return all(client.check_consumption_status(task_name=t, partition_id=partition_id)
                   for t in tasks)

    def clear_all(self, partition_id: str) -> None:
        keys = list(self.tq.kv_list(partition_id=partition_id).get(partition_id, {}))
        if keys:
            self.tq.kv_clear(keys=keys, partition_id=partition_id)

    def close(self) -> None:
        self.tq.close()


def densify(value: torch.Tensor) -> torch.Tensor:
    """A nested tensor whose rows share a shape as one dense tensor (what NeMo-RL does
    with every read)."""
    if isinstance(value, torch.Tensor) and value.is_nested:
        rows = list(value.unbind())
        if rows and all(r.shape == rows[0].shape for r in rows):
            return torch.stack(rows)
    return value
