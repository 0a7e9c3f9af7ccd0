"""The controller's media calls (``media_hold``, ``media_release``, ``media_lookup``):
arguments checked, ``MediaPins`` run under the controller's lock, entries that no
pin holds and no row names freed through the controller's row removal.

Pins of sessions that stopped renewing end lazily: at every media call, and
wherever the controller aborts a dead producer's reservations (``expire``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from tq_stream.checks import check_keys
from tq_stream.controller.consuming import check_session
from tq_stream.controller.media_pins import MediaPins
from tq_stream.controller.partition import PartitionMeta
from tq_stream.errors import ConfigError, check_timeout

PartOf = Callable[[str], PartitionMeta]
FreeRows = Callable[[PartitionMeta, np.ndarray], None]  # remove rows, free their slots


def _check_holder(session: object, holder: object) -> tuple[str, str]:
    session_ = check_session("session", session)
    if not session_:
        raise ConfigError("session must be a non-empty str to hold media, got ''")
    if not isinstance(holder, str) or len(holder) > 200:
        raise ConfigError(f"holder must be a str of at most 200 chars, got {holder!r:.80}")
    return session_, holder or session_[:12]


class MediaCalls:
    """What the controller's media methods do (see module doc)."""

    def __init__(self, lock: threading.Condition,
                 parts: Callable[[], Mapping[str, PartitionMeta]], part_of: PartOf,
                 made_by_put: PartOf, free_rows: FreeRows) -> None:
        self._lock = lock
        self._parts = parts
        self._part_of = part_of
        self._made_by_put = made_by_put  # the partition, created as a put creates it
        self._free_rows = free_rows
        self.pins = MediaPins()

    def hold(self, partition: str, keys: Sequence[str], session: str, holder: str,
             lease: float, producer: bool, pending: float = 0.0,
             pins: Sequence[str] | None = None) -> dict[str, Any]:
        """Pins of ``session`` on the entries ``keys``: ``{"deployment", "pins": [{"key",
        "pin", "index", "generation", "fields"}]}``. ``pending`` (seconds a put may take):
        pins taken before the put, ``{"pending": [pin, ...]}``, which a second call with
        ``pins`` makes these pins (``MediaPins.pend``)."""
        keys_ = check_keys(list(keys))
        session_, holder_ = _check_holder(session, holder)
        lease_ = check_timeout("lease", lease)
        with self._lock:
            self.expire()
            part = (self._made_by_put if pending else self._part_of)(partition)
            if pending:
                put = check_timeout("pending", pending)
                return {"pending": self.pins.pend(part, keys_, session_, holder_, lease_,
                                                  put, time.time())}
            out = self.pins.hold(part, keys_, session_, holder_, lease_, bool(producer),
                                 time.time(), None if pins is None else list(pins))
            return {"deployment": self.pins.deployment, "pins": out}

    def release(self, partition: str, pin: str, session: str, holder: str) -> None:
        session_, holder_ = _check_holder(session, holder)
        if not isinstance(pin, str) or not pin:
            raise ConfigError(f"pin must be a non-empty str, got {pin!r:.80}")
        with self._lock:
            self.expire()
            part = self._part_of(partition)
            rows = self.pins.release(part, pin, session_, holder_)
            if rows:
                self._free_rows(part, np.asarray(rows, dtype=np.int64))

    def lookup(self, partition: str, key: str, index: int, generation: int, pin: str,
               deployment: str, fields: Sequence[str]) -> dict[str, Any]:
        if not isinstance(fields, list | tuple) or not fields or \
                not all(isinstance(f, str) for f in fields):
            raise ConfigError(f"fields must be a non-empty list of str, got {fields!r:.80}")
        with self._lock:
            self.expire()
            return self.pins.lookup(self._part_of(partition), key, int(index),
                                    int(generation), pin, deployment, list(fields))

    def renew(self, partition: str, session: str) -> int:
        """Lock held: the producer heartbeat of ``session`` renews its pins too."""
        return self.pins.renew(partition, session, time.time())

    def expire(self) -> int:
        """Lock held: end the pins due and free what nothing holds; how many entries."""
        if self.pins.soonest() > time.time():
            return 0
        freed = 0
        for part, rows in self.pins.expire(self._parts(), time.time()):
            self._free_rows(part, np.asarray(rows, dtype=np.int64))
            freed += len(rows)
        return freed

    def stats(self, part: PartitionMeta) -> dict[str, Any]:
        return self.pins.stats(part, time.time())


__all__ = ["MediaCalls"]
