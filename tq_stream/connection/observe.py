"""Read-only views of a deployment: its processes and what each server reports.

Both work from any handle (the owner's or one from ``tq.connect``): they ask the
controller, which knows every unit's address, and each unit. A unit that does not
answer within ``timeout`` is reported down, never raised.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from tq_stream.stats import DeploymentStats, ProcessInfo, RpcStats, UnitStats

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


def processes(stream: Any) -> list[ProcessInfo]:
    """The controller (first), then every storage unit in index order."""
    from tq_stream.deploy.services import host_id

    if stream.mode == "embedded":
        here, pid = host_id(), os.getpid()
        n = len(stream._units())
        return [ProcessInfo("controller", 0, pid, here, None, None)] + [
            ProcessInfo("unit", i, pid, here, None, None) for i in range(n)]
    ctrl = stream._controller()
    ping = ctrl.ping()
    local = ping.get("local")
    out = [ProcessInfo("controller", 0, int(ping["pid"]), str(ping["host"]), stream.address,
                       _folder(local) or _folder(stream.address))]
    for i, u in enumerate(ctrl.units()):
        out.append(ProcessInfo("unit", i, int(u["pid"]), str(u["host"]), u["address"],
                               _folder(u.get("local")) or _folder(u["address"])))
    return out


def _unit_stats(i: int, unit: Any, timeout: float) -> UnitStats:
    try:
        raw = unit.stats(timeout) if _remote(unit) else {**unit.stats(), "pid": os.getpid(),
                                                          "rpc": _no_rpc()}
    except Exception as exc:  # down or unreachable: reported, never raised
        return {"unit": i, "up": False, "error": f"{type(exc).__name__}: {exc}", "pid": 0,
                "nbytes": 0, "partitions": {}, "rpc": _no_rpc()}
    return {"unit": i, "up": True, "error": "", "pid": int(raw["pid"]),
            "nbytes": int(raw["nbytes"]), "partitions": raw["partitions"], "rpc": raw["rpc"]}


def _remote(unit: Any) -> bool:
    from tq_stream.connection.proxies import RemoteUnit
    from tq_stream.connection.same_host import SameHostUnit

    return isinstance(unit, RemoteUnit | SameHostUnit)


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


def deployment_stats(stream: Any, timeout: float = UNIT_TIMEOUT) -> DeploymentStats:
    """The controller process and every unit (``tq_stream.stats.DeploymentStats``)."""
    ctrl = stream._controller()
    if stream.mode == "embedded":
        server: dict[str, Any] = {"pid": os.getpid(), "rpc": _no_rpc()}
    else:
        server = ctrl.server_stats(timeout)
    units = [_unit_stats(i, u, timeout) for i, u in enumerate(stream._units())]
    for u in units:
        _HEALTH.note(stream.address or "embedded", u)
    return {"mode": stream.mode, "controller": server, "units": units}  # type: ignore[typeddict-item]
