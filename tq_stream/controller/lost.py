"""LostKeys: the keys of one partition's rows that were lost with their storage unit.

A producer may write a row in several puts (``x``, then ``r``). When the row's unit
dies between them, the row is dropped (counted ``unit_lost``) and its key is free
again, so the next put would silently make the row anew with ``r`` only: a row that
never becomes ready, and a closed partition that never ends. The controller keeps
each lost row's key with its unit and the fields it had, and a put naming the key

- with none of those fields (it only adds to the row that is gone) skips the row:
  the writer is told (``Writer.put`` returns the keys, and logs a WARNING);
- with one of them (the producer made the row again, or reuses the key) makes the
  row afresh, and the key is forgotten once that row's fields are committed.

``clear`` of the key (or of the whole partition) forgets it too. At most
``MAX_LOST_KEYS`` keys are kept per partition, the oldest forgotten first (with a
WARNING): a put names a row's later fields soon after its first ones.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

logger = logging.getLogger(__name__)

MAX_LOST_KEYS = 65536


class LostKeys:
    """Lost keys of one partition -> (their unit, the fields their row had)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._keys: dict[str, tuple[int, frozenset[str]]] = {}
        self.rows = 0  # rows ever lost with their unit (counter)
        self.skipped = 0  # rows puts named after they were lost, not written (counter)
        self._warned = False

    def __bool__(self) -> bool:
        return bool(self._keys)

    def add(self, key: str, unit: int, fields: frozenset[str]) -> None:
        """Row ``key``, which had ``fields`` (at least one committed), was lost with
        ``unit``."""
        self.rows += 1
        self._keys.pop(key, None)  # newest last: the oldest is forgotten first
        self._keys[key] = (unit, fields)
        if len(self._keys) > MAX_LOST_KEYS:
            del self._keys[next(iter(self._keys))]
            if not self._warned:
                self._warned = True
                logger.warning("partition %r: more than %d keys of rows lost with their "
                               "storage unit; the oldest are forgotten (a put naming only "
                               "later fields of such a row makes it again)", self.name,
                               MAX_LOST_KEYS)

    def gone(self, keys: Sequence[str], fields: Iterable[str]) -> dict[int, int]:
        """Positions in ``keys`` of rows lost with their unit that a put of ``fields``
        only adds to (it writes none of the fields they had): position -> unit."""
        fields = frozenset(fields)
        out = {}
        for pos, key in enumerate(keys):
            lost = self._keys.get(key)
            if lost is not None and not lost[1] & fields:
                out[pos] = lost[0]
        return out

    def forget(self, keys: Iterable[str] | None = None) -> None:
        """Forget ``keys`` (all if None): their rows exist again, or were cleared."""
        if keys is None:
            self._keys.clear()
            return
        for key in keys:
            self._keys.pop(key, None)


__all__ = ["MAX_LOST_KEYS", "LostKeys"]
