"""UnitWatch: the controller's heartbeat to its storage units.

A daemon thread in the controller's process pings every attached unit every
``timeout / 4`` seconds. A unit that has not answered for ``timeout`` seconds
(its process died, its node left, a connection that is refused or hangs) is
declared lost (``Controller.unit_lost``: its rows are dropped, counted
``unit_lost``, no new rows go there), unless it runs on this host and its
process is still alive: a unit that is only slow (a loaded machine) keeps its
rows. A unit that answers with another pid than before was replaced at the same
address (restarted by the local owner; Ray units, started with ``max_restarts=0``,
are re-created by the driver at a new address instead): its old
rows are dropped if that has not happened yet, and it takes new rows again
(``Controller.unit_back``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from tq_stream.errors import check_timeout
from tq_stream.messages import unit as um
from tq_stream.messages.rpc import Rpc

DEFAULT_UNIT_TIMEOUT = 10.0  # seconds without an answer before a unit is lost
logger = logging.getLogger(__name__)


class Pinged(Protocol):
    """A unit's client, as the watch pings it (``UnitClient``)."""

    def call(self, rpc: Rpc[um.Nothing, um.UnitPing], request: um.Nothing,
             timeout: float | None = None) -> um.UnitPing: ...


class Watcher(Protocol):
    """What the watch tells of units (``ControllerService``)."""

    def unit_may_be_dead(self, unit: int) -> bool: ...

    def unit_lost(self, unit: int) -> object: ...

    def unit_answered(self, unit: int, pid: int) -> None: ...


class UnitWatch:
    """Pings ``clients()`` (one RPC client per unit) from a daemon thread.

    Args:
        service: the ControllerService (``unit_lost``, ``unit_back``, ``_unit_pid``).
        clients: returns the current unit clients (re-read each round: units may be
            re-attached).
        timeout: seconds without an answer before a unit is declared lost.
    """

    def __init__(self, service: Watcher, clients: Callable[[], Sequence[Pinged]],
                 timeout: float = DEFAULT_UNIT_TIMEOUT) -> None:
        self.timeout = check_timeout("unit_timeout", timeout)
        self._service = service
        self._clients = clients
        self._stop = threading.Event()
        self._last_ok: dict[int, float] = {}
        self._silent: set[int] = set()  # units whose last ping failed
        self._lost: set[int] = set()  # units declared lost and silent since (logged once)
        # Per unit: bumped when a new process serves it, so a ping of the old one that
        # fails afterwards does not make the new one silent.
        self._serving: dict[int, int] = {}
        self._thread = threading.Thread(target=self._run, daemon=True, name="tq-unit-watch")
        self._thread.start()

    def _run(self) -> None:
        interval = self.timeout / 4
        while not self._stop.wait(interval):
            clients = self._clients()
            for i, client in enumerate(clients):
                if self._stop.is_set():
                    return
                self._check(i, client, interval)

    def _check(self, unit: int, client: Pinged, interval: float) -> None:
        now = time.monotonic()
        last = self._last_ok.setdefault(unit, now)
        serving = self._serving.get(unit, 0)
        try:
            info = client.call(um.PING, um.Nothing(), timeout=max(0.05, min(interval, 2.0)))
        except Exception as exc:  # noqa: BLE001 — any failure is a missed heartbeat
            if self._serving.get(unit, 0) != serving:
                return  # the old process missed it; a new one serves since
            self._silent.add(unit)
            if unit not in self._lost and now - last >= self.timeout and \
                    self._service.unit_may_be_dead(unit):
                logger.warning("storage unit %d did not answer for %.1f s (%s)", unit,
                               now - last, exc)
                try:
                    self._service.unit_lost(unit)
                    self._lost.add(unit)  # once per outage: it stays lost until it answers
                except Exception:  # a closed controller: the loop ends soon
                    logger.debug("marking unit %d lost failed", unit, exc_info=True)
            return
        self._last_ok[unit] = time.monotonic()
        self._silent.discard(unit)
        self._lost.discard(unit)
        try:
            self._service.unit_answered(unit, info.pid)
        except Exception:
            logger.debug("recording unit %d's answer failed", unit, exc_info=True)

    def replaced(self, unit: int) -> None:
        """A new process serves ``unit`` (at the same address or a new one): its
        silence so far was the old one's, and a silence of its own is a new outage
        (declared lost again, even before the watch heard from it)."""
        self._serving[unit] = self._serving.get(unit, 0) + 1
        self._last_ok.pop(unit, None)
        self._silent.discard(unit)
        self._lost.discard(unit)

    def silent(self, unit: int) -> bool:
        """True if ``unit`` did not answer its last ping."""
        return unit in self._silent

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)


def process_alive(pid: int) -> bool:
    """True if process ``pid`` of this host runs (a zombie counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False
