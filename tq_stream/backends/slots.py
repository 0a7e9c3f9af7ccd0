"""Slot numbers as they arrive from a request or a file: checked before a unit uses them."""

from __future__ import annotations

import numpy as np

from tq_stream.backends.generations import UNSET
from tq_stream.errors import ConfigError, StateError

MAX_SLOT = 2**31  # slots are dense from 0 per unit; a larger one is a malformed request


def check_slots(value: object, what: str = "slots",
                error: type[Exception] = ConfigError) -> np.ndarray:
    """``value`` as int64 slots, or raise ``error``: a 1-D array of ints in [0, MAX_SLOT)."""
    slots = np.asarray(value)
    if slots.ndim != 1 or (slots.size and (slots.dtype.kind not in "iu" or slots.min() < 0
                                           or slots.max() >= MAX_SLOT)):
        raise error(f"{what} must be a 1-D array of ints in [0, {MAX_SLOT}), got "
                    f"{slots.dtype} of shape {slots.shape}")
    return slots.astype(np.int64, copy=False)


def check_unheld(partition: str, slots: np.ndarray, held: np.ndarray,
                 tokens: np.ndarray | None) -> None:
    """Raise StateError unless each slot a put of the rows ``tokens`` names is free or
    holds its own row (``held``: the unit's token per slot; slots past its end are
    free): a put never replaces another row. A put of rows that were cleared meanwhile
    can come late: meant for a unit process that died, delivered to the one that
    replaced it at its address after the controller placed other rows in those slots
    (a unit client retries a refused connection). Refused, the writer puts its rows
    again; the rows in the slots keep their bytes."""
    if tokens is None or not len(slots):
        return
    inside = slots < len(held)
    now = held[slots[inside]]
    other = (now != UNSET) & (now != np.asarray(tokens, dtype=np.int64)[inside])
    if other.any():
        raise StateError(f"slots must be free or hold the put's own rows, but slots "
                         f"{slots[inside][other][:5].tolist()} of partition {partition!r} "
                         f"hold other rows: the put's rows were cleared meanwhile (a put "
                         f"that came late); put them again")
