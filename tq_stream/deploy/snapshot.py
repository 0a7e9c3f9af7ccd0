"""Checkpoints of a whole deployment: controller metadata plus every stored row.

The file is written by ``tq_stream.serialization.dump`` (a msgpack header and
raw tensor buffers, written atomically); nothing is pickled.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tq_stream import serialization
from tq_stream.backends.base import occupancy
from tq_stream.errors import ConfigError

FORMAT = 1


def save(path: str, controller: Any, units: Sequence[Any]) -> None:
    """Write ``controller``'s state and the rows it references to ``path``."""
    state = controller.state_dict()
    data = []
    for name, part in state["partitions"].items():
        unit_of, slot_of = np.asarray(part["unit"]), np.asarray(part["slot"])
        for field, ready in part["ready"].items():
            ready = np.asarray(ready, dtype=bool)
            for u in np.unique(unit_of[ready]).tolist():
                sel = ready & (unit_of == u)
                slots = slot_of[sel]
                column = units[u].get(name, slots, [field])[field]
                data.append({"partition": name, "field": field, "unit": u,
                             "slots": slots, "column": column})
    serialization.dump({"format": FORMAT, "controller": state, "data": data}, path)


def restore(path: str, controller: Any, units: Sequence[Any]) -> None:
    """Load a checkpoint written by ``save`` into an empty deployment."""
    snap = serialization.load(path)
    if not isinstance(snap, dict) or snap.get("format") != FORMAT:
        raise ConfigError(f"restore must name a tq_stream checkpoint of format {FORMAT}, "
                          f"got {path!r}")
    controller.load_state_dict(snap["controller"])
    tokens = _tokens(snap["controller"]["partitions"])
    for entry in snap["data"]:
        u = int(entry["unit"])
        if u >= len(units):
            raise ConfigError(f"storage_units must be > {u} to restore {path!r}, "
                              f"got {len(units)}")
        slots = np.asarray(entry["slots"], dtype=np.int64)
        units[u].put(entry["partition"], slots, {entry["field"]: entry["column"]},
                     tokens[entry["partition"], u][slots])


def _tokens(partitions: dict[str, Any]) -> dict[tuple[str, int], np.ndarray]:
    """Per (partition, unit): the occupancy token of each slot of the restored rows."""
    out: dict[tuple[str, int], np.ndarray] = {}
    for name, part in partitions.items():
        rows = np.asarray(part["rows"], dtype=np.int64)
        unit, slot = np.asarray(part["unit"]), np.asarray(part["slot"], dtype=np.int64)
        token = occupancy(rows, np.asarray(part["generation"], dtype=np.int64)[rows])
        for u in np.unique(unit).tolist():
            sel = unit == u
            table = np.full(int(slot[sel].max()) + 1, -1, dtype=np.int64)
            table[slot[sel]] = token[sel]
            out[name, u] = table
    return out
