"""Embedded deployment: the controller and the storage units in this process."""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn

import numpy as np

from tq_stream.backends.kinds import make_unit
from tq_stream.backends.spill import check_spill_dir
from tq_stream.controller import Controller
from tq_stream.deploy import snapshot
from tq_stream.errors import StateError

if TYPE_CHECKING:
    from tq_stream.backends.base import StorageUnit
    from tq_stream.connection.spares import SparePool


class EmbeddedBackend:
    """Owns an in-process Controller and ``n_units`` storage units (a ``Backend`` of a
    ``Connection``, and the ``Owner`` of its Stream).

    Args:
        n_units: storage units.
        restore: a checkpoint folder to start from (``tq.init``'s ``restore``).
        storage: the units' kind (``tq_stream.backends.kinds.KINDS``), "memory" by default.
        spill_dir: the folder spilled rows go under (``backends/spill.py``; default the
            system's temporary folder), each unit's files removed when it closes.
    """

    address: str | None = None  # nothing to connect to from elsewhere
    curve_server_key: bytes | None = None

    def __init__(self, n_units: int = 1, restore: str | None = None,
                 storage: str = "memory", spill_dir: str | None = None) -> None:
        spill_dir = check_spill_dir(spill_dir)
        self._units: list[StorageUnit] = [make_unit(storage, spill_dir)
                                          for _ in range(n_units)]
        self._ctrl = Controller(n_units, free=self._free, may_spill=self._may_spill)
        if restore is not None:
            snapshot.restore(restore, self._ctrl, self._units)

    def _free(self, unit: int, partition: str, slots: np.ndarray) -> None:
        self._units[unit].free(partition, slots)

    def _may_spill(self, unit: int, partition: str, slots: np.ndarray,
                   fields: list[str]) -> None:
        self._units[unit].may_spill(partition, slots, fields)

    def controller(self) -> Controller:
        return self._ctrl

    def units(self) -> list[StorageUnit]:
        return self._units

    def spares(self, partition: str, unit: int) -> SparePool | None:
        return None  # in process a put is as cheap without them

    def preferred_unit(self) -> int:
        return -1  # every unit is here

    def save(self, path: str) -> None:
        snapshot.save(path, self._ctrl, self._units)

    def close(self) -> None:
        self._ctrl.close()
        for u in self._units:
            u.close()

    def __reduce__(self) -> NoReturn:
        raise StateError(
            "an embedded stream must not be pickled (its controller lives in this "
            "process); use tq.init(mode='local') to share a stream across processes"
        )
