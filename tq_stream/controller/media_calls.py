"""The controller's media calls (``media_hold``, ``media_release``, ``media_lookup``):
arguments checked, the book's ``MediaPins`` run under its lock, entries that no pin
holds and no row names freed through the book's row removal.

Pins of sessions that stopped renewing end lazily: at every media call, and
wherever the controller aborts a dead producer's reservations
(``Book.abort_reservations`` → ``Book.expire_pins``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tq_stream.checks import check_keys
from tq_stream.controller.book import Book
from tq_stream.controller.consuming import check_session
from tq_stream.controller.partition import PartitionMeta
from tq_stream.errors import ConfigError, check_timeout
from tq_stream.messages.media import MediaHeld, MediaPlace


def _check_holder(session: object, holder: object) -> tuple[str, str]:
    session_ = check_session("session", session)
    if not session_:
        raise ConfigError("session must be a non-empty str to hold media, got ''")
    if not isinstance(holder, str) or len(holder) > 200:
        raise ConfigError(f"holder must be a str of at most 200 chars, got {holder!r:.80}")
    return session_, holder or session_[:12]


class MediaCalls:
    """What the controller's media methods do (see module doc)."""

    def __init__(self, book: Book) -> None:
        self._book = book

    def hold(self, partition: str, keys: Sequence[str], session: str, holder: str,
             lease: float, producer: bool, pending: float = 0.0,
             pins: Sequence[str] | None = None) -> MediaHeld:
        """Pins of ``session`` on the entries ``keys``: the deployment and a
        ``MediaPin`` per key. ``pending`` (seconds a put may take): pins taken before the
        put (``MediaHeld.pending``), which a second call with ``pins`` makes these pins
        (``MediaPins.pend``)."""
        keys_ = check_keys(list(keys))
        session_, holder_ = _check_holder(session, holder)
        lease_ = check_timeout("lease", lease)
        book = self._book
        with book.cond:
            book.expire_pins()
            part = book.part(partition, create=bool(pending), by_put=True)
            if pending:
                put = check_timeout("pending", pending)
                return MediaHeld(pending=book.pins.pend(part, keys_, session_, holder_,
                                                        lease_, put, book.clock()))
            out = book.pins.hold(part, keys_, session_, holder_, lease_, bool(producer),
                                 book.clock(), None if pins is None else list(pins))
            return MediaHeld(deployment=book.pins.deployment, pins=out)

    def release(self, partition: str, pin: str, session: str, holder: str) -> None:
        """End ``pin``; free its entry if nothing holds it now."""
        session_, holder_ = _check_holder(session, holder)
        if not isinstance(pin, str) or not pin:
            raise ConfigError(f"pin must be a non-empty str, got {pin!r:.80}")
        book = self._book
        with book.cond:
            book.expire_pins()
            part = book.part(partition)
            rows = book.pins.release(part, pin, session_, holder_)
            if rows:
                book.free_slots(part.name, book.release_rows(
                    part, np.asarray(rows, dtype=np.int64)))

    def lookup(self, partition: str, key: str, index: int, generation: int, pin: str,
               deployment: str, fields: Sequence[str]) -> MediaPlace:
        """Where a handle's entry lives (``MediaPins.lookup``)."""
        if not isinstance(fields, list | tuple) or not fields or \
                not all(isinstance(f, str) for f in fields):
            raise ConfigError(f"fields must be a non-empty list of str, got {fields!r:.80}")
        book = self._book
        with book.cond:
            book.expire_pins()
            return book.pins.lookup(book.part(partition), key, int(index), int(generation),
                                    pin, deployment, list(fields))

    def stats(self, part: PartitionMeta) -> dict[str, Any]:
        """``stats()[p]["media"]`` (lock held)."""
        return self._book.pins.stats(part, self._book.clock())


__all__ = ["MediaCalls"]
