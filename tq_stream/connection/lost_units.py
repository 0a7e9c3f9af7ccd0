"""LostUnits: tells a call waiting on a storage unit that the controller gave the unit up.

zmq does not tell a client that its server died: a read or a write to a unit whose
node left (nobody answers, no connection is refused) waits its whole timeout. The
controller knows sooner: its heartbeat declares a silent unit lost after
``unit_timeout`` seconds (its rows are dropped, counted ``unit_lost``), and a Ray
unit re-created elsewhere serves at a new address. So a unit call that waits asks,
through its transport's ``check_alive`` (every ``CHECK_INTERVAL`` seconds of waiting),
what the controller says of the units (one ``ping`` per ``INTERVAL`` for every unit
call of the process), and stops with ConnectionLost once its unit is lost or moved: a
reader then asks for its step again (it holds the surviving rows), a writer puts again
(on the live units).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from tq_stream.errors import ConnectionLost, WaitTimeout
from tq_stream.forksafe import ForkSafeLock
from tq_stream.messages.admin import Ping, UnitAddress

INTERVAL = 1.0  # seconds between two pings of the controller for waiting unit calls
PING_TIMEOUT = 5.0  # seconds such a ping may take (no answer: no news, the call waits on)


class LostUnits:
    """What the controller last said of the units: which are lost, where each serves.

    Args:
        ping: the controller's ``ping(timeout)`` (``dead_units``, ``units_epoch``).
        units: the controller's unit address records (asked when the epoch changed).
        check_owner: raises when nothing serves the deployment again (``OwnerWatch``).
        interval: seconds between two pings (the news in between is the last ping's).
    """

    def __init__(self, ping: Callable[[float], Ping],
                 units: Callable[[], Sequence[UnitAddress]],
                 check_owner: Callable[[], None], interval: float = INTERVAL) -> None:
        self._ping = ping
        self._interval = interval
        self._units = units
        self._check_owner = check_owner
        self._lock = ForkSafeLock()  # one ping at a time; the other calls read its news
        self._asked = float("-inf")
        self._dead: frozenset[int] = frozenset()
        self._epoch: int | None = None
        self._where: list[tuple[str, str | None]] = []  # per unit: (address, local)

    def check(self, unit: int, address: str) -> None:
        """Raise ConnectionLost if the controller declared ``unit`` lost, or serves it at
        another address than ``address`` (DeploymentGone if the deployment is gone)."""
        self._check_owner()
        self._refresh()
        if unit in self._dead:
            raise ConnectionLost(
                f"storage unit {unit} at {address} stopped answering: the controller "
                f"declared it lost (no heartbeat for its unit_timeout) and counts its rows "
                f"'unit_lost'; the call was given up")
        where = self._where
        if unit < len(where) and address not in where[unit]:
            raise ConnectionLost(f"storage unit {unit} no longer serves at {address} (it "
                                 f"was re-created at {where[unit][0]}); the call was given up")

    def _refresh(self) -> None:
        if time.monotonic() - self._asked < self._interval or \
                not self._lock.acquire(blocking=False):
            return
        try:
            self._asked = time.monotonic()
            try:
                info = self._ping(PING_TIMEOUT)
                epoch = info.units_epoch
                if epoch != self._epoch:
                    self._where = [(u.address, u.local) for u in self._units()]
                    self._epoch = epoch
            except WaitTimeout:
                return  # the controller is slow or restarting: no news
            self._dead = frozenset(int(u) for u in info.dead_units)
        finally:
            self._lock.release()
