"""UnitService: a storage unit served over sockets.

Its RPCs, their requests, replies and flags (inline, admin) are ``messages/unit.py``;
arguments and results are plain data, numpy arrays and normalized columns
(``tq_stream.columns``), carried by ``tq_stream.serialization`` without pickle; admin
RPCs need the deployment owner's token (``tq_stream.transport.dispatch``). A served unit stores
rows only in slots the controller granted it (``tq_stream.deploy.grants``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from tq_stream import hosts
from tq_stream.backends.base import ListsRows, StorageUnit
from tq_stream.backends.shared import SharedSlabs
from tq_stream.backends.slots import check_slots
from tq_stream.backends.spill import check_budget, check_cold
from tq_stream.columns import Column, Ragged
from tq_stream.deploy.grants import SlotLimits
from tq_stream.errors import ConfigError, check_name
from tq_stream.handling import WouldBlock, may_block
from tq_stream.messages import unit as unit_messages
from tq_stream.messages.rpc import RpcTable
from tq_stream.messages.unit import UnitPing
from tq_stream.multiragged import MultiRagged
from tq_stream.transport.dispatch import rpc_stats


def _slots(value: object) -> np.ndarray:
    """Received slots as int64: a 1-D array of ints in [0, MAX_SLOT)."""
    return check_slots(value)


def _tokens(value: object, slots: np.ndarray) -> np.ndarray | None:
    if value is None:
        return None
    tokens = np.asarray(value)
    if tokens.shape != slots.shape or (tokens.size and tokens.dtype.kind not in "iu"):
        raise ConfigError(f"generations must be ints, one per slot ({len(slots)}), got "
                          f"{tokens.dtype} of shape {tokens.shape}")
    return tokens.astype(np.int64, copy=False)


def _payload(columns: object) -> int:
    """Bytes of the tensors in received columns (views of the request's frames)."""
    total = 0
    for col in columns.values() if isinstance(columns, dict) else ():
        for t in (col.values, col.offsets) if isinstance(col, Ragged) else \
                (col.values, col.shapes) if isinstance(col, MultiRagged) else (col,):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


class UnitService:
    """Serves one StorageUnit (plus a liveness probe); slots and generations received
    are checked to be 1-D int arrays (slots in ``[0, MAX_SLOT)``) before they reach it,
    and a write may name only slots the controller granted (``grant``, admin)."""

    # what a server may call, and how: one ``Rpc`` per method (``messages/unit.py``)
    RPC_TABLE = RpcTable(unit_messages.RPCS)
    INLINE_BYTES = 1 << 20  # a put carrying more bytes than this runs on a worker
    INLINE_ROWS = 64  # a get of more rows than this runs on a worker

    def __init__(self, unit: StorageUnit) -> None:
        self.unit = unit
        # its same-host abilities (a MemoryUnit has none: clients then use put and get)
        self.shared = unit if isinstance(unit, SharedSlabs) else None
        self.limits = SlotLimits()

    def grant(self, partition: str, slots: int) -> None:
        """Let writes use slots ``[0, slots)`` of ``partition`` (the controller placed them)."""
        self.limits.grant(partition, slots)

    def put(self, partition: str, slots: npt.ArrayLike, columns: dict[str, Column],
            generations: npt.ArrayLike | None = None) -> None:
        slots = _slots(slots)
        self.limits.check(partition, slots)
        if not may_block() and _payload(columns) > self.INLINE_BYTES:
            raise WouldBlock
        self.unit.put(partition, slots, columns, _tokens(generations, slots))

    def get(self, partition: str, slots: npt.ArrayLike, fields: Sequence[str],
            generations: npt.ArrayLike | None = None) -> dict[str, Column]:
        slots = _slots(slots)
        if not may_block() and len(slots) > self.INLINE_ROWS:
            raise WouldBlock
        return self.unit.get(partition, slots, list(fields), _tokens(generations, slots))

    def free(self, partition: str, slots: npt.ArrayLike) -> None:
        self.unit.free(partition, _slots(slots))

    def drop(self, partition: str) -> None:
        self.unit.drop(partition)

    def nbytes(self) -> int:
        return self.unit.nbytes()

    def held(self) -> dict[str, Any]:
        """Written slots and their tokens per partition (see ``MemoryUnit.held``)."""
        return self.unit.held() if isinstance(self.unit, ListsRows) else {}

    def layout(self, partition: str, fields: Sequence[str],
               writable: bool = False) -> dict[str, Any]:
        """Shared-memory layout of fields (empty when the unit has none)."""
        if self.shared is None:
            return {}
        return self.shared.layout(partition, list(fields), bool(writable))

    def spans(self, partition: str, slots: object, fields: Sequence[str],
              generations: object = None) -> dict[str, Any]:
        """Where rows of multi-ragged fields lie in shared memory (empty without it)."""
        slots = _slots(slots)
        if self.shared is None:
            return {}
        return self.shared.spans(partition, slots, list(fields), _tokens(generations, slots))

    def ping(self) -> UnitPing:
        # the host is looked up per ping (a Ray test fakes nodes there)
        return UnitPing(pid=os.getpid(), host=hosts.host_id(), nbytes=self.unit.nbytes())

    def save_rows(self, request: dict[str, Any]) -> dict[str, Any]:
        """Write this unit's checkpoint file (see ``tq_stream.backends.unit_files``)."""
        from tq_stream.backends.unit_files import check_request

        return self.unit.save_rows(check_request(request))

    def load_rows(self, path: str, save: str, unit: int) -> dict[str, Any]:
        """Check and store the rows of this unit's checkpoint file ``path``."""
        from tq_stream.backends.unit_files import check_file

        check_file(path, save, unit)
        return self.unit.load_rows(path, save, unit)
    def may_spill(self, partition: str, slots: object, fields: Sequence[str]) -> None:
        """Advice: these slots' fields may spill (``StorageUnit.may_spill``)."""
        self.unit.may_spill(check_name("partition", partition), _slots(slots),
                            sorted(check_cold(fields)))

    def set_memory(self, partition: str, memory_budget: object = None,
                   cold: object = ()) -> None:
        """The partition's memory budget and cold fields (``StorageUnit.set_memory``)."""
        self.unit.set_memory(check_name("partition", partition), check_budget(memory_budget),
                             sorted(check_cold(cold)))

    def stats(self) -> dict[str, Any]:
        """The unit's ``stats()`` plus its process id and the RPC calls it served."""
        return {**self.unit.stats(), "pid": os.getpid(), "rpc": rpc_stats()}

    def prepare_write(self, partition: str, slots: npt.ArrayLike,
                      generations: npt.ArrayLike | None, fields: dict[str, Sequence[Any]],
                      arenas: dict[str, object] | None = None) -> dict[str, Any]:
        """Start a same-host direct write (see ``tq_stream.backends.direct``)."""
        shared = self._shared_slabs()
        slots = _slots(slots)
        self.limits.check(partition, slots)
        return shared.prepare_write(partition, slots, _tokens(generations, slots), fields,
                                    arenas)

    def finish_write(self, partition: str, ticket: int, ok: bool = True,
                     columns: dict[str, Any] | None = None) -> None:
        """End a same-host direct write; ``columns``: the rows' other fields, put after."""
        if columns is not None and not isinstance(columns, dict):
            raise ConfigError(f"columns must be a dict of field -> column, got "
                              f"{type(columns).__name__}")
        if not may_block() and _payload(columns):
            # Tensors may grow a slab, which may wait: on a worker, before the ticket closes
            # (a writer sends object fields only, stored inline).
            raise WouldBlock
        self._shared_slabs().finish_write(partition, ticket, ok, columns)

    def _shared_slabs(self) -> SharedSlabs:
        if self.shared is None:
            raise ConfigError("this storage unit keeps no shared memory: write through put")
        return self.shared
