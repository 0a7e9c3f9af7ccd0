"""The adapter interface every benchmarked system implements.

A ``System`` is one deployment of one data system (or the memcpy limit). The harness owns
the workloads and the timing; an adapter only translates the calls below into the
system's public API. Lifecycle::

    ok, why = MySystem.available()        # False + reason when the package is missing
    system = MySystem(); system.start()   # deploy; after start() a put must succeed
    system.put(keys, td); system.get(keys, ["a"]); system.clear(keys)
    system.resident_bytes()               # RSS of every process of the deployment
    result = system.run_stream(spec)      # workload 3, see ``streaming.py``
    system.stop()                         # idempotent; leaves no process behind

Contract for ``put``/``get``/``clear`` (data path, workloads 1, 2, 5):

* ``put(keys, td)`` upserts ``len(keys)`` rows; ``td.batch_size == [len(keys)]``. It
  returns when the rows are readable by any later ``get`` (from any thread).
* ``get(keys, fields)`` returns a TensorDict of ``len(keys)`` rows in the order of
  ``keys`` holding ``fields`` (all stored fields when ``None``). Fixed-shape fields come
  back dense; variable-length fields as jagged nested tensors; non-tensor fields as
  ``NonTensorStack``. An adapter may convert a peer's output only with an O(1) view.
* ``clear(keys)`` removes the rows and returns once their storage can be reused.
* All three must be safe to call from several threads at once (the small-operation
  workload runs 16 concurrent callers); an adapter that serialises calls internally
  says so in its docstring.

Contract for streaming (workload 3): an adapter sets ``supports_stream = True`` and
implements ``stream_writer``/``stream_reader``; the shared driver
(:func:`benchmarks.systems.streaming.run_stream`) spawns the producer and consumer
processes, times them and returns a :class:`StreamResult`.
"""

from __future__ import annotations

import abc
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from benchmarks.systems import procs

if TYPE_CHECKING:
    from collections.abc import Callable

    from tensordict import TensorDict


@dataclass(frozen=True)
class StreamSpec:
    """Shape of one streaming run (workload 3).

    Rows ``i`` with ``i % producers == p`` are written by producer ``p`` in puts of
    ``rows_per_put`` rows; ``consumer_ranks`` ranks (distinct DP ranks, so they must
    receive disjoint rows) read batches of ``batch_size`` through the system's DataLoader
    with ``num_workers`` worker processes each.
    """

    rows: int = 4096
    seq_len: int = 1024
    producers: int = 2
    rows_per_put: int = 1
    consumer_ranks: int = 2
    batch_size: int = 32
    num_workers: int = 0
    fields: tuple[str, ...] = ("input_ids",)
    partition: str = "stream"
    task: str = "bench"
    timeout_s: float = 300.0
    ready_timeout_s: float = 120.0
    drain_s: float = 1.0

    def keys_of(self, producer: int) -> list[str]:
        """Row keys written by ``producer``, in write order."""
        return [f"row{i}" for i in range(producer, self.rows, self.producers)]


@dataclass
class StreamResult:
    """Raw timestamps of a streaming run; all on ``time.monotonic()`` (system-wide on Linux).

    Attributes:
        start: when producers and consumers were released (all had connected).
        write: row key -> time just before the put that carried the row was called.
        written: row key -> time that put returned.
        deliveries: one ``(key, rank, t)`` per row per delivery, duplicates included;
            ``t`` is when the consumer's DataLoader yielded the batch.
        first_batch: rank -> time its first batch was yielded.
        end: when the driver stopped collecting.
        errors: ``"where: message"`` strings reported by child processes.
    """

    spec: StreamSpec
    start: float = 0.0
    write: dict[str, float] = field(default_factory=dict)
    written: dict[str, float] = field(default_factory=dict)
    deliveries: list[tuple[str, int, float]] = field(default_factory=list)
    first_batch: dict[int, float] = field(default_factory=dict)
    end: float = 0.0
    errors: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        """Rows/s end to end, time to first batch, write->yield p50/p99, dups, missing."""
        seen: dict[str, float] = {}
        for key, _rank, t in self.deliveries:
            seen.setdefault(key, t)
        lat = sorted(t - self.write[k] for k, t in seen.items() if k in self.write)
        last = max((t for _, _, t in self.deliveries), default=self.start)

        def pct(q: float) -> float:
            return lat[min(len(lat) - 1, int(q * len(lat)))] if lat else float("nan")

        expected = {k for p in range(self.spec.producers) for k in self.spec.keys_of(p)}
        return {
            "rows_per_s": len(seen) / (last - self.start) if last > self.start else 0.0,
            "first_batch_s": min(self.first_batch.values(), default=float("nan")) - self.start,
            "latency_p50_s": pct(0.50),
            "latency_p99_s": pct(0.99),
            "duplicates": len(self.deliveries) - len(seen),
            "missing": len(expected - seen.keys()),
            "errors": len(self.errors),
        }


class StreamWriter(Protocol):
    """A producer's end, built in the parent, pickled into a spawned producer process."""

    def open(self) -> None:
        """Connect to the running deployment (called in the producer process)."""

    def put(self, keys: list[str], td: TensorDict) -> None:
        """Write rows; return when they are committed (visible to readers)."""

    def close(self) -> None:
        """Release sockets/connections."""


class StreamReader(Protocol):
    """A consumer rank's end, built in the parent, pickled into a spawned consumer process."""

    def open(self) -> None:
        """Build the system's DataLoader (and start its workers) in the consumer process."""

    def batches(self) -> Iterator[Sequence[Hashable]]:
        """Iterate the DataLoader; yield the row ids of each batch as it is yielded.

        Row ids are keys, or anything :meth:`System.stream_keys` maps to keys in the
        parent after the run. The iterator may block forever once the stream is drained:
        the driver stops the process.
        """

    def close(self) -> None:
        """Shut the DataLoader down."""


class System(abc.ABC):
    """One deployment of a benchmarked system. Subclasses set ``name``."""

    name: str = "system"
    supports_stream: bool = False

    @classmethod
    def available(cls) -> tuple[bool, str]:
        """Whether the system can run here; when not, the reason (e.g. a missing package)."""
        return True, ""

    @abc.abstractmethod
    def start(self) -> None:
        """Deploy; when this returns, ``put`` succeeds."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Tear down every process/actor this system started. Idempotent."""

    @abc.abstractmethod
    def put(self, keys: list[str], td: TensorDict) -> None:
        """Upsert ``len(keys)`` rows."""

    @abc.abstractmethod
    def get(self, keys: list[str], fields: list[str] | None = None) -> TensorDict:
        """Read rows in key order; ``fields=None`` means every stored field."""

    @abc.abstractmethod
    def clear(self, keys: list[str]) -> None:
        """Remove rows and free their storage."""

    def pids(self) -> list[int]:
        """PIDs of every process of the deployment (default: this process + descendants)."""
        return procs.tree_pids()

    def resident_bytes(self, proportional: bool = False) -> int:
        """Resident set size summed over :meth:`pids`.

        RSS counts a shared page (Ray's object store, shared memory) once per process that
        maps it; ``proportional=True`` sums PSS instead, which counts it once in total.
        """
        size = procs.pss_bytes if proportional else procs.rss_bytes
        return sum(size(pid) for pid in self.pids())

    def stream_writer(self, spec: StreamSpec) -> StreamWriter:
        """A picklable producer end for ``spec`` (only when ``supports_stream``)."""
        raise NotImplementedError(f"{self.name} does not support streaming")

    def stream_reader(self, spec: StreamSpec, rank: int) -> StreamReader:
        """A picklable consumer end for DP rank ``rank`` (only when ``supports_stream``)."""
        raise NotImplementedError(f"{self.name} does not support streaming")

    def stream_keys(self, spec: StreamSpec, ids: list[Any]) -> list[str]:
        """Map row ids a reader reported to row keys (parent side, after the run)."""
        return [str(i) for i in ids]

    def stream_setup(self, spec: StreamSpec) -> None:
        """Parent-side preparation before the processes start (e.g. a fresh partition)."""
        return None

    def stream_teardown(self, spec: StreamSpec) -> None:
        """Parent-side cleanup after the run (e.g. drop the partition)."""
        return None

    def run_stream(
        self,
        spec: StreamSpec,
        make_rows: Callable[[list[str], StreamSpec], TensorDict] | None = None,
    ) -> StreamResult:
        """Run workload 3 against this system; see ``streaming.run_stream``.

        ``make_rows(keys, spec)`` must be picklable (module level); default
        ``streaming.token_rows``.
        """
        from benchmarks.systems.streaming import run_stream, token_rows

        return run_stream(self, spec, make_rows or token_rows)

    def __enter__(self) -> System:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
