"""TransferQueue 0.1.11 through its public API: KV API, client, StreamingDataLoader.

Deployment (``start``): a local Ray instance (unless one is connected), then
``transfer_queue.init(conf)``, which creates the ``TransferQueueController`` actor and
``storage_units`` SimpleStorage actors (its default backend). ``stop`` calls
``transfer_queue.close()`` (kills those actors) and shuts Ray down if it started it.

Data path: ``kv_batch_put`` / ``kv_batch_get`` / ``kv_clear`` in one partition. TQ 0.1.11
returns every non-scalar tensor field as a jagged nested tensor, fixed-shape ones too;
``get`` turns a uniform one back into a dense view of the same values (no copy).

Streaming: producers use a ``TransferQueueClient`` built from the deployment's config
(what ``StreamingDataset`` does too; no Ray in the producer) and write by key
(``kv_retrieve_meta(create=True)`` + ``put``, the body of ``kv_batch_put``). Each consumer
rank iterates TQ's ``StreamingDataLoader`` over a ``StreamingDataset`` with
``dp_rank=rank``; rows are identified by global index and mapped back to keys with
``kv_retrieve_keys`` after the run. See ``benchmarks/peers/TRANSFERQUEUE_NOTES.md``.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import uuid
from typing import Any

import torch

from benchmarks.systems import procs, ray_util
from benchmarks.systems.base import StreamSpec, System

VERSION = "0.1.11"


def _peer_env() -> dict[str, str]:
    """TQ reads these at import, in every process (actors inherit them through Ray).

    TQ_NUM_THREADS defaults to 8 and TQ then logs a warning on every put/get on a machine
    with fewer physical cores; the log level keeps the bench output readable.
    """
    import psutil

    return {
        "TQ_NUM_THREADS": str(psutil.cpu_count(logical=False) or 1),
        "TQ_LOGGING_LEVEL": "ERROR",
    }


_REAL_MODULES: dict[str, Any] = {}  # the real package's modules, once imported


def real_module() -> Any:
    """TransferQueue's own ``transfer_queue`` package, also after
    ``tq_stream.compat.install()`` registered tq_stream's under that name (the workloads
    that run both in one process switch back and forth): imported once, its modules are
    put back in ``sys.modules`` on every call, so none of them runs twice."""
    import sys

    import tq_stream.compat

    tq_stream.compat.uninstall()
    if not _REAL_MODULES:
        for name, value in _peer_env().items():
            os.environ.setdefault(name, value)  # before the first import of transfer_queue
        import transfer_queue

        assert not transfer_queue.__name__.startswith("tq_stream")
        _REAL_MODULES.update({k: m for k, m in sys.modules.items()
                              if k == "transfer_queue" or k.startswith("transfer_queue.")})
    sys.modules.update(_REAL_MODULES)
    return _REAL_MODULES["transfer_queue"]


def _dense(td):
    """Jagged fields whose rows all have one length -> dense views of their values."""
    for name, value in list(td.items()):
        if isinstance(value, torch.Tensor) and value.is_nested and value.layout == torch.jagged:
            lengths = value.offsets().diff()
            if len(lengths) and bool((lengths == lengths[0]).all()):
                values = value.values()
                td[name] = values.view(len(lengths), int(lengths[0]), *values.shape[1:])
    return td


class TransferQueueSystem(System):
    """TransferQueue with SimpleStorage on Ray.

    Args:
        storage_units: number of SimpleStorage actors.
        sampler: controller sampler class name; ``RankAwareSampler`` is what TQ's
            StreamingDataLoader tutorial uses, ``SequentialSampler`` is TQ's default.
        num_cpus: logical CPUs of a Ray instance started here (TQ needs 1 + units).
    """

    name = "transferqueue"
    supports_stream = True

    def __init__(
        self,
        storage_units: int = 2,
        sampler: str = "RankAwareSampler",
        partition: str = "bench",
        num_cpus: int = ray_util.DEFAULT_NUM_CPUS,
    ) -> None:
        self.storage_units, self.sampler, self.partition = storage_units, sampler, partition
        self._num_cpus = num_cpus
        self._owned = False
        self._conf = None
        self._runs = itertools.count()
        self._stream_partition = ""

    @classmethod
    def available(cls) -> tuple[bool, str]:
        from importlib import metadata

        if importlib.util.find_spec("transfer_queue") is None:
            return False, f"transferqueue is not installed (pip install transferqueue=={VERSION})"
        found = metadata.version("transferqueue")
        if found != VERSION:
            return False, f"transferqueue {found} installed; the adapter targets {VERSION}"
        return ray_util.ray_available()

    def start(self) -> None:
        for name, value in _peer_env().items():
            os.environ.setdefault(name, value)  # before the first import of transfer_queue
        import transfer_queue as tq
        from omegaconf import OmegaConf

        self._owned = ray_util.ensure_ray(self._num_cpus)
        conf = OmegaConf.create(
            {
                "controller": {"sampler": getattr(tq, self.sampler), "polling_mode": True},
                "backend": {"SimpleStorage": {"num_data_storage_units": self.storage_units}},
            },
            flags={"allow_objects": True},
        )
        self._conf = tq.init(conf)

    def stop(self) -> None:
        if self._conf is not None:
            import transfer_queue as tq

            tq.close()
            self._conf = None
        ray_util.shutdown(self._owned)
        self._owned = False

    def put(self, keys: list[str], td) -> None:
        import transfer_queue as tq

        tq.kv_batch_put(keys=keys, partition_id=self.partition, fields=td)

    def get(self, keys: list[str], fields: list[str] | None = None):
        import transfer_queue as tq

        return _dense(tq.kv_batch_get(keys=keys, partition_id=self.partition, select_fields=fields))

    def clear(self, keys: list[str]) -> None:
        import transfer_queue as tq

        tq.kv_clear(keys=keys, partition_id=self.partition)

    def pids(self) -> list[int]:
        """This process and its descendants (Ray daemons, TQ's actors when Ray was started
        here); with an external cluster, TQ actor processes on this host, by their titles."""
        pids = procs.tree_pids()
        if not self._owned:
            titles = ("ray::TransferQueueController", "ray::SimpleStorageUnit")
            pids += [p for p in _all_pids() if procs.name_of(p).startswith(titles)]
        return sorted(set(pids))

    # streaming
    def stream_setup(self, spec: StreamSpec) -> None:
        self._stream_partition = f"{spec.partition}-{os.getpid()}-{next(self._runs)}"

    def stream_teardown(self, spec: StreamSpec) -> None:
        import transfer_queue as tq

        try:
            tq.get_client().clear_partition(self._stream_partition)
        except Exception:  # an empty or unknown partition is fine
            pass

    def stream_writer(self, spec: StreamSpec) -> _Writer:
        return _Writer(self._conf, self._stream_partition)

    def stream_reader(self, spec: StreamSpec, rank: int) -> _Reader:
        return _Reader(self._conf, self._stream_partition, spec, rank)

    def stream_keys(self, spec: StreamSpec, ids: list[Any]) -> list[str]:
        import transfer_queue as tq

        client, part = tq.get_client(), self._stream_partition
        out: list[str] = []
        for i in range(0, len(ids), 4096):
            chunk = [int(x) for x in ids[i : i + 4096]]
            out += client.kv_retrieve_keys(global_indexes=chunk, partition_id=part)
        return out


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _client(conf):
    from transfer_queue import TransferQueueClient

    backend = conf.backend.storage_backend
    client = TransferQueueClient(f"bench_{uuid.uuid4().hex[:8]}", conf.controller.zmq_info)
    client.initialize_storage_manager(manager_type=backend, config=conf.backend[backend])
    return client


class _Writer:
    def __init__(self, conf, partition: str) -> None:
        self.conf, self.partition = conf, partition
        self._client = None

    def open(self) -> None:
        self._client = _client(self.conf)

    def put(self, keys: list[str], td) -> None:
        meta = self._client.kv_retrieve_meta(keys=keys, partition_id=self.partition, create=True)
        self._client.put(td, metadata=meta)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


class _Reader:
    def __init__(self, conf, partition: str, spec: StreamSpec, rank: int) -> None:
        self.conf, self.partition, self.spec, self.rank = conf, partition, spec, rank
        self._loader = None
        self._it = None

    def open(self) -> None:
        from transfer_queue import StreamingDataLoader, StreamingDataset

        ds = StreamingDataset(
            config=self.conf,
            batch_size=self.spec.batch_size,
            micro_batch_size=self.spec.batch_size,
            data_fields=list(self.spec.fields),
            partition_id=self.partition,
            task_name=self.spec.task,
            dp_rank=self.rank,
        )
        nw = self.spec.num_workers
        self._loader = StreamingDataLoader(ds, num_workers=nw, prefetch_factor=2 if nw else None)
        self._it = iter(self._loader)

    def batches(self):
        for _batch, meta in self._it:
            yield meta.global_indexes

    def close(self) -> None:
        self._it = None
        self._loader = None
