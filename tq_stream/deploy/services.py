"""The handlers served over zmq: a storage unit and the controller.

Each exposes an explicit ``RPC_METHODS`` allowlist; arguments and results are
plain data, numpy arrays and normalized columns (see ``tq_stream.columns``),
all carried by ``tq_stream.serialization`` without pickle.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from tq_stream.backends.base import StorageUnit
from tq_stream.controller import Controller
from tq_stream.errors import ConfigError, StateError
from tq_stream.samplers.spec import from_spec


def host_id() -> str:
    """Identifies this machine: clients with the same id may use shared memory."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class UnitService:
    """Serves one StorageUnit (plus a liveness probe)."""

    RPC_METHODS = frozenset({"put", "get", "free", "drop", "nbytes", "ping", "layout"})

    def __init__(self, unit: StorageUnit) -> None:
        self.unit = unit

    def put(self, partition: str, slots: Any, columns: dict[str, Any]) -> None:
        self.unit.put(partition, np.asarray(slots, dtype=np.int64), columns)

    def get(self, partition: str, slots: Any, fields: Sequence[str]) -> dict[str, Any]:
        return self.unit.get(partition, np.asarray(slots, dtype=np.int64), list(fields))

    def free(self, partition: str, slots: Any) -> None:
        self.unit.free(partition, np.asarray(slots, dtype=np.int64))

    def drop(self, partition: str) -> None:
        self.unit.drop(partition)

    def nbytes(self) -> int:
        return self.unit.nbytes()

    def layout(self, partition: str, fields: Sequence[str]) -> dict[str, Any]:
        """Shared-memory layout of fields (empty when the unit has none)."""
        fn = getattr(self.unit, "layout", None)
        return {} if fn is None else fn(partition, list(fields))

    def ping(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "host": host_id(), "nbytes": self.unit.nbytes()}


class ControllerService(Controller):
    """The Controller, plus what a remote deployment needs around it.

    ``units`` are RPC clients of the storage units, attached once they are up;
    samplers arrive as specs (``tq_stream.samplers.spec``).
    """

    RPC_METHODS = Controller.RPC_METHODS | frozenset({
        "attach_units", "units", "ping", "state_dict", "load_state_dict"})

    def __init__(self, n_units: int, sampler_modules: Sequence[str] = (),
                 unit_client: Any = None) -> None:
        super().__init__(n_units, free=self._free_remote)
        self._unit_addresses: list[dict[str, Any]] = []
        self._unit_clients: list[Any] = []
        self._make_client = unit_client
        self._sampler_modules = tuple(sampler_modules)
        self._attached = threading.Event()

    def _free_remote(self, unit: int, partition: str, slots: np.ndarray) -> None:
        self._unit_clients[unit].call("free", {"partition": partition, "slots": slots})

    def attach_units(self, units: list[dict[str, Any]]) -> None:
        """Record the units' addresses (``[{"address", "host", "pid"}, ...]``)."""
        if len(units) != self.n_units:
            raise ConfigError(f"units must list {self.n_units} storage units, got {len(units)}")
        self._unit_addresses = list(units)
        self._unit_clients = [self._make_client(u["address"]) for u in units]
        self._attached.set()

    def units(self) -> list[dict[str, Any]]:
        if not self._attached.wait(timeout=30.0):
            raise StateError("storage units must attach within 30 s of the controller start")
        return self._unit_addresses

    def ping(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "host": host_id(), "units": len(self._unit_addresses)}

    def register_task(self, partition: str, task: str, fields: Sequence[str], batch_size: int,
                      dp_size: int = 1, replicas: int = 1, lease_timeout: float = 300.0,
                      drop_last: bool = False, sampler: Any = None) -> None:
        if isinstance(sampler, dict):
            sampler = from_spec(sampler, self._sampler_modules)
        super().register_task(partition, task, fields, batch_size, dp_size, replicas,
                              lease_timeout, drop_last, sampler)
