"""Slot numbers as they arrive from a request or a file: checked before a unit uses them."""

from __future__ import annotations

import numpy as np

from tq_stream.errors import ConfigError

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
