"""Messages of media handles' pins (``controller/media_calls.py``, ``media.py``).

Replies are still plain dicts of the shapes ``MediaCalls.hold`` and ``lookup`` document.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from tq_stream.messages.reads import Plain
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


MEDIA_HOLD: Rpc[MediaHold, Plain] = Rpc("media_hold", MediaHold, Plain)
MEDIA_RELEASE = Rpc("media_release", MediaRelease, None)
MEDIA_LOOKUP: Rpc[MediaLookup, Plain] = Rpc("media_lookup", MediaLookup, Plain)

RPCS = (MEDIA_HOLD, MEDIA_RELEASE, MEDIA_LOOKUP)
