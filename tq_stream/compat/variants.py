"""One TransferQueue field, several tq_stream fields: a field keeps what each put wrote.

tq_stream fixes a field's schema at its first write, for the life of the partition.
TransferQueue stores whatever each row was given: verl's trainer puts ``index`` as an
int64 tensor and its agent loop as Python ints into one partition; NeMo-RL warms a
partition up with float32 zeros per field, clears them, then writes int64 and ragged
rows. Here a TransferQueue (logical) field ``f`` is stored as:

- ``f`` itself for the schema its first write fixed (all rows of a field written one
  way: the columnar path, unchanged);
- ``f@<schema>`` (``physical``) for rows written with another schema, e.g.
  ``index@object`` or ``x@dense int64[]``; ``f@object+tensors`` for rows of Python
  objects holding tensors (``values``).

A read of ``f`` uses the one physical field every requested row has (one lookup, one
columnar read); when rows differ it reads each group and packs the field row by row, as
TransferQueue does (``pack``; ``variant_read``). A row keeps one physical name per field:
a put that would give it a second (a row rewritten with another type) is refused, as a
process that never saw the new name would read the old value; a row that holds two all
the same (written by a process that had not seen the other name) is refused on read,
never guessed. ``Schemas`` is this process's view
of the fixed schemas: a schema once fixed never changes, so the view is only extended
(refreshed from ``stats()`` when a put is refused).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from tensordict import NonTensorStack

from tq_stream.columns import Ragged, dtype_name, flat_plain, schema_of
from tq_stream.convert import to_column
from tq_stream.forksafe import ForkSafeLock
from tq_stream.schemas import FieldSchema

if TYPE_CHECKING:
    from tq_stream.stream import Stream

SEP = "@"
ENCODED = "object+tensors"
OBJECT = FieldSchema("object").describe()


def physical(name: str, desc: str) -> str:
    return f"{name}{SEP}{desc}"


def logical(name: str) -> str:
    return name.split(SEP, 1)[0]


def describe(name: str, value: object, n: int) -> str:
    """The schema description tq_stream will fix for ``value`` (n rows)."""
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            return FieldSchema("ragged", dtype_name(value.dtype),
                               tuple(value.values().shape[1:])).describe()
        return FieldSchema("dense", dtype_name(value.dtype), tuple(value.shape[1:])).describe()
    if isinstance(value, Ragged):
        return schema_of(value).describe()
    if type(value) is list and len(value) == n and flat_plain(value):
        return OBJECT  # what to_column would make of it, without building the column
    return schema_of(to_column(name, value, n)).describe()


class Schemas:
    """This process's view of each partition's fixed field schemas (descriptions)."""

    def __init__(self) -> None:
        self._lock = ForkSafeLock()  # a DataLoader worker may fork while a thread holds it
        self._parts: dict[str, dict[str, str]] = {}

    def fixed(self, partition: str) -> dict[str, str]:
        with self._lock:
            return dict(self._parts.get(partition, {}))

    def learn(self, partition: str, fields: dict[str, str]) -> None:
        with self._lock:
            self._parts.setdefault(partition, {}).update(fields)

    def refresh(self, stream: Stream, partition: str) -> dict[str, str]:
        stats = stream.stats().get(partition)
        if stats is not None:
            self.learn(partition, dict(stats["fields"]))
        return self.fixed(partition)

    def has_variants(self, partition: str, names: list[str]) -> bool:
        want = set(names)
        return any(SEP in p and logical(p) in want for p in self.fixed(partition))

    def clear(self) -> None:
        with self._lock:
            self._parts.clear()


def names_for(fixed: dict[str, str], descs: dict[str, str], encoded: set[str]) -> dict[str, str]:
    """Logical -> physical name of each field of a put."""
    out = {}
    for name, desc in descs.items():
        if name in encoded:
            out[name] = physical(name, ENCODED)
        elif fixed.get(name, desc) == desc:
            out[name] = name
        else:
            out[name] = physical(name, desc)
    return out


def rows_of_column(value: object, n: int) -> list[Any]:
    """A read field's values one per row (tensors as per-row tensors)."""
    if isinstance(value, torch.Tensor):
        return list(value.unbind()) if n else []
    if isinstance(value, NonTensorStack):
        return value.tolist()
    return list(value) if isinstance(value, list | tuple) else [value] * n


def pack(values: list[Any]) -> torch.Tensor | NonTensorStack:
    """Per-row values as TransferQueue packs them: 0-d tensors stacked, other tensors
    as one jagged nested tensor (when their trailing dims agree), else a
    NonTensorStack of the values as written."""
    if values and all(isinstance(v, torch.Tensor) for v in values):
        if all(v.dim() == 0 for v in values):
            if len({v.dtype for v in values}) == 1:
                return torch.stack(values)
        elif len({(v.dtype, v.dim(), tuple(v.shape[1:])) for v in values}) == 1:
            return torch.nested.as_nested_tensor(values, layout=torch.jagged)
    return NonTensorStack(*values)
