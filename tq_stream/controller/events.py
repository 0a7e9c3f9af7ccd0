"""WARNING logs of the controller's delivery decisions: lease expiries and discards.

Both can come in floods (a sampler discarding every stale row, a whole DP group's
leases running out), so each kind of event is summed per (partition, task, reason)
and logged at most once per ``EVERY`` seconds with the count since the last line.
Called with the controller's lock held: only counting and, now and then, one log call.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)

EVERY = 10.0  # seconds between two lines about the same (partition, task, reason)


class _Limited:
    """Counts per key, flushed to the log at most once per ``EVERY`` seconds per key."""

    def __init__(self, message: str) -> None:
        self._message = message
        self._pending: dict[tuple[str, str, str], int] = {}
        self._last: dict[tuple[str, str, str], float] = {}

    def add(self, partition: str, task: str, reason: str, n: int, detail: str = "") -> None:
        """Count ``n`` events; ``detail`` (about the latest) goes into the line, not the key."""
        if n <= 0:
            return
        key = (partition, task, reason)
        self._pending[key] = self._pending.get(key, 0) + n
        now = time.monotonic()
        if now - self._last.get(key, -EVERY) >= EVERY:
            self._last[key] = now
            logger.warning(self._message, self._pending.pop(key), task, partition, reason,
                           detail)


_EXPIRED = _Limited("%d rows of task %r on partition %r lost their reader (%s): its process "
                    "stopped renewing; they will be delivered again to the next reader of "
                    "their step%s")
_DISCARDED = _Limited("%d rows discarded by task %r on partition %r (reason %r)%s")


def expired(partition: str, task: str, n: int) -> int:
    """``n`` leased rows expired; returns ``n`` (so the call wraps ``state.expire``)."""
    _EXPIRED.add(partition, task, "lease expired", n)
    return n


def discarded(partition: str, task: str, reason: str, n: int, detail: str = "") -> None:
    _DISCARDED.add(partition, task, reason, n, detail)
