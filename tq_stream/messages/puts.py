"""Messages of partitions and puts: what a producer asks the controller and is told.

Each RPC is its request struct (the method's keyword arguments, defaults included),
its reply type and its flags (``rpc.py``). The controller builds the reply structs
(``controller/writes.py``, ``controller/spares.py``, ``controller/shared_puts.py``).
Row indices and generations are int64 numpy arrays.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import numpy as np

from tq_stream.config import DEFAULT_LEASE_TIMEOUT
from tq_stream.messages.rpc import Rpc

DEFAULT_WRITE_LEASE = DEFAULT_LEASE_TIMEOUT  # seconds a producer's rows stay reserved
Schemas = Mapping[str, Any]  # field -> FieldSchema.to_dict()
Tags = list[dict[str, Any]] | None  # one dict of tags per row


class Rows(msgspec.Struct):
    """Rows placed in storage: their indices, units, slots and generations."""

    index: np.ndarray
    unit: np.ndarray
    slot: np.ndarray
    generation: np.ndarray


class Lost(msgspec.Struct):
    """Keys of a put that name rows lost with their unit (positions in the put)."""

    pos: list[int]
    unit: list[int]


class Placement(msgspec.Struct, kw_only=True):
    """Where a reserve put its rows (``Rows``) and what else the writer must know:
    ``new`` (rows this put created), the fields' fixed ``schemas``, ``holder_left``
    (seconds a writer through a BatchMeta may still store bytes), ``lost`` keys,
    ``spare`` rows for its next puts, ``pos`` (a shared put: the positions in the put
    of the entries placed) and the units' epoch (a service's reply)."""

    index: np.ndarray
    unit: np.ndarray
    slot: np.ndarray
    generation: np.ndarray
    new: np.ndarray
    schemas: dict[str, dict[str, Any]]
    holder_left: float | None = None
    lost: Lost | None = None
    spare: Rows | None = None
    pos: list[int] | None = None
    units_epoch: int | None = None


class Committed(msgspec.Struct, kw_only=True):
    """A ``commit_new``: ``ok`` (else ``reason``: "schema", "exists", "lost",
    "capacity"), new ``spare`` rows, the units' epoch (a service's reply)."""

    ok: bool
    reason: str | None = None
    spare: Rows | None = None
    units_epoch: int | None = None


class CreatePartition(msgspec.Struct, kw_only=True):
    partition: str
    capacity: int | None = None
    consumers: Sequence[str] | None = None
    spills: bool = False


class ClosePartition(msgspec.Struct, kw_only=True):
    partition: str


class Partitions(msgspec.Struct, kw_only=True):
    pass


class Reserve(msgspec.Struct, kw_only=True):
    partition: str
    keys: Sequence[str]
    schemas: Schemas
    unit: int = -1
    timeout: float = 60.0
    expect: np.ndarray | None = None  # int64 generations
    spare: int = 0
    session: str = ""
    lease: float = DEFAULT_WRITE_LEASE
    holder: Mapping[str, Any] | None = None
    blocked: float = 0.0


class Commit(msgspec.Struct, kw_only=True):
    partition: str
    index: np.ndarray
    generation: np.ndarray
    schemas: Schemas
    tags: Tags = None
    holder: Mapping[str, Any] | None = None
    shared: Sequence[str | None] | None = None


class RowsOf(msgspec.Struct, kw_only=True):
    """Rows of a partition, by index and generation (an abort, spare rows given back)."""

    partition: str
    index: np.ndarray
    generation: np.ndarray


class CommitNew(msgspec.Struct, kw_only=True):
    partition: str
    keys: Sequence[str]
    index: Sequence[int]  # a few ints: a list costs less to send than an array
    generation: Sequence[int]
    schemas: Schemas
    tags: Tags = None
    unit: int = -1
    spare: int = 0


class ReserveShared(msgspec.Struct, kw_only=True):
    partition: str
    keys: Sequence[str]
    schemas: Schemas
    digests: Sequence[Mapping[str, str]]
    nbytes: Sequence[int]
    unit: int = -1
    timeout: float = 60.0
    session: str = ""
    lease: float = DEFAULT_WRITE_LEASE


# reserve and admit raise WouldBlock instead of waiting on a server's IO thread
CREATE_PARTITION: Rpc[CreatePartition, None] = Rpc("create_partition", CreatePartition, None,
                                                   inline=True)
CLOSE_PARTITION: Rpc[ClosePartition, None] = Rpc("close_partition", ClosePartition, None,
                                                 inline=True)
PARTITIONS: Rpc[Partitions, list[str]] = Rpc("partitions", Partitions, list[str], inline=True)
RESERVE: Rpc[Reserve, Placement] = Rpc("reserve", Reserve, Placement, inline=True,
                                       waits="produce")
COMMIT: Rpc[Commit, None] = Rpc("commit", Commit, None, inline=True)
ABORT: Rpc[RowsOf, None] = Rpc("abort", RowsOf, None)  # frees storage through the units
COMMIT_NEW: Rpc[CommitNew, Committed] = Rpc("commit_new", CommitNew, Committed, inline=True)
RELEASE_SPARES: Rpc[RowsOf, int] = Rpc("release_spares", RowsOf, int, inline=True)
RESERVE_SHARED: Rpc[ReserveShared, Placement] = Rpc("reserve_shared", ReserveShared,
                                                    Placement, waits="produce")

RPCS = (CREATE_PARTITION, CLOSE_PARTITION, PARTITIONS, RESERVE, COMMIT, ABORT, COMMIT_NEW,
        RELEASE_SPARES, RESERVE_SHARED)
