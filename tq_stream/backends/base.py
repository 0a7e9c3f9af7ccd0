"""The storage unit contract: column bytes by (partition, slot), nothing else.

A storage unit knows nothing of keys, readiness, tasks or sampling: the
controller assigns every row a slot in one unit, and the unit stores the row's
field values there. Values arrive and leave as normalized columns
(see ``tq_stream.columns``). Every backend passes ``tests/backend_contract.py``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

import numpy as np

from tq_stream.columns import Column


class StorageUnit(ABC):
    """Holds the field values of rows, addressed by ``(partition, slot)``.

    Invariants every implementation keeps:

    - ``put`` of a field for slots writes exactly those rows; other rows and
      other fields of the same rows are untouched.
    - ``get`` returns rows in the order of ``slots``; the result does not
      alias storage that a later ``put``/``free`` may overwrite.
    - ``free`` makes slots reusable; freed rows are never returned again.
    - ``drop`` of a partition returns all of its memory.
    """

    @abstractmethod
    def put(self, partition: str, slots: np.ndarray, columns: Mapping[str, Column]) -> None:
        """Write ``columns[f][i]`` into slot ``slots[i]`` of field ``f``."""

    @abstractmethod
    def get(self, partition: str, slots: np.ndarray, fields: Sequence[str]) -> dict[str, Column]:
        """Read ``fields`` of ``slots``, in order."""

    @abstractmethod
    def free(self, partition: str, slots: np.ndarray) -> None:
        """Release ``slots`` of every field of ``partition``."""

    @abstractmethod
    def drop(self, partition: str) -> None:
        """Forget ``partition`` and return its memory."""

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes currently held for row data (allocated capacity)."""

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release every resource; idempotent."""
