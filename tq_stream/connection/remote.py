"""Out-of-process deployments, the client side: ``RemoteBackend`` and ``open_backend``.

A ``RemoteBackend`` is what a ``Connection`` to a local or Ray deployment holds in
every process: the controller's address plus lazily made RPC clients (so it pickles
to the address alone and rebuilds sockets after a fork). Storage-unit clients read
same-host dense fields straight from shared memory (``SameHostUnit``).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tq_stream import hosts
from tq_stream.config import StreamConfig
from tq_stream.connection.lost_units import LostUnits
from tq_stream.connection.owner_watch import OwnerWatch, check_folder
from tq_stream.errors import ConfigError
from tq_stream.forksafe import ForkSafeLock
from tq_stream.messages.admin import PING, UnitAddress
from tq_stream.messages.reads import Nothing

if TYPE_CHECKING:
    from tq_stream.backends.base import StorageUnit
    from tq_stream.connection.proxies import RemoteController
    from tq_stream.connection.spares import SparePool
    from tq_stream.transport.base import Transport

SPARE_RELEASE_TIMEOUT = 2.0  # seconds closing a stream waits to return its spare rows
# Seconds a call keeps trying a storage unit that does not accept connections (a local
# unit restarts at its address within this; a dead one fails the call here instead of
# after the whole timeout, and a writer's put then goes to the live units).
UNIT_CONNECT_WINDOW = 3.0
HANDSHAKE_WINDOW = 5.0  # seconds connect waits to learn whether its CURVE key is accepted


class RemoteBackend:
    """Connections of one process to a running deployment (a ``Backend``).

    Pickles to the address, config, CURVE key and owner record: never the owner's
    token, so a handle reopened elsewhere is a data-plane client.
    """

    def __init__(self, address: str, config: StreamConfig,
                 curve_server_key: bytes | None = None, owner_token: str | None = None,
                 owner: dict[str, Any] | None = None) -> None:
        if not isinstance(address, str) or "://" not in address:
            raise ConfigError(f"address must be a zmq endpoint like 'tcp://127.0.0.1:5555', "
                              f"got {address!r}")
        self.address = address
        self._config = config
        self._curve = curve_server_key
        self._owner_token = owner_token  # never pickled: other processes are not the owner
        # Calls stop waiting once the owner (who alone restarts the servers) is gone.
        self.owner_watch = OwnerWatch(address, owner)
        # A unit call that waits stops once the controller gave its unit up.
        self._lost = LostUnits(lambda timeout: self.controller().ping(timeout),
                               lambda: self.controller().units(), self.owner_watch.check)
        self._lock = ForkSafeLock()  # a producer thread may hold it when a worker forks
        self._ctrl: RemoteController | None = None
        self._units: list[StorageUnit] | None = None
        self._unit_infos: list[UnitAddress] = []  # the addresses _units were made for
        self._retired: list[StorageUnit] = []  # clients of units that moved, closed with this
        self._unit_hosts: list[bool] | None = None  # per unit: on this host?
        self._spares: dict[tuple[str, int], SparePool] = {}  # this process's SparePools
        self._spares_pid = os.getpid()

    @property
    def curve_server_key(self) -> bytes | None:
        return self._curve

    def _rpc(self, address: str, connect_window: float | None = None,
             check_alive: Callable[[], None] | None = None) -> Transport:
        from tq_stream.transport.rpc import rpc_client

        return rpc_client(address, timeout=self._config.timeout, curve_server_key=self._curve,
                          connect_window=connect_window,
                          check_alive=check_alive or self.owner_watch.check)

    def controller(self) -> RemoteController:
        if self._ctrl is None:
            from tq_stream.connection.proxies import RemoteController

            with self._lock:
                if self._ctrl is None:
                    self._ctrl = RemoteController(self._nearest_controller(),
                                                  self._config.timeout, self._owner_token,
                                                  on_units_moved=self._units_moved)
        return self._ctrl

    def _nearest_controller(self) -> Transport:
        """A client of the controller: at its unix address when it runs on this host and
        has one (Ray mode; local mode's address is one already), else at ``address``."""
        rpc = self._rpc(self.address)
        if self.address.startswith("unix://") or self._curve is not None:
            return rpc
        info = PING.decode(rpc.call(PING.name, PING.args(Nothing())))
        self.owner_watch.learn(info.owner)
        local = hosts.nearest_of(self.address, info.local, info.host)
        if local == self.address:
            return rpc
        rpc.close()
        return self._rpc(local)

    def units(self) -> list[StorageUnit]:
        if self._units is None:
            infos = self.controller().units()
            with self._lock:
                if self._units is None:
                    self._units = [self._unit_client(i, info) for i, info in enumerate(infos)]
                    self._unit_infos = list(infos)
        return self._units

    def _unit_client(self, i: int, info: UnitAddress) -> StorageUnit:
        from tq_stream.connection.remote_unit import RemoteUnit
        from tq_stream.connection.same_host import SameHostUnit

        address = info.address if self._curve is not None else \
            hosts.nearest_of(info.address, info.local, info.host)
        rpc = self._rpc(address, UNIT_CONNECT_WINDOW, lambda: self._lost.check(i, address))
        unit = RemoteUnit(rpc, self._config.timeout, self._owner_token)
        return SameHostUnit(unit) if info.host == hosts.host_id() else unit

    def _units_moved(self) -> None:
        """The controller's units changed address (a Ray unit actor re-created): new
        clients for the units that moved; the others keep theirs. Clients of the old
        addresses are closed with this backend (a call may still be using one)."""
        if self._units is None:
            self._unit_hosts = None
            return
        infos = self.controller().units()
        with self._lock:
            if self._units is None:
                return
            units = list(self._units)
            for i, info in enumerate(infos):
                old = self._unit_infos[i] if i < len(self._unit_infos) else None
                if old is None or (old.address, old.local) != (info.address, info.local):
                    self._retired.append(units[i])
                    units[i] = self._unit_client(i, info)
            self._units, self._unit_infos, self._unit_hosts = units, list(infos), None

    def spares(self, partition: str, unit: int) -> SparePool:
        """The SparePool of this process for puts to ``partition`` placed by ``unit``."""
        pool = self._spares.get((partition, unit))
        if pool is None or self._spares_pid != os.getpid():
            from tq_stream.connection.spares import SparePool

            with self._lock:
                if self._spares_pid != os.getpid():  # forked: the parent's rows are not ours
                    self._spares, self._spares_pid = {}, os.getpid()
                pool = self._spares.setdefault((partition, unit), SparePool(partition, unit))
        return pool

    def release_spares(self) -> None:
        """Give this process's spare rows back to the controller (best effort)."""
        if self._spares_pid != os.getpid() or self._ctrl is None:
            return
        for pool in list(self._spares.values()):
            rows = pool.drain()
            if len(rows["index"]):
                try:
                    self._ctrl.release_spares(pool.partition, rows["index"],
                                              rows["generation"], timeout=SPARE_RELEASE_TIMEOUT)
                except Exception:  # the controller is gone: so are its spare rows
                    return

    def preferred_unit(self) -> int:
        """A unit on this host for writers to use, or -1 (spread over all units) when
        every unit is on this host or none is. Units keep their host until one moves
        (a Ray unit re-created on another node), so this asks the controller once per
        process and move, not once per writer (``kv.put`` makes a writer per call)."""
        if self._unit_hosts is None:
            here = hosts.host_id()
            self._unit_hosts = [u.host == here for u in self.controller().units()]
        same = [i for i, local in enumerate(self._unit_hosts) if local]
        if not same or len(same) == len(self._unit_hosts):
            return -1
        return random.choice(same)

    def __reduce__(self) -> tuple[Any, ...]:
        return RemoteBackend, (self.address, self._config, self._curve, None,
                               self.owner_watch.owner)

    def close(self) -> None:
        self.release_spares()
        for u in [*(self._units or []), *self._retired]:
            u.close()
        if self._ctrl is not None:
            self._ctrl.close()


def open_backend(address: str, config: StreamConfig,
                 curve_server_key: bytes | None = None) -> RemoteBackend:
    """A backend on the deployment whose controller serves at ``address``, checked to
    answer (``tq.connect``).

    Raises:
        DeploymentGone: ``address`` is a unix socket whose folder is gone.
        ConfigError: the server refused the CURVE handshake with ``curve_server_key``
            (another key, or a key where none is used, or none where one is).
    """
    backend = RemoteBackend(address, config, curve_server_key)
    check_folder(backend.address)
    if not address.startswith("unix://"):
        from tq_stream.transport.zmq_handshake import check_handshake

        check_handshake(address, curve_server_key, min(config.timeout, HANDSHAKE_WINDOW))
    backend.owner_watch.learn(backend.controller().ping().owner)
    return backend
