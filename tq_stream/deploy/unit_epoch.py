"""The units' epoch: a number that changes when a storage unit serves at a new address,
named in every reply that places or hands out rows (clients then look up the units'
addresses again, ``connection/proxies.py``)."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tq_stream.handling import Reply
from tq_stream.messages.reads import StepMeta


def units_epoch(units: Sequence[Mapping[str, Any]]) -> int:
    """A number that changes when a unit moves to another address (CRC-32 of the
    addresses, so a restarted controller gives the same number for the same units)."""
    return zlib.crc32("\n".join(f"{u.get('address')} {u.get('local')}"
                                for u in units).encode())


class EpochReply:
    """The reply handle a ControllerService hands its Controller's ``get_meta``: a
    reply a commit gives there names the units' epoch when it was formed."""

    __slots__ = ("epoch", "reply")

    def __init__(self, reply: Reply[StepMeta], epoch: Callable[[], int]) -> None:
        self.reply = reply  # the request's own handle, from the server
        self.epoch = epoch

    def give(self, result: StepMeta, then: Callable[[], None] | None = None) -> bool:
        result.units_epoch = self.epoch()  # a reply of this call's own
        return self.reply.give(result, then)
