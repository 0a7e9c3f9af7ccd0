"""Read-only views of a deployment: its processes and what each server reports.

Both work from any connection (the owner's or one from ``tq.connect``): they ask the
controller, which knows every unit's address, and each unit. A unit that does not
answer within ``timeout`` is reported down, never raised.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from tq_stream import hosts
from tq_stream.errors import StateError
from tq_stream.stats import DeploymentStats, ProcessInfo, RpcStats, UnitStats

if TYPE_CHECKING:
    from tq_stream.backends.base import StorageUnit
    from tq_stream.connection.connection import Connection
    from tq_stream.connection.proxies import RemoteController

logger = logging.getLogger(__name__)

UNIT_TIMEOUT = 2.0  # seconds a unit's stats call may take before it counts as down


def _no_rpc() -> RpcStats:
    """The RPC counts of a server that served none (embedded mode, a unit down)."""
    return {"calls": {}, "errors": {}}


def _folder(address: str | None) -> str | None:
    for scheme in ("unix://", "ipc://"):
        if address and address.startswith(scheme):
            return os.path.dirname(address[len(scheme):])
    return None


def _served(conn: Connection) -> RemoteController:
    """The client of the controller server of an out-of-process deployment."""
    from tq_stream.connection.proxies import RemoteController

    ctrl = conn.controller()
    if not isinstance(ctrl, RemoteController):
        raise StateError(f"a {conn.mode} connection must reach its controller over RPC, "
                         f"got {type(ctrl).__name__}")
    return ctrl


def processes(conn: Connection) -> list[ProcessInfo]:
    """The controller (first), then every storage unit in index order."""
    if conn.mode == "embedded":
        here, pid = hosts.host_id(), os.getpid()
        n = len(conn.units())
        return [ProcessInfo("controller", 0, pid, here, None, None)] + [
            ProcessInfo("unit", i, pid, here, None, None) for i in range(n)]
    ctrl = _served(conn)
    ping = ctrl.ping()
    out = [ProcessInfo("controller", 0, ping.pid, ping.host, conn.address,
                       _folder(ping.local) or _folder(conn.address))]
    for i, u in enumerate(ctrl.units()):
        out.append(ProcessInfo("unit", i, u.pid, u.host, u.address,
                               _folder(u.local) or _folder(u.address)))
    return out


def _unit_stats(i: int, unit: StorageUnit, timeout: float) -> UnitStats:
    from tq_stream.connection.remote_unit import RemoteUnit
    from tq_stream.connection.same_host import SameHostUnit

    try:
        raw = unit.stats(timeout) if isinstance(unit, RemoteUnit | SameHostUnit) else \
            {**unit.stats(), "pid": os.getpid(), "rpc": _no_rpc()}
    except Exception as exc:  # down or unreachable: reported, never raised
        return {"unit": i, "up": False, "error": f"{type(exc).__name__}: {exc}", "pid": 0,
                "nbytes": 0, "partitions": {}, "rpc": _no_rpc()}
    return {"unit": i, "up": True, "error": "", "pid": int(raw["pid"]),
            "nbytes": int(raw["nbytes"]), "partitions": raw["partitions"], "rpc": raw["rpc"]}


class _UnitHealth:
    """Logs a unit going down (WARNING) and coming back (INFO), once per change."""

    def __init__(self) -> None:
        self.up: dict[tuple[str, int], bool] = {}

    def note(self, where: str, stats: UnitStats) -> None:
        key = (where, stats["unit"])
        was = self.up.get(key, True)
        self.up[key] = stats["up"]
        if was and not stats["up"]:
            logger.warning("storage unit %d of the deployment at %s is down: %s",
                           stats["unit"], where, stats["error"])
        elif not was and stats["up"]:
            logger.info("storage unit %d of the deployment at %s is up again",
                        stats["unit"], where)


_HEALTH = _UnitHealth()


def deployment_stats(conn: Connection, timeout: float = UNIT_TIMEOUT) -> DeploymentStats:
    """The controller process and every unit (``tq_stream.stats.DeploymentStats``)."""
    if conn.mode == "embedded":
        conn.controller()  # a closed connection raises ClosedError
        server: dict[str, Any] = {"pid": os.getpid(), "rpc": _no_rpc()}
    else:
        server = _served(conn).server_stats(timeout)
    units = [_unit_stats(i, u, timeout) for i, u in enumerate(conn.units())]
    for u in units:
        _HEALTH.note(conn.address or "embedded", u)
    return {"mode": conn.mode, "controller": server, "units": units}  # type: ignore[typeddict-item]
