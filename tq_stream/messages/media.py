"""Messages of media handles' pins (``controller/media_calls.py``): requests still
untyped until the media pins settle (see ``Untyped``)."""

from __future__ import annotations

from tq_stream.messages.rpc import Rpc, Untyped

MEDIA_HOLD: Rpc[Untyped, dict] = Rpc("media_hold", Untyped, dict, inline=False)
MEDIA_RELEASE = Rpc("media_release", Untyped, None)
MEDIA_LOOKUP: Rpc[Untyped, dict] = Rpc("media_lookup", Untyped, dict)

RPCS = (MEDIA_HOLD, MEDIA_RELEASE, MEDIA_LOOKUP)
