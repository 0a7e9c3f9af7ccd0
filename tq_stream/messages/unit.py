"""Messages of a storage unit served over sockets (``deploy/unit_service.py``).

Callers: ``RemoteUnit`` (the client layer's ``StorageUnit``), the controller service
(frees, spill advice, grants), its restart (``deploy/meta_checkpoint.py``) and its
heartbeat (``deploy/unit_watch.py``), all through one ``UnitClient``
(``connection/unit_client.py``). Slots and generations are int arrays (checked by the
service), columns normalized columns (``tq_stream.columns``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from tq_stream.messages.rpc import Rpc

Plain = dict[str, Any]  # a reply given as a plain dict (shape: the unit method's)


class Slots(msgspec.Struct, kw_only=True):
    partition: str
    slots: np.ndarray


class Put(msgspec.Struct, kw_only=True):
    partition: str
    slots: np.ndarray
    columns: dict[str, Any]  # field -> column
    generations: np.ndarray | None = None


class Get(msgspec.Struct, kw_only=True):
    """A get, or the spans of multi-ragged fields, of ``fields`` of ``slots``."""

    partition: str
    slots: np.ndarray
    fields: Sequence[str]
    generations: np.ndarray | None = None


class Partition(msgspec.Struct, kw_only=True):
    partition: str


class Grant(msgspec.Struct, kw_only=True):
    partition: str
    slots: int  # writes may use slots [0, slots)


class Layout(msgspec.Struct, kw_only=True):
    partition: str
    fields: Sequence[str]
    writable: bool = False


class MaySpill(msgspec.Struct, kw_only=True):
    partition: str
    slots: np.ndarray
    fields: Sequence[str]


class SetMemory(msgspec.Struct, kw_only=True):
    partition: str
    memory_budget: int | None = None
    cold: Sequence[str] = ()


class PrepareWrite(msgspec.Struct, kw_only=True):
    partition: str
    slots: np.ndarray
    generations: np.ndarray | None
    fields: dict[str, Any]
    arenas: dict[str, Any] | None = None


class FinishWrite(msgspec.Struct, kw_only=True):
    partition: str
    ticket: int
    ok: bool = True
    columns: dict[str, Any] | None = None


class SaveRows(msgspec.Struct, kw_only=True):
    request: dict[str, Any]  # ``backends.unit_files.check_request``


class LoadRows(msgspec.Struct, kw_only=True):
    path: str
    save: str
    unit: int


class Nothing(msgspec.Struct, kw_only=True):
    """A request without arguments."""


class UnitPing(msgspec.Struct, kw_only=True):
    """A unit's heartbeat: the process serving it, its host, the bytes it holds."""

    pid: int
    host: str
    nbytes: int


# The unit's lock guards only copies, so most methods may run on a server's IO thread
# (large transfers go to workers, ``UnitService.INLINE_BYTES``/``INLINE_ROWS``).
# prepare_write may wait for open writes; save_rows / load_rows write / read files;
# set_memory and may_spill may move rows to disk. Admin (owner only): what changes
# placement or every row, touches files or lists every row, or sets the owner's bounds.
PUT: Rpc[Put, None] = Rpc("put", Put, None, inline=True)
GET: Rpc[Get, dict[str, Any]] = Rpc("get", Get, dict[str, Any], inline=True)
FREE: Rpc[Slots, None] = Rpc("free", Slots, None, inline=True)
DROP: Rpc[Partition, None] = Rpc("drop", Partition, None, inline=True, admin=True)
NBYTES: Rpc[Nothing, int] = Rpc("nbytes", Nothing, int, inline=True)
PING: Rpc[Nothing, UnitPing] = Rpc("ping", Nothing, UnitPing, inline=True)
LAYOUT: Rpc[Layout, Plain] = Rpc("layout", Layout, Plain, inline=True)
SPANS: Rpc[Get, Plain] = Rpc("spans", Get, Plain, inline=True)
PREPARE_WRITE: Rpc[PrepareWrite, Plain] = Rpc("prepare_write", PrepareWrite, Plain)
FINISH_WRITE: Rpc[FinishWrite, None] = Rpc("finish_write", FinishWrite, None, inline=True)
SAVE_ROWS: Rpc[SaveRows, Plain] = Rpc("save_rows", SaveRows, Plain, admin=True)
LOAD_ROWS: Rpc[LoadRows, Plain] = Rpc("load_rows", LoadRows, Plain, admin=True)
STATS: Rpc[Nothing, Plain] = Rpc("stats", Nothing, Plain, inline=True)
GRANT: Rpc[Grant, None] = Rpc("grant", Grant, None, inline=True, admin=True)
HELD: Rpc[Nothing, Plain] = Rpc("held", Nothing, Plain, inline=True, admin=True)
SET_MEMORY: Rpc[SetMemory, None] = Rpc("set_memory", SetMemory, None, admin=True)
MAY_SPILL: Rpc[MaySpill, None] = Rpc("may_spill", MaySpill, None, admin=True)

RPCS = (PUT, GET, FREE, DROP, NBYTES, PING, LAYOUT, SPANS, PREPARE_WRITE, FINISH_WRITE,
        SAVE_ROWS, LOAD_ROWS, STATS, GRANT, HELD, SET_MEMORY, MAY_SPILL)

