"""Connection: what the client layers are handed instead of the whole ``Stream``.

A ``Connection`` is one process's access to a deployment: its config, address and
CURVE key, the controller client, the storage-unit clients, this process's lease
heartbeat and spare rows, and the unit its writers prefer. ``Writer``, ``Client``,
``KV``, the datasets, ``compat`` and the observer take one; a ``Stream`` holds one.

It does not own the servers or their sockets: closing it makes later calls raise
``ClosedError`` and stops its heartbeat; the deployment's owner closes the sockets.
A connection to out-of-process servers pickles to their address (the receiving
process connects lazily, as a data-plane client: an owner's token never travels);
an embedded one refuses pickling, since its controller lives in this process.

Example:
    >>> conn = stream.connection
    >>> tq.Writer(conn, "train").put(["k"], {"x": torch.ones(1, 4)})
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tq_stream.config import StreamConfig
from tq_stream.errors import ClosedError
from tq_stream.leases import LeaseKeeper

if TYPE_CHECKING:
    from tq_stream.backends.base import StorageUnit
    from tq_stream.connection.protocols import Backend, ControllerAPI
    from tq_stream.connection.spares import SparePool

REOPENED_MODE = "remote"  # the mode of a connection reopened in another process


class Connection:
    """One process's access to a deployment (see module docstring).

    Args:
        backend: how the deployment is reached (``EmbeddedBackend``, ``RemoteBackend``).
        config: timeouts and lease defaults of this process's clients.
        mode: "embedded", "local", "ray", or "remote" (joined with ``tq.connect``, or
            reopened in another process).
    """

    def __init__(self, backend: Backend, config: StreamConfig, mode: str) -> None:
        self._backend = backend
        self.config = config
        self.mode = mode
        self._closed = False
        self._keeper: LeaseKeeper | None = None

    @property
    def address(self) -> str | None:
        """Where ``tq.connect`` reaches the deployment (None when embedded)."""
        return self._backend.address

    @property
    def curve_server_key(self) -> bytes | None:
        """The deployment's CURVE public key, which clients pass to ``tq.connect``."""
        return self._backend.curve_server_key

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def backend(self) -> Backend:
        """How the deployment is reached (``EmbeddedBackend``, ``RemoteBackend``)."""
        return self._backend

    def controller(self) -> ControllerAPI:
        """The controller (in process, or its RPC client)."""
        if self._closed:
            raise ClosedError("stream is closed")
        return self._backend.controller()

    def units(self) -> list[StorageUnit]:
        """The storage units, by index (in process, or their clients)."""
        if self._closed:
            raise ClosedError("stream is closed")
        return self._backend.units()

    def keeper(self) -> LeaseKeeper:
        """This process's heartbeat for the leases taken through this connection."""
        keeper = self._keeper
        if keeper is None or keeper.forked():  # new, or inherited by a fork
            keeper = self._keeper = LeaseKeeper(self.controller)
        return keeper

    def spares(self, partition: str, unit: int) -> SparePool | None:
        """This process's spare rows for puts to ``partition`` placed by ``unit`` (None:
        puts go through ``reserve``)."""
        return self._backend.spares(partition, unit)

    def preferred_unit(self) -> int:
        """The unit a writer uses by default: one on this host when only some are, else
        -1 (spread over all)."""
        return self._backend.preferred_unit()

    def close(self) -> None:
        """Refuse further calls and stop the heartbeat (the owner closes the sockets)."""
        self._closed = True
        if self._keeper is not None:
            self._keeper.stop()

    def __reduce__(self) -> tuple[Any, ...]:
        # the backend pickles to what reopens it, or raises StateError (embedded)
        return Connection, (self._backend, self.config, REOPENED_MODE)

    def __repr__(self) -> str:
        where = f" at {self.address}" if self.address else ""
        return f"Connection({self.mode}{where}{', closed' if self._closed else ''})"


__all__ = ["Connection"]
