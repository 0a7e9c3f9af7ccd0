"""SameHostUnit: a remote storage unit whose dense fields are read from shared memory."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tq_stream.backends.base import StorageUnit
from tq_stream.backends.shm import ShmReader
from tq_stream.buffers import POOL
from tq_stream.columns import Column, dtype_from_name
from tq_stream.errors import StateError

_READER = ShmReader()


class SameHostUnit(StorageUnit):
    """Writes go to the unit process; reads of dense fields copy straight out of its
    shared-memory slabs (one small ``layout`` call per read, no bytes on a socket)."""

    def __init__(self, remote: Any) -> None:
        self._remote = remote

    def put(self, partition: str, slots: np.ndarray, columns: dict[str, Column]) -> None:
        self._remote.put(partition, slots, columns)

    def get(self, partition: str, slots: np.ndarray, fields: Sequence[str]) -> dict[str, Column]:
        slots = np.asarray(slots, dtype=np.int64)
        for attempt in range(3):
            layout = self._remote._rpc.call("layout", {"partition": partition,
                                                       "fields": list(fields)})
            try:
                out = self._gather(layout, slots)
                break
            except StateError:
                if attempt == 2:
                    raise
        rest = [f for f in fields if f not in out]
        if rest:
            out.update(self._remote.get(partition, slots, rest))
        return {f: out[f] for f in fields}

    @staticmethod
    def _gather(layout: dict[str, Any], slots: np.ndarray) -> dict[str, Column]:
        out: dict[str, Column] = {}
        idx = torch.from_numpy(slots)
        for f, lay in layout.items():
            view = _READER.view(lay["shm"], dtype_from_name(lay["dtype"]), tuple(lay["shape"]))
            res = POOL.empty((len(slots), *view.shape[1:]), view.dtype)
            out[f] = torch.index_select(view, 0, idx, out=res)
        return out

    def free(self, partition: str, slots: np.ndarray) -> None:
        self._remote.free(partition, slots)

    def drop(self, partition: str) -> None:
        self._remote.drop(partition)

    def nbytes(self) -> int:
        return self._remote.nbytes()

    def ping(self) -> dict[str, Any]:
        return self._remote.ping()

    def close(self) -> None:
        self._remote.close()
