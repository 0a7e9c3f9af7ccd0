"""Messages of the deployment: the units' addresses, liveness, checkpoints, admin calls.

Served by ``ControllerService`` only (``deploy/services.py``); ``admin`` RPCs need the
deployment owner's token (``transport/dispatch.py``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from tq_stream.messages.reads import Nothing, OfPartition, Plain
from tq_stream.messages.rpc import Rpc


class UnitAddress(msgspec.Struct, kw_only=True):
    """Where a storage unit serves (a ``units()`` record): its ``address``, the host
    and process serving it (``pid`` 0: not known), and its unix address on that host
    (None: none). The records the deployment keeps may carry more (a Ray node, a
    CURVE key); a client reads these."""

    address: str
    host: str
    pid: int = 0
    local: str | None = None


class AttachUnits(msgspec.Struct, kw_only=True):
    units: list[dict[str, Any]]  # address records: {"address", "host", "pid", "local"?}


class DropUnit(msgspec.Struct, kw_only=True):
    unit: int
    info: dict[str, Any] | None = None  # the new unit's address record


class OfUnit(msgspec.Struct, kw_only=True):
    unit: int


class LoadState(msgspec.Struct, kw_only=True):
    state: dict[str, Any]


class Ping(msgspec.Struct, kw_only=True):
    """The controller's heartbeat: its process and host, the units attached, its unix
    address on this host (None: none), what its last restart found, the units lost and
    not back, the units' epoch and the deployment owner's record (None: unknown)."""

    pid: int
    host: str
    units: int
    local: str | None = None
    recovery: dict[str, Any] = msgspec.field(default_factory=dict)
    dead_units: list[int] = msgspec.field(default_factory=list)
    units_epoch: int | None = None
    owner: dict[str, Any] | None = None


UNITS: Rpc[Nothing, list[UnitAddress]] = Rpc("units", Nothing, list[UnitAddress])
PING: Rpc[Nothing, Ping] = Rpc("ping", Nothing, Ping, inline=True)
SERVER_STATS: Rpc[Nothing, Plain] = Rpc("server_stats", Nothing, Plain, inline=True)
ATTACH_UNITS: Rpc[AttachUnits, None] = Rpc("attach_units", AttachUnits, None, admin=True)
DROP_UNIT: Rpc[DropUnit, dict[str, int]] = Rpc("drop_unit", DropUnit, dict[str, int],
                                               admin=True)
UNIT_LOST: Rpc[OfUnit, dict[str, int]] = Rpc("unit_lost", OfUnit, dict[str, int], admin=True)
STATE_DICT: Rpc[Nothing, Plain] = Rpc("state_dict", Nothing, Plain, admin=True)
LOAD_STATE_DICT: Rpc[LoadState, None] = Rpc("load_state_dict", LoadState, None, admin=True)
CLEAR_PARTITION: Rpc[OfPartition, int] = Rpc("clear_partition", OfPartition, int, admin=True)

RPCS = (UNITS, PING, SERVER_STATS, ATTACH_UNITS, DROP_UNIT, UNIT_LOST, STATE_DICT,
        LOAD_STATE_DICT, CLEAR_PARTITION)
