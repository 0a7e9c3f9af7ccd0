"""tq_stream as a benchmarked system: embedded, local (2 storage units) or on Ray.

The data path uses the public KV API (``stream.kv.put_batch/get_batch/clear``);
the streaming workload uses ``Writer.put`` in producer processes and
``StreamingDataLoader`` in consumer processes (local and Ray modes: an embedded
stream lives in one process, so it runs only the data-path workloads).
"""

from __future__ import annotations

import itertools
import os
from typing import Any

from benchmarks.systems.base import StreamSpec, System

PARTITION = "bench"


class TqStreamSystem(System):
    """tq_stream in one deployment mode.

    Args:
        mode: "embedded", "local" or "ray".
        storage_units: storage units of the deployment.
    """

    def __init__(self, mode: str = "embedded", storage_units: int = 2) -> None:
        self.mode = mode
        self.units = storage_units if mode != "embedded" else 1
        self.name = f"tq_stream {mode}" + (f" ({self.units} units)" if mode != "embedded" else "")
        self.supports_stream = mode != "embedded"
        self._tq: Any = None
        self._runs = itertools.count()
        self._partition = ""

    @classmethod
    def available(cls) -> tuple[bool, str]:
        return True, ""

    def start(self) -> None:
        import tq_stream as tq

        if self.mode == "ray":
            from benchmarks.systems import ray_util

            ray_util.ensure_ray()
        self._tq = tq.init(mode=self.mode, storage_units=self.units) \
            if self.mode != "embedded" else tq.init()

    def stop(self) -> None:
        if self._tq is not None:
            self._tq.close()
            self._tq = None

    def put(self, keys: list[str], td: Any) -> None:
        self._tq.kv.put_batch(keys, td, partition=PARTITION)

    def get(self, keys: list[str], fields: list[str] | None = None) -> Any:
        return self._tq.kv.get_batch(keys, fields, partition=PARTITION)

    def clear(self, keys: list[str]) -> None:
        self._tq.kv.clear(keys, partition=PARTITION)

    def pids(self) -> list[int]:
        """The deployment's processes: this one when embedded, else the servers."""
        owner = getattr(self._tq, "_owner", None)
        return list(getattr(owner, "pids", [])) if self.mode != "embedded" else [os.getpid()]

    # --- workload 3
    def stream_setup(self, spec: StreamSpec) -> None:
        self._partition = f"{spec.partition}-{next(self._runs)}"
        # the consumer task is declared, so acked rows free their memory as they go
        self._tq.create_partition(self._partition, consumers=[spec.task])

    def stream_teardown(self, spec: StreamSpec) -> None:
        self._tq.kv.clear(None, partition=self._partition)

    def stream_writer(self, spec: StreamSpec) -> _Writer:
        return _Writer(self._tq, self._partition)

    def stream_reader(self, spec: StreamSpec, rank: int) -> _Reader:
        return _Reader(self._tq, self._partition, spec, rank)


class _Writer:
    """A producer process's end: the picklable Stream and a partition name."""

    def __init__(self, stream: Any, partition: str) -> None:
        self._tq, self.partition = stream, partition
        self._writer: Any = None

    def open(self) -> None:
        self._writer = self._tq.writer(self.partition)

    def put(self, keys: list[str], td: Any) -> None:
        self._writer.put(keys, td)

    def close(self) -> None:
        self._tq.close()


class _Reader:
    """A consumer rank's end: a StreamingDataLoader over its DP rank."""

    def __init__(self, stream: Any, partition: str, spec: StreamSpec, rank: int) -> None:
        self._tq, self.partition, self.spec, self.rank = stream, partition, spec, rank
        self._loader: Any = None

    def open(self) -> None:
        import tq_stream as tq

        ds = tq.StreamingDataset(
            self._tq, self.partition, self.spec.task, list(self.spec.fields),
            batch_size=self.spec.batch_size, dp_rank=self.rank,
            dp_size=self.spec.consumer_ranks, timeout=self.spec.timeout_s)
        self._loader = tq.StreamingDataLoader(ds, num_workers=self.spec.num_workers)

    def batches(self) -> Any:
        import tq_stream as tq

        for batch in self._loader:
            yield tq.batch_meta(batch).keys

    def close(self) -> None:
        self._tq.close()
