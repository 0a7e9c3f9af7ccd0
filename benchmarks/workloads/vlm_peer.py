"""TransferQueue 0.1.11's ends of workload ``vlm``, in the layout a TQ user would use.

As verl does with multi-modal data, every response row carries its own copy of the
image (``multi_modal_inputs``: per row a dict ``{"pixel_values": uint8 [3, H, W]}``, a
``NonTensorStack``) and of the prompt tokens. The producer writes through a
``TransferQueueClient`` (``kv_retrieve_meta(create=True)`` + ``put``, the body of
``kv_batch_put``): the rollouts, then the rewards. The trainer iterates TQ's
``StreamingDataLoader`` (``RankAwareSampler``, one group a batch). TQ reports no
storage size, so its storage is the growth of its storage units' resident memory from
before the first write to after the last read.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

from benchmarks.systems import procs
from benchmarks.workloads.vlm_data import Group, Shape, image_shapes, uid_of
from benchmarks.workloads.vlm_driver import RAY
from benchmarks.workloads.vlm_tq import PARTITION, TASK, check, jagged

FIELDS = ["multi_modal_inputs", "prompt_ids", "response_ids", "logprobs", "reward"]
CONTROLLER, UNIT = "ray::TransferQueueController", "ray::SimpleStorageUnit"


def _client(conf: Any) -> Any:
    from transfer_queue import TransferQueueClient

    backend = conf.backend.storage_backend
    client = TransferQueueClient(f"vlm_{uuid.uuid4().hex[:8]}", conf.controller.zmq_info)
    client.initialize_storage_manager(manager_type=backend, config=conf.backend[backend])
    return client


class Producer:
    def __init__(self, conf: Any) -> None:
        self.conf = conf
        self._client: Any = None

    def open(self) -> None:
        from benchmarks.systems.transferqueue import real_module

        real_module()
        self._client = _client(self.conf)

    def put_group(self, grp: Group) -> float:
        from tensordict import NonTensorStack, TensorDict

        keys, n = grp.keys, len(grp.keys)
        td = TensorDict({
            "multi_modal_inputs": NonTensorStack(*[{"pixel_values": grp.image.clone()}
                                                   for _ in range(n)]),
            "prompt_ids": jagged([grp.prompt_ids] * n),
            "response_ids": jagged(grp.response_ids),
            "logprobs": jagged(grp.logprobs),
        }, batch_size=[n])
        self._put(keys, td)
        t = time.monotonic()
        self._put(keys, TensorDict({"reward": grp.rewards}, batch_size=[n]))
        return t

    def _put(self, keys: list[str], td: Any) -> None:
        meta = self._client.kv_retrieve_meta(keys=keys, partition_id=PARTITION, create=True)
        self._client.put(td, metadata=meta)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


class Consumer:
    def __init__(self, conf: Any, shape: Shape) -> None:
        self.conf, self.shape = conf, shape
        self._it: Any = None
        self._client: Any = None
        self._shapes: dict[str, tuple[int, ...]] = {}

    def open(self) -> None:
        from benchmarks.systems.transferqueue import real_module

        tq = real_module()
        self._shapes = image_shapes(self.shape)
        ds = tq.StreamingDataset(config=self.conf, batch_size=self.shape.responses,
                                 micro_batch_size=self.shape.responses, data_fields=FIELDS,
                                 partition_id=PARTITION, task_name=TASK, dp_rank=0)
        self._it = iter(tq.StreamingDataLoader(ds, num_workers=0))
        self._client = _client(self.conf)

    def batches(self) -> Iterator[tuple[list[str], float]]:
        for batch, meta in self._it:
            t = time.monotonic()
            keys = self._client.kv_retrieve_keys(global_indexes=list(meta.global_indexes),
                                                 partition_id=PARTITION)
            images = [row["pixel_values"] for row in batch["multi_modal_inputs"]]
            check(images, [uid_of(k) for k in keys], self._shapes)
            yield keys, t

    def close(self) -> None:
        self._it = None
        if self._client is not None:
            self._client.close()


class PeerTarget:
    """TransferQueue with 2 SimpleStorage units on a Ray instance started here."""

    name = "transferqueue"
    layout = "image per row (verl)"
    in_process = False

    def __init__(self) -> None:
        self.conf: Any = None
        self._owned = False

    def start(self) -> None:
        from omegaconf import OmegaConf

        from benchmarks.systems import ray_util
        from benchmarks.systems.transferqueue import real_module

        tq = real_module()
        self._owned = ray_util.ensure_ray()
        conf = OmegaConf.create(
            {"controller": {"sampler": tq.RankAwareSampler, "polling_mode": True},
             "backend": {"SimpleStorage": {"num_data_storage_units": 2}}},
            flags={"allow_objects": True})
        self.conf = tq.init(conf)

    def roles(self) -> dict[str, list[int]]:
        """TQ's actors by role; Ray's own daemons (raylet, GCS, workers) as one role."""
        out: dict[str, list[int]] = {RAY: []}
        units = 0
        for pid in procs.tree_pids()[1:]:
            title = procs.name_of(pid)
            if title.startswith(CONTROLLER):
                out["controller"] = [pid]
            elif title.startswith(UNIT):
                out[f"unit {units}"] = [pid]
                units += 1
            elif "multiprocessing" not in _cmdline(pid):  # not our producer or trainer
                out[RAY].append(pid)
        return out

    def producer(self) -> Producer:
        return Producer(self.conf)

    def consumer(self, shape: Shape, timeout: float) -> Consumer:
        return Consumer(self.conf, shape)

    def storage_bytes(self, sampler: Any) -> int:
        """Growth of the storage units' RSS since before the first write."""
        now = sampler.sample()
        return sum(max(0, now[r] - sampler.baseline.get(r, now[r])) for r in now
                   if r.startswith("unit "))

    def stop(self) -> None:
        from benchmarks.systems import ray_util

        if self.conf is not None:
            import transfer_queue as tq

            tq.close()
            self.conf = None
        ray_util.shutdown(self._owned)
        self._owned = False


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""

