"""RemoteUnit: a storage unit in another process, as a ``StorageUnit``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from tq_stream.backends.base import StorageUnit
from tq_stream.columns import Column
from tq_stream.connection.unit_client import UnitClient
from tq_stream.messages import unit as msg

if TYPE_CHECKING:
    from tq_stream.transport.base import Transport

UNIT_FILE_TIMEOUT = 600.0  # seconds a unit may take to write or read its checkpoint file


def _array(values: Sequence[int] | np.ndarray | None) -> np.ndarray | None:
    return None if values is None else np.asarray(values, dtype=np.int64)


class RemoteUnit(StorageUnit):
    """A storage unit in another process, reached through an RpcClient.

    ``owner_token``: sent with the unit's admin calls (``drop``, ``save_rows``,
    ``load_rows``, ...); a handle without it gets AuthError from them.
    """

    def __init__(self, rpc: Transport, timeout: float, owner_token: str | None = None) -> None:
        self._unit = UnitClient(rpc, timeout, owner_token)
        self._timeout = timeout

    @property
    def client(self) -> UnitClient:
        """The client this unit is called through."""
        return self._unit

    def put(self, partition: str, slots: np.ndarray, columns: Mapping[str, Column],
            generations: np.ndarray | None = None) -> None:
        self._unit.call(msg.PUT, msg.Put(partition=partition, slots=np.asarray(slots),
                                         columns=dict(columns),
                                         generations=_array(generations)))

    def get(self, partition: str, slots: np.ndarray, fields: Sequence[str],
            generations: np.ndarray | None = None) -> dict[str, Column]:
        return self._unit.call(msg.GET, msg.Get(partition=partition, slots=np.asarray(slots),
                                                fields=list(fields),
                                                generations=_array(generations)))

    def free(self, partition: str, slots: np.ndarray) -> None:
        self._unit.call(msg.FREE, msg.Slots(partition=partition, slots=np.asarray(slots)))

    def drop(self, partition: str) -> None:
        self._unit.call(msg.DROP, msg.Partition(partition=partition))

    def may_spill(self, partition: str, slots: np.ndarray, fields: Sequence[str]) -> None:
        self._unit.call(msg.MAY_SPILL, msg.MaySpill(partition=partition,
                                                    slots=np.asarray(slots),
                                                    fields=list(fields)))

    def set_memory(self, partition: str, memory_budget: int | None = None,
                   cold: Sequence[str] = ()) -> None:
        self._unit.call(msg.SET_MEMORY, msg.SetMemory(partition=partition,
                                                      memory_budget=memory_budget,
                                                      cold=list(cold)))

    # --- same-host abilities (``backends.shared.SharedSlabs``): a unit without shared
    # memory answers layout with {} and prepare_write with a ConfigError
    def layout(self, partition: str, fields: Sequence[str],
               writable: bool = False) -> dict[str, Any]:
        return self._unit.call(msg.LAYOUT, msg.Layout(partition=partition,
                                                      fields=list(fields),
                                                      writable=bool(writable)))

    def spans(self, partition: str, slots: np.ndarray, fields: Sequence[str],
              generations: np.ndarray | None = None) -> dict[str, Any]:
        return self._unit.call(msg.SPANS, msg.Get(partition=partition,
                                                  slots=np.asarray(slots),
                                                  fields=list(fields),
                                                  generations=_array(generations)))

    def prepare_write(self, partition: str, slots: np.ndarray, generations: np.ndarray | None,
                      fields: Mapping[str, Any],
                      arenas: Mapping[str, Any] | None = None) -> dict[str, Any]:
        return self._unit.call(msg.PREPARE_WRITE, msg.PrepareWrite(
            partition=partition, slots=slots, generations=generations, fields=dict(fields),
            arenas=dict(arenas) if arenas else None))

    def finish_write(self, partition: str, ticket: int, ok: bool = True,
                     columns: dict[str, Column] | None = None) -> None:
        self._unit.call(msg.FINISH_WRITE, msg.FinishWrite(
            partition=partition, ticket=ticket, ok=ok,
            columns=dict(columns) if columns else None))

    def nbytes(self) -> int:
        return self._unit.call(msg.NBYTES, msg.Nothing())

    def ping(self) -> msg.UnitPing:
        return self._unit.call(msg.PING, msg.Nothing())

    def save_rows(self, request: Mapping[str, Any]) -> dict[str, Any]:
        return self._unit.call(msg.SAVE_ROWS, msg.SaveRows(request=dict(request)),
                               max(self._timeout, UNIT_FILE_TIMEOUT))

    def load_rows(self, path: str, save: str, unit: int) -> dict[str, Any]:
        return self._unit.call(msg.LOAD_ROWS, msg.LoadRows(path=path, save=save, unit=unit),
                               max(self._timeout, UNIT_FILE_TIMEOUT))

    def stats(self, timeout: float | None = None) -> dict[str, Any]:
        return self._unit.call(msg.STATS, msg.Nothing(), timeout or self._timeout)

    def close(self) -> None:
        self._unit.close()
