"""LeaseKeeper: the heartbeat that keeps a process's leases alive.

A lease lasts ``lease_timeout`` seconds unless renewed. Every consumer session
(a loader iteration, a DataLoader worker's part of it, a low-level client) takes
a ``Hold`` on ``(partition, task, session)``; one daemon thread per process and
stream renews every held session in one call each, ``RENEWALS_PER_LEASE`` times
per lease. So a lease outlives any slow training step and expires only when its
process dies (or drops every Hold on it): a dead consumer's rows come back
within ``lease_timeout`` seconds.

A Hold is released by ``close()`` or when it is garbage-collected, so a loader
that is simply dropped stops renewing too.

Producers have sessions too (``producer_session``): one per process, stream and
partition, held for the stream's life; its heartbeat keeps the rows its puts
reserved and have not committed yet (``controller/reservations.py``), so a
producer killed in the middle of a put frees them within its lease.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
import weakref
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

RENEWALS_PER_LEASE = 4
MIN_INTERVAL = 0.05  # seconds between two heartbeats at the least
MAX_INTERVAL = 30.0


class Hold:
    """Keeps ``session``'s leases on ``(partition, task)`` alive until closed."""

    def __init__(self, keeper: LeaseKeeper, partition: str, task: str, session: str,
                 lease_timeout: float) -> None:
        self.keeper = keeper
        self.key = (partition, task, session)
        self.interval = MAX_INTERVAL
        self.closed = False
        self.set_lease(lease_timeout)

    def set_lease(self, lease_timeout: float) -> None:
        """The task's lease is ``lease_timeout`` seconds: renew often enough for it."""
        interval = min(MAX_INTERVAL, max(MIN_INTERVAL, lease_timeout / RENEWALS_PER_LEASE))
        if interval < self.interval:
            self.interval = interval
            self.keeper.wake()  # the heartbeat adopts the shorter interval now

    def close(self) -> None:
        self.closed = True


class LeaseKeeper:
    """One heartbeat thread renewing the sessions of live Holds (see module doc).

    Args:
        controller: returns the controller to call ``renew`` on.
    """

    def __init__(self, controller: Callable[[], Any]) -> None:
        self._controller = controller
        self._holds: weakref.WeakSet[Hold] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._changed = threading.Event()  # a hold's interval shrank, or stop()
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._producers: dict[str, Hold] = {}  # partition -> this process's producer hold
        self._producer_id = uuid.uuid4().hex

    def producer_session(self, partition: str, lease_timeout: float) -> str:
        """This process's producer session on ``partition``, renewed from now on with
        the controller's producer heartbeat (``renew(task="")``)."""
        with self._lock:
            h = self._producers.get(partition)
        if h is None:
            h = self.hold(partition, "", f"w-{self._producer_id}", lease_timeout)
            with self._lock:
                h = self._producers.setdefault(partition, h)
        return h.key[2]

    def hold(self, partition: str, task: str, session: str, lease_timeout: float) -> Hold:
        """Start renewing ``session``'s leases on ``(partition, task)``."""
        h = Hold(self, partition, task, session, lease_timeout)
        with self._lock:
            self._holds.add(h)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="tq-lease-keeper")
                self._thread.start()
        return h

    def forked(self) -> bool:
        """True in a process forked after this keeper was made (its thread is not here)."""
        return self._pid != os.getpid()

    def wake(self) -> None:
        """Have the heartbeat thread look at its holds' intervals again now."""
        self._changed.set()

    def renew_now(self) -> None:
        """Renew every held session at once (also what the thread does)."""
        with self._lock:
            holds = [h for h in self._holds if not h.closed]
        for key in dict.fromkeys(h.key for h in holds):
            partition, task, session = key
            try:
                self._controller().renew(partition=partition, task=task, session=session)
            except Exception as exc:  # the next heartbeat tries again
                logger.debug("renewing leases of %s failed: %s", key, exc)

    def _run(self) -> None:
        while not self._stopped:
            # only the interval: a list of the Holds kept across the wait would keep
            # every Hold alive (each new list is built while the last one holds them),
            # so a dropped client would renew its leases for good
            with self._lock:
                interval = min((h.interval for h in self._holds if not h.closed),
                               default=None)
                if interval is None:
                    self._thread = None
                    return
            if self._changed.wait(interval):
                self._changed.clear()
            if self._stopped or os.getpid() != self._pid:
                return
            self.renew_now()

    def stop(self) -> None:
        self._stopped = True
        self._changed.set()
