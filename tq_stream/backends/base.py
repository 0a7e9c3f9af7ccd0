"""The storage unit contract: column bytes by (partition, slot), nothing else.

A storage unit knows nothing of keys, readiness, tasks or sampling: the
controller assigns every row a slot in one unit, and the unit stores the row's
field values there. Values arrive and leave as normalized columns
(see ``tq_stream.columns``). Every backend passes ``tests/helpers/backend_contract.py``.

Slots are reused after rows are freed. Callers that know which rows they mean
pass ``generations`` (one ``occupancy`` token per slot): a put records them, a
get checks them and raises StateError for a slot that no longer holds the row
(cleared, and perhaps reused by a newer row) instead of returning its bytes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from tq_stream.columns import Column
from tq_stream.errors import ConfigError


def occupancy(index: np.ndarray, generation: np.ndarray) -> np.ndarray:
    """The token of rows ``index`` at ``generation`` (``BatchMeta`` fields).

    Unique within a partition for every (row index, generation) pair, so it
    names one occupancy of a storage slot: the controller's generation alone
    counts reuses of a row *index*, while a slot may pass to another index.
    """
    gen = np.asarray(generation, dtype=np.int64)
    return (gen << 32) | np.asarray(index, dtype=np.int64)


class StorageUnit(ABC):
    """Holds the field values of rows, addressed by ``(partition, slot)``.

    Invariants every implementation keeps:

    - ``put`` of a field for slots writes exactly those rows; other rows and
      other fields of the same rows are untouched.
    - ``get`` returns rows in the order of ``slots``; the result does not
      alias storage that a later ``put``/``free`` may overwrite.
    - ``free`` makes slots reusable; freed rows are never returned again.
    - ``drop`` of a partition returns all of its memory.
    - ``get`` with ``generations`` never returns a value written under another
      token than ``generations[i]`` for slot ``slots[i]`` (StateError instead).
    """

    @abstractmethod
    def put(self, partition: str, slots: np.ndarray, columns: Mapping[str, Column],
            generations: np.ndarray | None = None) -> None:
        """Write ``columns[f][i]`` into slot ``slots[i]`` of field ``f``; the slots now
        hold the rows of tokens ``generations`` (None: no token, unreadable with one)."""

    @abstractmethod
    def get(self, partition: str, slots: np.ndarray, fields: Sequence[str],
            generations: np.ndarray | None = None) -> dict[str, Column]:
        """Read ``fields`` of ``slots``, in order; with ``generations``, raise StateError
        unless every slot still holds the row of its token."""

    @abstractmethod
    def free(self, partition: str, slots: np.ndarray) -> None:
        """Release ``slots`` of every field of ``partition``."""

    @abstractmethod
    def drop(self, partition: str) -> None:
        """Forget ``partition`` and return its memory."""

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes currently held for row data (allocated capacity)."""

    def collect(self, request: Mapping[str, Any], chunk_bytes: int) -> Iterator[
            tuple[str, np.ndarray, np.ndarray, dict[str, tuple[np.ndarray, Column, np.ndarray]]]]:
        """The rows a checkpoint request names that still hold their tokens, about
        ``chunk_bytes`` of them at a time: ``(partition, slots, tokens, {field: (slots,
        column, on disk)})`` per chunk (``on disk``: a bool per slot, rows that spilled),
        each copied only when asked for (see
        ``tq_stream.backends.unit_files``); units that keep bytes implement it."""
        raise NotImplementedError(f"{type(self).__name__} cannot write checkpoints")

    def save_rows(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """Write this unit's checkpoint file, one chunk of rows in memory at a time;
        returns the skipped slots per partition."""
        from tq_stream.backends import unit_files

        return unit_files.write(request, self.collect(request, unit_files.CHUNK_BYTES),
                                self.memory_settings())

    def load_rows(self, path: str, save: str, unit: int) -> dict[str, Any]:
        """Check and store the rows of this unit's checkpoint file ``path`` (all or none),
        one chunk in memory at a time; returns ``{partition: [slots, tokens]}``."""
        from tq_stream.backends import unit_files

        return unit_files.load(self, path, save, unit)

    def set_memory(self, partition: str, memory_budget: int | None = None,
                   cold: Sequence[str] = ()) -> None:
        """Bound the bytes of ``partition``'s column values held in memory to
        ``memory_budget`` (None: as it was; unbounded at first) and keep the fields
        ``cold`` on local disk (added to those marked before; see
        ``tq_stream.backends.spill``). A unit that cannot spill refuses both, never
        ignores them."""
        if memory_budget is not None or list(cold):
            raise ConfigError(f"memory_budget and cold need a storage unit that spills "
                              f"(storage 'memory' or 'shm'), not {type(self).__name__}")

    def put_spilled(self, partition: str, slots: np.ndarray, columns: Mapping[str, Column],
                    generations: np.ndarray | None = None) -> None:
        """``put`` of rows a checkpoint had spilled: a unit that spills writes them to
        disk (a restore does not bring them back into memory); others ``put`` them."""
        self.put(partition, slots, columns, generations)

    def may_spill(self, partition: str, slots: np.ndarray, fields: Sequence[str]) -> None:  # noqa: B027
        """Advice from the controller: ``fields`` of ``slots`` hold rows every declared
        reader of the field finished (the rows live on for other consumers). A unit that
        spills may move them to disk; a get still returns them. The default keeps them."""

    def memory_settings(self) -> dict[str, dict[str, Any]]:
        """Every ``set_memory`` in force: ``{partition: {"budget", "cold"}}`` (a save
        keeps them, a restore sets them again before it stores a row)."""
        return {}

    def stats(self) -> dict[str, Any]:
        """What this unit holds: ``{"nbytes": int, "partitions": {partition: {"rows": int,
        "fields": {field: bytes in memory}, "spilled": bytes on disk, "budget": bytes or
        None}}}`` (a backend without a breakdown reports none)."""
        return {"nbytes": self.nbytes(), "partitions": {}}

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release every resource; idempotent."""


@runtime_checkable
class ListsRows(Protocol):
    """A unit that lists the rows it holds (``MemoryUnit``): what a restarted controller
    reconciles its checkpoint with. A unit without it is taken to hold none."""

    def held(self) -> dict[str, dict[str, np.ndarray]]:
        """Every partition's written slots and their tokens (``{"slots", "tokens"}``)."""
        ...
