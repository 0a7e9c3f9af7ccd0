"""Messages of media handles' pins (``controller/media_calls.py``, ``media.py``).

The controller builds the replies (``controller/media_pins.py``): ``MediaHeld`` (a
hold), ``MediaPlace`` (where a handle's entry lives; int numpy arrays of one row).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from tq_stream.messages.rpc import Rpc


class MediaHold(msgspec.Struct, kw_only=True):
    partition: str
    keys: Sequence[str]
    session: str
    holder: str
    lease: float
    producer: bool
    pending: float = 0.0
    pins: Sequence[str] | None = None


class MediaRelease(msgspec.Struct, kw_only=True):
    partition: str
    pin: str
    session: str
    holder: str


class MediaLookup(msgspec.Struct, kw_only=True):
    partition: str
    key: str
    index: int
    generation: int
    pin: str
    deployment: str
    fields: Sequence[str]


class MediaPin(msgspec.Struct, kw_only=True):
    """A pin on the entry of media ``key``: the entry's row, its generation, and the
    fields it holds."""

    key: str
    pin: str
    index: int
    generation: int
    fields: list[str]


class MediaHeld(msgspec.Struct, kw_only=True):
    """A ``media_hold``: the deployment and one pin per key; or, for a hold taken
    before a put (``pending``), only the pending pins."""

    deployment: str = ""
    pins: list[MediaPin] = msgspec.field(default_factory=list)
    pending: list[str] | None = None


class MediaPlace(msgspec.Struct, kw_only=True):
    """Where a handle's entry lives, and the schemas of the fields asked for."""

    index: np.ndarray
    generation: np.ndarray
    unit: np.ndarray
    slot: np.ndarray
    schemas: dict[str, dict[str, Any]]


MEDIA_HOLD: Rpc[MediaHold, MediaHeld] = Rpc("media_hold", MediaHold, MediaHeld)
MEDIA_RELEASE: Rpc[MediaRelease, None] = Rpc("media_release", MediaRelease, None)
MEDIA_LOOKUP: Rpc[MediaLookup, MediaPlace] = Rpc("media_lookup", MediaLookup, MediaPlace)

RPCS = (MEDIA_HOLD, MEDIA_RELEASE, MEDIA_LOOKUP)
