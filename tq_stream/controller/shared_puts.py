"""``reserve_shared``: the controller's side of a shared put (``Writer.put_shared``).

Checked under the lock first (field clashes, bytes already stored under a key),
then placed by the controller's own ``reserve`` (so a served controller grants the
slots as for any put), then claimed under the lock: the digests are recorded at
once, so a concurrent put of other bytes is refused before it stores any.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from tq_stream.checks import check_keys
from tq_stream.controller.partition import PartitionMeta, parse_schemas
from tq_stream.controller.shared_entries import entry_key
from tq_stream.errors import ConfigError
from tq_stream.messages.puts import Placement

PartOf = Callable[[str], PartitionMeta]
Reserve = Callable[..., Placement]
Abort = Callable[[str, Any, Any], None]


def check_digests(digests: object, keys: Sequence[str],
                  schemas: Mapping[str, Any]) -> list[dict[str, str]]:
    """Per key, one str digest per field of the put."""
    if isinstance(digests, list | tuple) and len(digests) == len(keys) and all(
            isinstance(d, Mapping) and set(d) == set(schemas)
            and all(isinstance(v, str) and v for v in d.values()) for d in digests):
        return [dict(d) for d in digests]
    raise ConfigError(f"digests must hold, for each of the {len(keys)} keys, a str per field "
                      f"of the put {sorted(schemas)}, got {digests!r:.120}")


def reserve_shared(lock: threading.Condition, part_of: PartOf, reserve: Reserve,
                   abort: Abort, partition: str, keys: Sequence[str],
                   schemas: Mapping[str, Any], digests: Sequence[Mapping[str, str]],
                   nbytes: Sequence[int], place: Mapping[str, Any]) -> Placement:
    """Place the shared entries ``keys`` whose fields are not all stored yet.

    Returns:
        ``reserve``'s reply for the entries to store (none if every entry holds these
        bytes already), plus ``pos`` (their positions in ``keys``).
    Raises:
        ConfigError: a field was stored with other bytes; SchemaError: a field is a
        field of the partition's rows.
    """
    keys = check_keys(list(keys))
    digests_ = check_digests(digests, keys, schemas)
    if len(nbytes) != len(keys):
        raise ConfigError(f"nbytes must give one count per key, got {len(nbytes)} for "
                          f"{len(keys)} keys")
    schemas_ = parse_schemas(schemas)
    names = [entry_key(k) for k in keys]
    with lock:
        part = part_of(partition)
        part.shared.check_fields(part, names, schemas_)
        pos = [i for i, k in enumerate(keys) if part.shared.to_write(part, k, digests_[i])]
    if not pos:
        none = np.zeros(0, dtype=np.int64)
        return Placement(index=none, unit=none, slot=none, generation=none,
                         new=np.zeros(0, dtype=bool), schemas={}, pos=[])
    out = reserve(partition, [names[i] for i in pos], schemas, **place)
    try:
        with lock:
            part = part_of(partition)
            for j, i in enumerate(pos):
                part.shared.claim(part, int(out.index[j]), int(out.generation[j]),
                                  keys[i], digests_[i], int(nbytes[i]))
    except BaseException:
        new = out.new
        if new.any():
            abort(partition, out.index[new], out.generation[new])
        raise
    out.pos = pos
    return out


__all__ = ["check_digests", "reserve_shared"]
