"""Out-of-process deployments: the client side (``connect``) and ``init`` for local/ray.

A ``RemoteBackend`` is what a Stream holds in every process: the controller's
address plus lazily made RPC clients (so it pickles to the address alone and
rebuilds sockets after a fork). Storage-unit clients read same-host dense
fields straight from shared memory (``RemoteUnit`` + ``ShmReader``).
"""

from __future__ import annotations

import inspect
import os
import random
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from tq_stream.config import StreamConfig
from tq_stream.deploy.lost_units import LostUnits
from tq_stream.deploy.owner_watch import OwnerWatch, check_folder
from tq_stream.errors import ConfigError
from tq_stream.forksafe import ForkSafeLock
from tq_stream.stream import Stream

SPARE_RELEASE_TIMEOUT = 2.0  # seconds closing a stream waits to return its spare rows
# Seconds a call keeps trying a storage unit that does not accept connections (a local
# unit restarts at its address within this; a dead one fails the call here instead of
# after the whole timeout, and a writer's put then goes to the live units).
UNIT_CONNECT_WINDOW = 3.0
HANDSHAKE_WINDOW = 5.0  # seconds connect waits to learn whether its CURVE key is accepted


class RemoteBackend:
    """Connections of one process to a running deployment."""

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
        self._ctrl: Any = None
        self._units: list[Any] | None = None
        self._unit_infos: list[dict[str, Any]] = []  # the addresses _units were made for
        self._retired: list[Any] = []  # clients of units that moved, closed with this
        self._unit_hosts: list[bool] | None = None  # per unit: on this host?
        self._spares: dict[tuple[str, int], Any] = {}  # this process's SparePools
        self._spares_pid = os.getpid()

    def _rpc(self, address: str, connect_window: float | None = None,
             check_alive: Callable[[], None] | None = None) -> Any:
        from tq_stream.transport.rpc import rpc_client

        return rpc_client(address, timeout=self._config.timeout, curve_server_key=self._curve,
                          connect_window=connect_window,
                          check_alive=check_alive or self.owner_watch.check)

    def controller(self) -> Any:
        if self._ctrl is None:
            from tq_stream.deploy.proxies import RemoteController

            with self._lock:
                if self._ctrl is None:
                    self._ctrl = RemoteController(self._nearest_controller(),
                                                  self._config.timeout, self._owner_token,
                                                  on_units_moved=self._units_moved)
        return self._ctrl

    def _nearest_controller(self) -> Any:
        """A client of the controller: at its unix address when it runs on this host and
        has one (Ray mode; local mode's address is one already), else at ``address``."""
        rpc = self._rpc(self.address)
        if self.address.startswith("unix://") or self._curve is not None:
            return rpc
        from tq_stream.deploy.services import nearest

        info = rpc.call("ping", {})
        self.owner_watch.learn(info.get("owner"))
        local = nearest({"address": self.address, **info})
        if local == self.address:
            return rpc
        rpc.close()
        return self._rpc(local)

    def units(self) -> list[Any]:
        if self._units is None:
            infos = self.controller().units()
            with self._lock:
                if self._units is None:
                    self._units = [self._unit_client(i, info) for i, info in enumerate(infos)]
                    self._unit_infos = list(infos)
        return self._units

    def _unit_client(self, i: int, info: dict[str, Any]) -> Any:
        from tq_stream.deploy.local_read import SameHostUnit
        from tq_stream.deploy.proxies import RemoteUnit
        from tq_stream.deploy.services import host_id, nearest

        address = info["address"] if self._curve is not None else nearest(info)
        rpc = self._rpc(address, UNIT_CONNECT_WINDOW, lambda: self._lost.check(i, address))
        unit = RemoteUnit(rpc, self._config.timeout, self._owner_token)
        return SameHostUnit(unit) if info["host"] == host_id() else unit

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
                if old is None or (old["address"], old.get("local")) != \
                        (info["address"], info.get("local")):
                    self._retired.append(units[i])
                    units[i] = self._unit_client(i, info)
            self._units, self._unit_infos, self._unit_hosts = units, list(infos), None

    def spares(self, partition: str, unit: int) -> Any:
        """The SparePool of this process for puts to ``partition`` placed by ``unit``."""
        pool = self._spares.get((partition, unit))
        if pool is None or self._spares_pid != os.getpid():
            from tq_stream.spares import SparePool

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
            from tq_stream.deploy.services import host_id

            here = host_id()
            self._unit_hosts = [u["host"] == here for u in self.controller().units()]
        same = [i for i, local in enumerate(self._unit_hosts) if local]
        if not same or len(same) == len(self._unit_hosts):
            return -1
        return random.choice(same)

    def reduce_stream(self, config: StreamConfig) -> tuple[Any, tuple]:
        return _rebuild, (self.address, config, self._curve, self.owner_watch.owner)

    def close(self) -> None:
        self.release_spares()
        for u in [*(self._units or []), *self._retired]:
            u.close()
        if self._ctrl is not None:
            self._ctrl.close()


def _rebuild(address: str, config: StreamConfig, curve: bytes | None,
             owner: dict[str, Any] | None = None) -> Stream:
    return Stream(RemoteBackend(address, config, curve, owner=owner), config, "remote")


def connect(address: str, config: StreamConfig, curve_server_key: bytes | None = None,
            own_lease: bool = False) -> Stream:
    """A Stream on the deployment whose controller serves at ``address``: its
    ``lease_timeout`` is the deployment owner's (``tq.init(lease_timeout=)``) unless
    ``own_lease`` (the caller chose one).

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
    owner = backend.controller().ping().get("owner")
    backend.owner_watch.learn(owner)
    lease = (owner or {}).get("lease_timeout")
    if not own_lease and isinstance(lease, int | float) and lease > 0:
        config = replace(config, lease_timeout=float(lease))
    return Stream(backend, config, "remote", owner=_ConnectionOwner(backend))


class _ConnectionOwner:
    """Closing a connected handle closes its sockets only, never the deployment."""

    def __init__(self, backend: RemoteBackend) -> None:
        self._backend = backend

    def save(self, path: str) -> None:
        from tq_stream.deploy import snapshot

        snapshot.save(path, self._backend.controller(), self._backend.units())

    def close(self) -> None:
        self._backend.close()


def start(mode: str, n_units: int, restore: str | None, config: StreamConfig,
          **options: Any) -> Stream:
    """Start a local or Ray deployment; the returned Stream owns it."""
    if mode == "local":
        from tq_stream.deploy.local import LocalDeployment as cls
    else:
        from tq_stream.deploy.ray_deploy import RayDeployment as cls  # type: ignore[assignment]
    known = set(inspect.signature(cls).parameters) - {"n_units", "lease_timeout"}
    unknown = sorted(set(options) - known)
    if unknown:  # before anything starts, naming what the mode takes
        raise ConfigError(f"options of mode {mode!r} must be among {sorted(known)}, got "
                          f"{unknown} (storage_units, restore, config and metrics_port "
                          f"are tq.init's own)")
    owner: Any = cls(n_units, lease_timeout=config.lease_timeout, **options)
    try:
        backend = RemoteBackend(owner.address, config, owner.curve_server_key,
                                owner.owner_token, owner.owner)
        owner.attach(backend)
        if restore is not None:
            from tq_stream.deploy import snapshot

            snapshot.restore(restore, backend.controller(), backend.units())
    except BaseException:
        owner.close()
        raise
    return Stream(backend, config, mode, owner=owner)
