"""Slot grants: a served storage unit stores rows only in slots the controller placed.

A unit's memory grows with the highest slot written to it (slabs are indexed by
slot), so a unit that believed any client would grow by gigabytes on one small
put naming slot 2**30. Instead the controller, which places every row, tells
each unit how many slots of a partition it has handed out (``grant``, an admin
call only the owner's processes can make), and the unit refuses a put or a
direct write naming a slot at or above that bound. Grants only grow, by at
least doubling, so a steady stream of puts costs no extra call; a unit replaced
by an empty one starts with no grants (``SlotGrants.forget_unit``).

- ``SlotLimits``: the unit's side (one per served unit).
- ``SlotGrants``: the controller's side (what each unit was told, and which units
  did not take their last grant).

A grant a unit does not take (dead, not yet declared lost) fails with
``GrantFailed``; the controller then takes back the rows it placed (``placed``), so
nothing waits for a unit that is gone, and places them again on the units that
answer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import numpy as np

from tq_stream.errors import ConfigError, StateError, check_name
from tq_stream.messages.puts import Placement

MAX_SLOT = 2**31  # slots are dense from 0 per unit; a larger one is a malformed request
MIN_GRANT = 64  # the first grant of a partition covers at least this many slots


class SlotLimits:
    """Per partition, the slots a unit may store rows in: ``[0, limit)``.

    Invariant: a limit only grows, and only through ``grant``. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._limits: dict[str, int] = {}

    def grant(self, partition: str, slots: int) -> None:
        """Allow slots ``[0, slots)`` of ``partition`` (a smaller grant changes nothing)."""
        check_name("partition", partition)
        if isinstance(slots, bool) or not isinstance(slots, int) or not 0 <= slots <= MAX_SLOT:
            raise ConfigError(f"slots must be an int in [0, {MAX_SLOT}], got {slots!r}")
        with self._lock:
            if slots > self._limits.get(partition, 0):
                self._limits[partition] = slots

    def check(self, partition: str, slots: np.ndarray) -> None:
        """Raise StateError unless every slot is below ``partition``'s limit (a slot the
        controller never placed here, or placed on the process this unit replaced)."""
        if not len(slots):
            return
        limit = self._limits.get(partition, 0)
        top = int(slots.max())
        if top >= limit:
            raise StateError(
                f"slots must be ones the controller placed in partition {partition!r} of "
                f"this unit (below {limit}), got slot {top}")


class GrantFailed(StateError):
    """Storage unit ``unit`` did not take a grant: rows placed there must be taken back."""

    def __init__(self, unit: int, message: str) -> None:
        super().__init__(message)
        self.unit = unit


class SlotGrants:
    """What the controller has granted each unit, per (partition, unit).

    ``send(unit, partition, slots)`` makes the grant call; it runs outside any lock
    and a grant is recorded only once it returned, so a reply to ``reserve`` is sent
    only after every slot it names is granted. A unit whose grant call failed is in
    ``failed`` until it answers again (``answered``) or is replaced (``forget_unit``).
    Thread-safe.
    """

    def __init__(self, send: Callable[[int, str, int], None]) -> None:
        self._send = send
        self._lock = threading.Lock()
        self._granted: dict[tuple[str, int], int] = {}
        self.failed: frozenset[int] = frozenset()

    def covers(self, partition: str, ends: Iterable[tuple[int, int]]) -> bool:
        """True if every ``(unit, end)`` pair has slots ``[0, end)`` granted."""
        return all(end <= self._granted.get((partition, u), 0) for u, end in ends)

    def ensure(self, partition: str, units: np.ndarray, slots: np.ndarray) -> None:
        """Grant each unit in ``units`` at least the slots listed for it."""
        if not len(slots):
            return
        units = np.asarray(units)
        slots = np.asarray(slots)
        for u in np.unique(units).tolist():
            self.ensure_end(partition, int(u), int(slots[units == u].max()) + 1)

    def ensure_end(self, partition: str, unit: int, end: int) -> None:
        """Grant ``unit`` at least slots ``[0, end)`` of ``partition``."""
        have = self._granted.get((partition, unit), 0)
        if end <= have:
            return
        slots = min(MAX_SLOT, max(end, 2 * have, MIN_GRANT))
        try:
            self._send(unit, partition, slots)
        except Exception as exc:  # noqa: BLE001 — any failure: the unit did not take it
            with self._lock:
                self.failed = self.failed | {unit}
            raise GrantFailed(unit, f"storage unit {unit} did not take a grant of slots "
                                    f"[0, {slots}) of partition {partition!r}: {exc}") from exc
        with self._lock:
            if slots > self._granted.get((partition, unit), 0):
                self._granted[partition, unit] = slots

    def answered(self, unit: int) -> None:
        """``unit`` answered a call: grants may be sent to it again."""
        if unit in self.failed:
            with self._lock:
                self.failed = self.failed - {unit}

    def forget_unit(self, unit: int) -> None:
        """``unit`` was replaced by an empty one: it has no grants."""
        self.answered(unit)
        with self._lock:
            self._granted = {k: v for k, v in self._granted.items() if k[1] != unit}

    def forget_all(self) -> None:
        with self._lock:
            self._granted.clear()


def placed(reserve: Callable[[], Placement], grant: Callable[[Placement], None],
           undo: Callable[[Placement], None], attempts: int) -> Placement:
    """``reserve()``'s placement once ``grant`` covered it. A unit that did not take its
    grant (``GrantFailed``) gets nothing of it: ``undo`` takes the placement back and
    it is made again, at most ``attempts`` times (the placement skips the units in
    ``SlotGrants.failed``); the last failure is raised."""
    for attempt in range(attempts):
        out = reserve()
        try:
            grant(out)
            return out
        except GrantFailed:
            undo(out)
            if attempt + 1 >= attempts:
                raise
    raise AssertionError("attempts must be >= 1")
