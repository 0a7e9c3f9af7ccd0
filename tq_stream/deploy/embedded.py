"""Embedded deployment: controller and memory storage units in this process."""

from __future__ import annotations

from typing import Any

import numpy as np

from tq_stream.backends.memory import MemoryUnit
from tq_stream.controller import Controller
from tq_stream.deploy import snapshot


class EmbeddedBackend:
    """Owns an in-process Controller and ``n_units`` MemoryUnits."""

    def __init__(self, n_units: int = 1, restore: str | None = None) -> None:
        self._units = [MemoryUnit() for _ in range(n_units)]
        self._ctrl = Controller(n_units, free=self._free)
        if restore is not None:
            snapshot.restore(restore, self._ctrl, self._units)

    def _free(self, unit: int, partition: str, slots: np.ndarray) -> None:
        self._units[unit].free(partition, slots)

    def controller(self) -> Controller:
        return self._ctrl

    def units(self) -> list[Any]:
        return self._units

    def save(self, path: str) -> None:
        snapshot.save(path, self._ctrl, self._units)

    def close(self) -> None:
        self._ctrl.close()
        for u in self._units:
            u.close()
