"""Same-host abilities: what some storage units can do beyond ``StorageUnit``'s contract.

- ``SharedSlabs``: the unit's dense slabs and arenas live in shared memory (``ShmUnit``;
  over RPC, its client ``RemoteUnit``). A reader on its host maps them (``layout``; the
  rows of multi-ragged fields: ``spans``); a writer copies rows into them (dense, ragged
  and multi-ragged) between ``prepare_write`` and ``finish_write``
  (``tq_stream.backends.direct``).
- ``GathersInto``: a unit client that copies dense rows into tensors it is handed
  (``SameHostUnit``), so rows of several units land in one output with one copy
  (``connection.placement.load``).

A unit without an ability is used through ``put`` / ``get`` alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from tq_stream.columns import Column


@runtime_checkable
class SharedSlabs(Protocol):
    """A unit whose dense slabs a process on its host reads and writes directly."""

    def layout(self, partition: str, fields: Sequence[str],
               writable: bool = False) -> dict[str, Any]:
        """Where ``partition``'s dense ``fields`` live ({} when it keeps none shared)."""
        ...

    def spans(self, partition: str, slots: np.ndarray, fields: Sequence[str],
              generations: np.ndarray | None = None) -> dict[str, Any]:
        """Where rows of multi-ragged ``fields`` lie in shared memory ({} for none)."""
        ...

    def prepare_write(self, partition: str, slots: np.ndarray, generations: np.ndarray | None,
                      fields: Mapping[str, Sequence[Any]],
                      arenas: Mapping[str, object] | None = None) -> dict[str, Any]:
        """Ready the slabs of ``fields`` (name -> [dtype, shape]) for ``slots``, and place
        the rows of ragged ``arenas`` (``tq_stream.backends.arena_writes``)."""
        ...

    def finish_write(self, partition: str, ticket: int, ok: bool = True,
                     columns: dict[str, Column] | None = None) -> None:
        """Publish (``ok``) or abandon the rows of a ``prepare_write``'s ticket; then put
        their other fields ``columns`` (if ``ok``)."""
        ...


@runtime_checkable
class GathersInto(Protocol):
    """A unit (client) that reads dense fields into given tensors where they fit."""

    def get_into(self, partition: str, slots: np.ndarray, fields: Sequence[str],
                 generations: np.ndarray | None,
                 into: dict[str, torch.Tensor] | None) -> dict[str, Column]:
        """``get``, with ``into[f]`` (rows by slot order) as the destination of field f."""
        ...
