"""Storage kinds: the one table every deployment takes its storage units from.

``storage=`` (an option of ``tq.init`` in every mode) names a kind, and each storage
unit of the deployment is ``KINDS[storage]()``. A new backend is one ``StorageUnit``
class plus one line in ``KINDS``.

A kind added at run time (``KINDS["mine"] = MineUnit``) reaches the units made in this
process (embedded mode) and in children forked from it (local mode's default
``start_method``); spawned children and Ray actors import this module afresh and know
the kinds written here.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial

from tq_stream.backends.base import StorageUnit
from tq_stream.backends.memory import MemoryUnit
from tq_stream.backends.shm import ShmUnit
from tq_stream.errors import ConfigError

# Segments of emptied partitions a shm unit keeps for their next rows: streaming
# consumers that keep up empty a partition after nearly every row.
SHM_KEEP_BYTES = 16 << 20

KINDS: dict[str, Callable[..., StorageUnit]] = {
    "memory": MemoryUnit,  # rows on the unit's heap; clients read them through the unit
    "shm": partial(ShmUnit, keep_bytes=SHM_KEEP_BYTES),  # dense slabs in /dev/shm,
    # mapped by readers and writers on the unit's host (``backends.shared.SharedSlabs``)
}


def check_storage(storage: object) -> str:
    """``storage`` if it names a kind of ``KINDS``, else ConfigError."""
    if not isinstance(storage, str) or storage not in KINDS:
        raise ConfigError(f"storage must be one of {sorted(KINDS)}, got {storage!r}")
    return storage


def make_unit(storage: str, spill_dir: str | None = None) -> StorageUnit:
    """A new, empty storage unit of kind ``storage`` (``spill_dir``: the folder its
    spilled rows go under, ``tq_stream.backends.spill``; a kind taking none gets none)."""
    kind = KINDS[check_storage(storage)]
    if spill_dir and "spill_dir" in inspect.signature(kind).parameters:
        return kind(spill_dir=spill_dir)
    return kind()


def storage_or_shm(storage: str | None, shm: bool | None) -> str:
    """The kind a server deployment's units take: ``storage``, or what the older
    ``shm`` flag means (True: "shm", False: "memory"); "shm" when neither is given."""
    if shm is None:
        return check_storage("shm" if storage is None else storage)
    meant = "shm" if shm else "memory"
    if storage is not None and check_storage(storage) != meant:
        raise ConfigError(f"shm must agree with storage when both are given (shm={shm} "
                          f"means storage={meant!r}), got storage={storage!r}")
    return meant
