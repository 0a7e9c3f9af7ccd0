"""Stream: the handle every producer and consumer holds.

A Stream reaches the controller and the storage units of one deployment. It
does not own them: closing a handle closes its connections, while the
``Deployment`` that ``tq.init`` started owns the processes (or, embedded, the
in-process objects) and stops them. Handles of out-of-process deployments are
picklable (they reconnect lazily in the receiving process); an embedded
handle is not, since its controller lives only in this process.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tq_stream.backends.spill import check_budget, check_cold
from tq_stream.client import Client
from tq_stream.config import StreamConfig
from tq_stream.connection.connection import Connection
from tq_stream.errors import StateError, check_name
from tq_stream.kv import KV
from tq_stream.media import Media, MediaRef
from tq_stream.stats import DeploymentStats, PartitionStats, ProcessInfo
from tq_stream.writer import Writer

if TYPE_CHECKING:
    from tq_stream.connection.protocols import Owner
    from tq_stream.metrics.server import MetricsServer

logger = logging.getLogger(__name__)


class Stream:
    """Access to one deployment (see module docstring).

    Args:
        connection: how this process reaches the deployment (``stream.connection``).
        owner: what closing this handle stops (the deployment ``tq.init`` started, or
            the sockets ``tq.connect`` opened); None for a handle reopened elsewhere.
        metrics: the Prometheus endpoint this handle serves (``tq.init(metrics_port=)``).

    Example:
        >>> with tq.init() as stream:
        ...     stream.writer("train").put(["k"], {"x": torch.ones(1, 4)})
    """

    def __init__(self, connection: Connection, owner: Owner | None = None,
                 metrics: MetricsServer | None = None) -> None:
        self.connection = connection
        self._owner = owner
        self._metrics = metrics
        self.kv = KV(connection)
        self.media = Media(connection)  # media by reference (``tq_stream.media``)

    # -- public API
    @property
    def config(self) -> StreamConfig:
        """Timeouts and lease defaults of this handle's clients."""
        return self.connection.config

    @property
    def mode(self) -> str:
        """"embedded", "local", "ray", or "remote" (a joined or handed-on handle)."""
        return self.connection.mode

    @property
    def address(self) -> str | None:
        """Where ``tq.connect`` reaches this deployment (None when embedded)."""
        return self.connection.address

    @property
    def curve_server_key(self) -> bytes | None:
        """The deployment's CURVE public key, which clients pass to ``tq.connect``."""
        return self.connection.curve_server_key

    def writer(self, partition: str, unit: int = -1) -> Writer:
        """A producer handle on ``partition`` (created on first write).

        ``unit`` pins rows to one storage unit; by default a writer prefers the units
        on its own host (and spreads rows over all of them).
        """
        return Writer(self.connection, partition, None if unit == -1 else unit)

    def resolve(self, ref: MediaRef, fields: list[str] | None = None) -> dict[str, Any]:
        """The tensors of a media handle (``Media.resolve``)."""
        return self.media.resolve(ref, fields)

    def release(self, ref: MediaRef) -> None:
        """End a media handle's pin (``Media.release``)."""
        self.media.release(ref)

    def client(self, consumer: str = "") -> Client:
        """The low-level client (get_meta / get_data / put_data / ack): one consumer
        session (see ``Client``); ``consumer`` names a stage worker of a pool."""
        return Client(self.connection, consumer)

    def create_partition(self, partition: str, capacity: int | None = None,
                         consumers: list[str] | None = None,
                         memory_budget: int | None = None,
                         cold: Sequence[str] = ()) -> None:
        """Create ``partition`` explicitly.

        Args:
            capacity: at most this many live rows (a full partition blocks writers).
            consumers: the tasks that read every row, e.g. ``["old_logp",
                "update_actor"]``. A row is freed once each of them acked or discarded
                it, whatever order they start in; a task not in the list cannot
                register. Without it, rows stay until cleared (``kv.clear``,
                ``client.clear``): nothing is freed behind a consumer's back.
            memory_budget: at most this many bytes of the partition's column values in
                memory on each storage unit (at least 4096); a put past it with nothing to
                spill is made again within its timeout (acks free room), then raises
                ``MemoryBudgetExceeded``; one that needs more by itself fails at once
                (``MemoryBudgetTooSmall``). None: unbounded.
            cold: fields kept on each unit's local disk, read back on demand
                (``mark_cold``). See README, "Memory budget and spilling".
        """
        budget, names = check_budget(memory_budget), sorted(check_cold(cold))
        self.connection.controller().create_partition(
            partition=partition, capacity=capacity, consumers=consumers,
            **({"spills": True} if budget is not None else {}))
        if budget is not None or names:
            for unit in self.connection.units():
                unit.set_memory(partition, budget, names)

    def mark_cold(self, partition: str, fields: Sequence[str]) -> None:
        """Keep ``fields`` of ``partition`` on the storage units' local disk from now on:
        rows already in memory move there, later puts write there, reads read them back
        (for fields read rarely: images a trainer does not read, the prompt text after
        generation). Its memory budget stays as set."""
        check_name("partition", partition)
        names = sorted(check_cold(fields))
        for unit in self.connection.units():
            unit.set_memory(partition, None, names)

    def close_partition(self, partition: str) -> None:
        """Declare that no new rows will be written to ``partition``."""
        self.connection.controller().close_partition(partition=partition)

    def set_version(self, partition: str, task: str, version: int) -> None:
        """Set the consumer's current policy version for staleness-aware samplers."""
        self.connection.controller().set_version(partition=partition, task=task, version=version)

    def set_tags(self, partition: str, keys: list[str], tags: list[dict[str, Any]]) -> None:
        """Merge ``tags[i]`` into the tags of existing row ``keys[i]`` (e.g. a reward or
        an advantage magnitude computed by a later stage, for samplers to read)."""
        self.connection.controller().set_tags(partition=partition, keys=list(keys), tags=tags)

    def set_admission(self, partition: str, task: str, steps_per_version: int) -> None:
        """How many steps ``task`` takes per policy version (for ``Writer.reserve``)."""
        self.connection.controller().set_admission(partition=partition, task=task,
                                         steps_per_version=steps_per_version)

    def stats(self) -> dict[str, PartitionStats]:
        """Per partition: rows, fields, writer waits, and per task its counters (handed
        out, acked, discarded by reason), rates, the oldest ready row's age and timing
        histograms. Every key is documented in ``tq_stream.stats``."""
        return self.connection.controller().stats()

    def deployment_stats(self, timeout: float = 2.0) -> DeploymentStats:
        """The servers of the deployment: the controller's process and RPC counts, and
        per storage unit whether it answered (within ``timeout`` seconds), the bytes it
        holds per partition and field, and its RPC counts. Read-only."""
        from tq_stream.connection.observe import deployment_stats

        return deployment_stats(self.connection, timeout)

    def processes(self) -> list[ProcessInfo]:
        """The processes of the deployment (controller first, then the units in order):
        pid, host, address and socket folder of each. Read-only.

        Examples:
            >>> [(p.role, p.index) for p in stream.processes()]
            [('controller', 0), ('unit', 0), ('unit', 1)]
        """
        from tq_stream.connection.observe import processes

        return processes(self.connection)

    @property
    def owner(self) -> Owner | None:
        """What this handle started and stops at ``close()``: the deployment of
        ``tq.init`` (in local and Ray mode it also restarts a server by hand:
        ``restart_unit(i)``, ``restart_controller()``), the sockets of ``tq.connect``,
        or None for a handle reopened in another process."""
        return self._owner

    @property
    def metrics_endpoint(self) -> str | None:
        """``"host:port"`` of the Prometheus endpoint this handle serves
        (``tq.init(..., metrics_port=N)``), or None."""
        return None if self._metrics is None else self._metrics.endpoint

    def save(self, path: str) -> None:
        """Checkpoint metadata and stored rows into the folder ``path``.

        Each storage unit writes its own rows there (``unit-<i>-<save>.tq``), the
        controller's metadata goes to ``controller.tq``; every file is checksummed,
        written atomically and private (0600). On several nodes ``path`` must be on
        storage every node sees (see ``tq_stream.deploy.snapshot``).
        """
        if self._owner is None:
            raise StateError("save must be called on the stream returned by tq.init")
        self._owner.save(path)

    def close(self) -> None:
        """Close this handle; the deployment's owner also stops what it started."""
        if self.connection.closed:
            return
        self.connection.close()
        if self._metrics is not None:
            self._metrics.close()
        if self._owner is not None:
            started = time.monotonic()
            self._owner.close()
            if self.mode != "remote":  # the owner's handle: the deployment stopped
                logger.info("stopped the deployment (%s mode%s) in %.2f s", self.mode,
                            f" at {self.address}" if self.address else "",
                            time.monotonic() - started)

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple[Any, ...]:
        # the connection reopens in the other process (an embedded one raises StateError)
        return Stream, (self.connection,)
