"""The producer's side of a shared put: entries written once, named by many rows.

``put_shared(keys, data)`` stores each entry's fields under a key of its own (a
GRPO group's uid): ``reserve_shared`` places the entries whose bytes are not
stored yet, the bytes go to the units as for any put, ``commit`` makes them
visible. Each field carries a digest of each row's dtype, shape and bytes (not of the
Python form they came in), so a put made again with the same values writes nothing,
and one with other values is refused before any is stored
(``controller/shared_entries.py``).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from tq_stream.backends.base import occupancy
from tq_stream.buffers import indexable
from tq_stream.columns import Column, Ragged, coerced, span, take
from tq_stream.connection import placement
from tq_stream.convert import schemas_of
from tq_stream.errors import (
    ClosedError,
    ConfigError,
    ConnectionLost,
    LeaseError,
    MemoryBudgetTooSmall,
    StateError,
    Unreachable,
)
from tq_stream.multiragged import MultiRagged

if TYPE_CHECKING:
    from tq_stream.connection.connection import Connection

logger = logging.getLogger(__name__)
RETRY_PAUSE = 0.2  # seconds between shared puts that had no effect (``writer.RETRY_PAUSE``)


def check_shared(shared: object, n: int) -> list[str | None] | None:
    """``shared`` of a put of ``n`` rows: None, or per row an entry's key or None."""
    if shared is None:
        return None
    if isinstance(shared, str) or not isinstance(shared, Sequence) or len(shared) != n or \
            not all(s is None or (isinstance(s, str) and s) for s in shared):
        raise ConfigError(f"shared must give, for each of the {n} rows, the key (a non-empty "
                          f"str) of a shared entry or None, got {shared!r:.120}")
    return list(shared) if any(s is not None for s in shared) else None


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return indexable(t.contiguous().reshape(-1)).view(torch.uint8).numpy().tobytes() \
        if t.numel() else b""


def _parts(col: Column) -> list[bytes]:
    """What a one-row column's digest covers: the row's dtype, shape and bytes, the same
    whatever form it came in (a dense ``[1, ...]`` tensor, a one-row ragged or
    multi-ragged column, a list of one tensor), as the field stores and reads it."""
    if isinstance(col, torch.Tensor):
        row = col[0]
    elif isinstance(col, Ragged):
        row = col.row(0)
    elif isinstance(col, MultiRagged):
        row = col.row(0)
    else:
        return [repr(list(col)).encode()]
    return [str((row.dtype, tuple(row.shape))).encode(), _tensor_bytes(row)]


def digest(col: Column) -> str:
    h = hashlib.blake2b(digest_size=16)
    for part in _parts(col):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def nbytes(col: Column) -> int:
    """Bytes of a column's values (plain values: their repr's length)."""
    if isinstance(col, torch.Tensor):
        return col.numel() * col.element_size()
    if isinstance(col, Ragged | MultiRagged):
        return col.values.numel() * col.values.element_size()
    return len(repr(list(col)))


def put_shared(conn: Connection, partition: str, unit: int, keys: list[str],
               cols: dict[str, Column], timeout: float) -> list[str]:
    """Store shared entries ``keys`` (``cols``: one row per key); returns the keys
    stored now (the others held these bytes already). A put whose bytes a unit did not
    take (down, replaced) or that a restarted controller no longer knew is made again
    every ``RETRY_PAUSE`` seconds within ``timeout``, as ``Writer.put`` does."""
    rows = [{f: span(c, i, i + 1) for f, c in cols.items()} for i in range(len(keys))]
    digests = [{f: digest(c) for f, c in row.items()} for row in rows]
    sizes = [sum(nbytes(c) for c in row.values()) for row in rows]
    deadline = time.monotonic() + timeout
    while True:
        try:
            return _put_once(conn, partition, unit, keys, cols, digests, sizes,
                             max(0.001, deadline - time.monotonic()))
        except (Unreachable, ConnectionLost, StateError) as exc:
            if isinstance(exc, ClosedError | LeaseError | MemoryBudgetTooSmall) or \
                    time.monotonic() + RETRY_PAUSE >= deadline:
                raise
            logger.info("shared put to partition %r had no effect (%s); putting again",
                        partition, exc)
            time.sleep(RETRY_PAUSE)


def _put_once(conn: Connection, partition: str, unit: int, keys: list[str],
              cols: dict[str, Column], digests: list[dict[str, str]], sizes: list[int],
              timeout: float) -> list[str]:
    """One shared put: reserve_shared, the bytes to the units, commit (or abort)."""
    ctrl = conn.controller()
    lease = conn.config.lease_timeout
    place = ctrl.reserve_shared(partition=partition, keys=keys, schemas=schemas_of(cols),
                                digests=digests, nbytes=sizes, unit=unit, timeout=timeout,
                                session=conn.keeper().producer_session(partition, lease),
                                lease=lease)
    pos: Sequence[int] = place.pos or []
    if not pos:
        return []
    part = cols if len(pos) == len(keys) else \
        {f: _take(c, pos) for f, c in cols.items()}
    try:
        schemas = schemas_of(part)
        differ = {f: s for f, s in place.schemas.items() if s != schemas[f]}
        if differ:  # e.g. a one-row image into a multi-ragged field
            part = coerced(part, differ)
            schemas = schemas_of(part)
        placement.store(conn.units(), partition, place.unit, place.slot, part,
                        occupancy(place.index, place.generation))
        ctrl.commit(partition=partition, index=place.index, generation=place.generation,
                    schemas=schemas)
    except BaseException:
        new = place.new
        if new.any():
            ctrl.abort(partition=partition, index=place.index[new],
                       generation=place.generation[new])
        raise
    return [keys[i] for i in pos]


def _take(col: Column, pos: Sequence[int]) -> Column:
    return take(col, torch.tensor(list(pos), dtype=torch.int64))


__all__ = ["check_shared", "digest", "nbytes", "put_shared"]
