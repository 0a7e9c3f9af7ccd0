"""Writer: a producer's handle on one partition.

A put is validated in full before anything is stored (keys, row counts,
schemas, tags); the controller then places the rows (waiting while the
partition is at capacity), the bytes go straight to the storage units, and a
final commit makes the rows visible. A put that fails at any point leaves the
partition as it was: rows it created are removed again.

Example:
    >>> w = stream.writer("train")
    >>> w.put(["p0_0", "p0_1"], TensorDict({"input_ids": ids}, [2]),
    ...       tags=[{"uid": "p0"}, {"uid": "p0"}])
    >>> w.put(["p0_0", "p0_1"], {"reward": torch.tensor([1.0, 0.0])})
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tq_stream.backends.base import occupancy
from tq_stream.checks import TagsIn, check_keys, check_tags
from tq_stream.columns import Column, coerced, take
from tq_stream.connection import placement
from tq_stream.convert import RowData, schemas_of, single_row, to_columns
from tq_stream.errors import (
    ClosedError,
    ConnectionLost,
    LeaseError,
    MemoryBudgetExceeded,
    MemoryBudgetTooSmall,
    StateError,
    Unreachable,
    check_name,
)
from tq_stream.messages.puts import Lost
from tq_stream.shared_put import check_shared, put_shared

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from tq_stream.connection.connection import Connection
    from tq_stream.connection.protocols import ControllerAPI
    from tq_stream.connection.spares import SparePool


def _without(pos: list[int], keys: list[str], cols: dict[str, Column],
             tags: list[dict[str, Any]] | None) -> tuple[list[str], dict[str, Column],
                                                         list[dict[str, Any]] | None]:
    """The put without the rows at positions ``pos``."""
    drop = set(pos)
    keep = [i for i in range(len(keys)) if i not in drop]
    tpos = torch.tensor(keep, dtype=torch.int64)
    return ([keys[i] for i in keep], {f: take(c, tpos) for f, c in cols.items()},
            None if tags is None else [tags[i] for i in keep])


RETRY_PAUSE = 0.2  # seconds between puts placed on a unit that was down or replaced


class PutAgain(Exception):
    """A put had no visible effect and may be made again (internal): a storage unit did
    not take its bytes, or a restarted controller no longer knew its rows. ``skipped``:
    the keys it was told are lost with their unit (not named again)."""

    def __init__(self, cause: Exception, skipped: Sequence[str] = ()) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.skipped = list(skipped)


class Writer:
    """Upserts rows and fields into one partition (see module docstring).

    Args:
        connection: the deployment to write to (``stream.connection``).
        partition: the partition (created on first write).
        unit: the storage unit rows go to; -1 spreads them over all units; None (the
            default) prefers the units on this host (``Connection.preferred_unit``).
    """

    def __init__(self, connection: Connection, partition: str, unit: int | None = None) -> None:
        self._conn = connection
        self.partition = check_name("partition", partition)
        self._rows = RowWriter(connection, self.partition,
                               connection.preferred_unit() if unit is None else unit)

    def put(self, keys: str | Sequence[str], data: RowData, tags: TagsIn = None,
            timeout: float | None = None,
            shared: str | Sequence[str | None] | None = None) -> list[str]:
        """Write ``data`` for ``keys`` (new rows are created, fields of existing ones set).

        A key whose row was lost with its storage unit (counted ``unit_lost``) is
        skipped when the put writes none of the fields the row had (it only adds to a
        row that is gone, e.g. ``r`` after ``x``): the row is not made again half.
        Such keys are returned and logged at WARNING; the other rows are written.

        Args:
            keys: one key (then ``data`` holds one row without a batch dim) or a list.
            data: TensorDict ``[n]`` or dict of fields (see ``tq_stream.convert``).
            tags: one dict per row of JSON-like scalars, merged into the row's tags.
            timeout: seconds to wait while the partition is at capacity.
            shared: per row, the key of a shared entry (``put_shared``) whose fields the
                row reads as its own, or None; one key for one row. A row names one
                entry for its life; the entry is freed with the last row naming it.
        Returns:
            the keys skipped because their rows were lost with their unit (normally []).
        Raises:
            ConfigError, SchemaError, KeyConflictError, ClosedError, WaitTimeout.
        """
        if isinstance(keys, str):
            cols = single_row(data)
            keys_ = check_keys([keys])
            tags = [tags] if isinstance(tags, dict) else tags
            shared = [shared] if isinstance(shared, str) else shared
        else:
            keys_ = check_keys(keys)
            cols = to_columns(data, len(keys_))
        return self._rows.write(keys_, cols, check_tags(tags, len(keys_)), timeout,
                                shared=check_shared(shared, len(keys_)))

    def put_shared(self, keys: str | Sequence[str], data: object,
                   timeout: float | None = None) -> list[str]:
        """Write shared entries: fields stored once under keys of their own (a GRPO
        group's uid), which rows name with ``put(..., shared=)`` and read as their own.

        An entry's bytes are written once: the same bytes again write nothing, other
        bytes are refused (ConfigError); a later put may add fields. A shared field is
        never a row field of the partition (SchemaError). The entry is freed once no
        live row names it (or the partition is cleared).

        Args:
            keys, data: as in ``put`` (one key and one row, or a list and ``[n]``).
        Returns:
            the keys stored now (the others held these bytes already).
        """
        if isinstance(keys, str):
            keys_, cols = check_keys([keys]), single_row(data)
        else:
            keys_ = check_keys(keys)
            cols = to_columns(data, len(keys_))
        timeout = self._conn.config.timeout if timeout is None else timeout
        return put_shared(self._conn, self.partition, self._rows.unit, keys_, cols, timeout)

    async def aput(self, keys: str | Sequence[str], data: RowData, tags: TagsIn = None,
                   timeout: float | None = None,
                   shared: str | Sequence[str | None] | None = None) -> list[str]:
        """``put`` for asyncio code: runs in a worker thread, never blocks the loop."""
        return await asyncio.to_thread(self.put, keys, data, tags, timeout, shared)

    def reserve(self, n: int, timeout: float | None = None) -> int:
        """Wait until ``n`` more rows may be started without going stale; returns ``n``.

        Call it before generating rows: while the partition already holds as many
        rows as the consumers' staleness window allows (tasks whose sampler bounds
        staleness, e.g. StalenessSampler, and whose consumer set a version), it
        blocks, pacing producers instead of throwing their work away.

        Raises:
            WaitTimeout: the window stayed full for ``timeout`` seconds.
        """
        timeout = self._conn.config.timeout if timeout is None else timeout
        return self._conn.controller().admit(partition=self.partition, n=n, timeout=timeout)

    def close_partition(self) -> None:
        """No more rows will come: drain-mode loaders end after the last batch."""
        self._conn.controller().close_partition(partition=self.partition)


class RowWriter:
    """How a put reaches the storage units and the controller (``Writer.put``,
    ``Client.put_data``): on spare rows when it can, else ``reserve`` → the bytes to the
    units → ``commit``, made again while it had no visible effect (``PutAgain``).

    Args:
        connection: the deployment to write to.
        partition: the partition (a checked name).
        unit: the storage unit rows go to, or -1 (spread over all units).
    """

    def __init__(self, connection: Connection, partition: str, unit: int) -> None:
        self._conn = connection
        self.partition = partition
        self._unit = unit

    @property
    def unit(self) -> int:
        return self._unit

    def write(self, keys: list[str], cols: dict[str, Column], tags: list[dict[str, Any]] | None,
              timeout: float | None, expect: Sequence[int] | np.ndarray | None = None,
              holder: dict[str, Any] | None = None,
              shared: list[str | None] | None = None) -> list[str]:
        """The put (see ``Writer.put``; ``expect``: the rows' generations, for fields of
        existing rows only; ``holder``: the reader of a write through a BatchMeta, see
        ``Client.put_data``; ``shared``: the entry each row names); returns the keys
        skipped as lost with their unit."""
        ctrl = self._conn.controller()
        spares = None if expect is not None or shared is not None else \
            self._conn.spares(self.partition, self._unit)
        if spares is not None and spares.put(ctrl, self._conn.units(), keys, cols, tags):
            return []  # bytes to spare rows (no call on the same host), then commit_new
        timeout = self._conn.config.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        left = timeout  # the caller's own figure first: a timeout error names it
        skipped: list[str] = []
        paused = 0.0  # seconds paused for the memory budget, told on the next reserve
        while True:
            try:
                return skipped + self._write_placed(ctrl, spares, keys, cols, tags, left,
                                                    expect, holder, shared, paused)
            except PutAgain as exc:
                if exc.skipped:  # told once: the put again names only the other rows
                    skipped += exc.skipped
                    gone = set(exc.skipped)
                    keep = [k not in gone for k in keys]
                    keys, cols, tags = _without([i for i, k in enumerate(keep) if not k],
                                                keys, cols, tags)
                    if expect is not None:
                        expect = [g for g, k in zip(expect, keep, strict=True) if k]
                    if shared is not None:
                        shared = [s for s, k in zip(shared, keep, strict=True) if k]
                # Placed on a unit that died (its calls were never sent) or that was
                # replaced (it refuses the slots), or committed to a controller restarted
                # without the rows: nothing of the put is visible. The controller notices
                # a dead unit within its unit_timeout, then places elsewhere (or grants
                # the new process). Put again until the timeout.
                if time.monotonic() + RETRY_PAUSE >= deadline:
                    raise exc.cause from None
                logger.info("put to partition %r had no effect (%s); putting again",
                            self.partition, exc.cause)
                before = time.monotonic()
                time.sleep(RETRY_PAUSE)
                left = max(0.001, deadline - time.monotonic())
                paused = time.monotonic() - before if isinstance(
                    exc.cause, MemoryBudgetExceeded) else 0.0

    def _write_placed(self, ctrl: ControllerAPI, spares: SparePool | None, keys: list[str],
                      cols: dict[str, Column], tags: list[dict[str, Any]] | None, timeout: float,
                      expect: Sequence[int] | np.ndarray | None = None,
                      holder: dict[str, Any] | None = None,
                      shared: list[str | None] | None = None, paused: float = 0.0) -> list[str]:
        """One put through ``reserve``: place, store the bytes, commit (or abort); returns
        the keys the controller skipped as lost with their unit (``paused``: seconds the
        put waited for the memory budget since its previous reserve, counted there).

        Raises:
            PutAgain: a unit did not take the bytes (down or replaced), or the controller
                no longer knew the rows at commit (it restarted).
        """
        schemas = schemas_of(cols)
        extra: dict[str, Any] = {} if expect is None else {"expect": expect}
        if holder is not None:
            extra["holder"] = holder
        if spares is not None and spares.wanted():
            extra["spare"] = spares.wanted()
        if paused > 0:
            extra["blocked"] = paused
        if expect is None:  # rows may be created: hold them under this process's session
            lease = self._conn.config.lease_timeout
            extra["session"] = self._conn.keeper().producer_session(self.partition, lease)
            extra["lease"] = lease
        asked = time.monotonic()
        place = ctrl.reserve(partition=self.partition, keys=keys, schemas=schemas,
                             unit=self._unit, timeout=timeout, **extra)
        if spares is not None:
            spares.add(place.spare)
            spares.learn(place.schemas)
        skipped = self._lost(place.lost, keys)
        if skipped and place.lost is not None:
            if shared is not None:
                gone = set(place.lost.pos)
                shared = [s for i, s in enumerate(shared) if i not in gone]
            keys, cols, tags = _without(place.lost.pos, keys, cols, tags)
            if not keys:
                return skipped  # nothing placed: every row is gone
        try:
            differ = {f: sc for f, sc in place.schemas.items() if sc != schemas[f]}
            if differ:  # most puts match their fields' fixed schemas: nothing to convert
                cols = coerced(cols, differ)
                schemas = schemas_of(cols)
            if place.holder_left is not None and \
                    time.monotonic() - asked >= place.holder_left:
                # paused past the reader's lease since the reserve: another reader may own
                # the rows now, so no byte is stored; the next reserve tells
                raise PutAgain(LeaseError(f"put_data to partition {self.partition!r} "
                                          f"outlived its lease before storing"), skipped)
            try:
                placement.store(self._conn.units(), self.partition, place.unit, place.slot,
                                cols, occupancy(place.index, place.generation))
            except (ClosedError, MemoryBudgetTooSmall):  # the latter: freeing rows cannot help
                raise
            except (Unreachable, ConnectionLost, StateError) as exc:  # e.g. "slots must
                # be ones the controller placed" (a new process), or the unit died while
                # it took the bytes: none is visible before the commit. Rows this put
                # made are aborted; their slots are reused only once that unit freed them.
                raise PutAgain(exc, skipped) from exc
            try:
                ctrl.commit(partition=self.partition, index=place.index,
                            generation=place.generation, schemas=schemas, tags=tags,
                            holder=holder, shared=shared)
            except (ClosedError, LeaseError):
                raise
            except StateError as exc:  # "rows ... were cleared meanwhile": the controller
                # restarted from a checkpoint without them
                raise PutAgain(exc, skipped) from exc
            if spares is not None:
                spares.learn(schemas)  # fixed now: later small puts may skip reserve
            return skipped
        except BaseException:
            new = place.new
            if new.any():
                ctrl.abort(partition=self.partition, index=place.index[new],
                           generation=place.generation[new])
            raise

    def _lost(self, lost: Lost | None, keys: list[str]) -> list[str]:
        """Keys the controller skipped as rows lost with their unit (logged once here)."""
        if not lost:
            return []
        skipped = [keys[p] for p in lost.pos]
        units = sorted(set(lost.unit))
        logger.warning("put to partition %r skipped %d rows lost with storage unit %s "
                       "before it (counted 'unit_lost'; the put writes none of the fields "
                       "they had, so they are not made again): %s", self.partition,
                       len(skipped), ", ".join(map(str, units)), skipped[:10])
        return skipped
