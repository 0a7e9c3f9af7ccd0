"""``KVBatchMeta`` and ``BatchMeta``: TransferQueue 0.1.11's metadata classes, as verl uses them.

``KVBatchMeta`` names rows by key (what ``kv_batch_put`` returns and verl's trainer
passes around as its batch); ``BatchMeta`` names rows by their position in the
controller (``global_indexes``), which verl's worker-group bridge splits and joins.
Neither touches the deployment; the module functions and the client do.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tq_stream.columns import flat_plain


def copied_tags(tags: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A deep copy of ``tags``; when every one is a flat dict of scalars (what tags
    are), one C-level dict copy each instead of ``deepcopy``'s walk."""
    rows = list(tags)
    if set(map(type, rows)) == {dict} and flat_plain(rows):
        return [dict(t) for t in rows]
    return copy.deepcopy(rows)


@dataclass
class KVBatchMeta:
    """Keys, their tags, the partition and the stored fields of a batch.

    Raises:
        ValueError: ``keys`` and ``tags`` differ in length, or a key or field repeats.
    """

    keys: list[str] = dataclasses.field(default_factory=list)
    tags: list[dict[str, Any]] = dataclasses.field(default_factory=list[Any])
    partition_id: str | None = None
    fields: list[str] | None = None
    extra_info: dict[str, Any] | None = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.tags):
            raise ValueError(f"keys and tags must have the same length, got {len(self.keys)} "
                             f"and {len(self.tags)}")
        if len(set(self.keys)) != len(self.keys):
            raise ValueError(f"keys must be distinct, got duplicates in {self.keys[:8]}")
        if self.fields is not None and len(set(self.fields)) != len(self.fields):
            raise ValueError(f"fields must be distinct, got {self.fields}")
        self.keys = list(self.keys)
        self.tags = copied_tags(self.tags)
        self.extra_info = copy.deepcopy(self.extra_info)

    @property
    def size(self) -> int:
        return len(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def __str__(self) -> str:
        return f"KVBatchMeta(size={self.size}, field_names={self.fields}, " \
               f"extra_info={self.extra_info})"

    def select_keys(self, keys_to_select: list[str]) -> KVBatchMeta:
        """A new batch of ``keys_to_select`` (which must all be in this one)."""
        if len(set(keys_to_select)) != len(keys_to_select):
            raise ValueError(f"keys_to_select must be distinct, got {keys_to_select[:8]}")
        pos = {k: i for i, k in enumerate(self.keys)}
        missing = [k for k in keys_to_select if k not in pos]
        if missing:
            raise RuntimeError(f"keys_to_select must be in this batch, missing {missing[:5]}")
        return KVBatchMeta(keys=list(keys_to_select),
                           tags=[self.tags[pos[k]] for k in keys_to_select],
                           partition_id=self.partition_id, fields=self.fields,
                           extra_info=self.extra_info)

    def reorder(self, indexes: list[int]) -> None:
        """Put the rows in the order ``indexes`` (in place)."""
        _check_permutation(indexes, self.size)
        self.keys = [self.keys[i] for i in indexes]
        self.tags = [self.tags[i] for i in indexes]

    def chunk(self, chunks: int) -> list[KVBatchMeta]:
        """``chunks`` consecutive parts, the first ones one row longer when uneven."""
        return [KVBatchMeta(keys=self.keys[a:b], tags=self.tags[a:b],
                            partition_id=self.partition_id, fields=self.fields,
                            extra_info=self.extra_info)
                for a, b in _bounds(self.size, chunks)]

    @classmethod
    def concat(cls, data: list[KVBatchMeta]) -> KVBatchMeta:
        """One batch of ``data``'s rows (same partition and fields; extra_info must agree)."""
        data = [d for d in data if d is not None and d.size > 0]
        if not data:
            return cls()
        base = data[0]
        for d in data[1:]:
            if d.partition_id != base.partition_id:
                raise ValueError(f"partition_id must match to concat, got {base.partition_id!r} "
                                 f"and {d.partition_id!r}")
            if d.fields is not None and base.fields is not None \
                    and set(d.fields) != set(base.fields):
                raise ValueError(f"fields must match to concat, got {base.fields} and {d.fields}")
        return cls(keys=[k for d in data for k in d.keys], tags=[t for d in data for t in d.tags],
                   partition_id=base.partition_id, fields=base.fields,
                   extra_info=_merge_extra([d.extra_info for d in data]) or None)


class BatchMeta:
    """Rows named by ``(partition_ids[i], global_indexes[i])`` plus their fields.

    ``BatchMeta()`` with no argument is an empty batch (TransferQueue raises there;
    verl's bridge builds one on ranks that collect nothing).
    """

    def __init__(self, global_indexes: list[int] | None = None,
                 partition_ids: list[str] | None = None,
                 field_schema: dict[str, dict[str, Any]] | None = None,
                 extra_info: dict[str, Any] | None = None,
                 custom_meta: list[dict[str, Any]] | None = None,
                 keys: list[str] | None = None) -> None:
        self.global_indexes = [int(i) for i in (global_indexes or [])]
        self.partition_ids = list(partition_ids or [])
        if len(self.global_indexes) != len(self.partition_ids):
            raise ValueError(f"global_indexes and partition_ids must have the same length, got "
                             f"{len(self.global_indexes)} and {len(self.partition_ids)}")
        n = len(self.global_indexes)
        self.field_schema = {k: dict(v) for k, v in (field_schema or {}).items()}
        self.extra_info = dict(extra_info or {})
        self.custom_meta = [dict(d) for d in custom_meta] if custom_meta else [{} for _ in range(n)]
        self.keys = list(keys) if keys is not None else None  # known keys (saves a lookup)
        if len(self.custom_meta) != n or (self.keys is not None and len(self.keys) != n):
            raise ValueError(f"custom_meta and keys must have {n} entries (one per row)")

    @property
    def size(self) -> int:
        return len(self.global_indexes)

    def __len__(self) -> int:
        return self.size

    @property
    def field_names(self) -> list[str]:
        return sorted(self.field_schema)

    @property
    def is_ready(self) -> bool:
        return self.size > 0

    def get_all_custom_meta(self) -> list[dict[str, Any]]:
        return copy.deepcopy(self.custom_meta)

    def update_custom_meta(self, custom_meta: list[dict[str, Any]]) -> None:
        if custom_meta is None:
            return
        if len(custom_meta) != self.size:
            raise ValueError(f"custom_meta must have {self.size} entries, got {len(custom_meta)}")
        for mine, new in zip(self.custom_meta, custom_meta, strict=True):
            mine.update(new)

    def select_samples(self, sample_indices: Sequence[int]) -> BatchMeta:
        idx = list(sample_indices)
        return BatchMeta([self.global_indexes[i] for i in idx],
                         [self.partition_ids[i] for i in idx],
                         copy.deepcopy(self.field_schema), copy.deepcopy(self.extra_info),
                         [copy.deepcopy(self.custom_meta[i]) for i in idx],
                         None if self.keys is None else [self.keys[i] for i in idx])

    def select_fields(self, field_names: list[str]) -> BatchMeta:
        """The same rows with only those of ``field_names`` this batch has."""
        out = self.select_samples(range(self.size))
        out.field_schema = {f: out.field_schema[f] for f in field_names if f in out.field_schema}
        return out

    def copy(self) -> BatchMeta:
        return self.select_samples(range(self.size))

    def __getitem__(self, item: int | slice) -> BatchMeta:
        if isinstance(item, slice):
            return self.select_samples(range(*item.indices(self.size)))
        i = int(item) + (self.size if int(item) < 0 else 0)
        if not 0 <= i < self.size:
            raise IndexError(f"BatchMeta index must be in [0, {self.size}), got {item}")
        return self.select_samples([i])

    def chunk(self, chunks: int) -> list[BatchMeta]:
        return [self.select_samples(range(a, b)) for a, b in _bounds(self.size, chunks)]

    def reorder(self, indices: list[int]) -> None:
        _check_permutation(indices, self.size)
        moved = self.select_samples(indices)
        self.global_indexes, self.partition_ids = moved.global_indexes, moved.partition_ids
        self.custom_meta, self.keys = moved.custom_meta, moved.keys

    @classmethod
    def concat(cls, data: list[BatchMeta], validate: bool = True) -> BatchMeta:
        """One batch of ``data``'s rows (same fields when ``validate``)."""
        data = [d for d in data if d is not None and d.size > 0]
        if not data:
            return cls()
        names = data[0].field_names
        if validate and any(d.field_names != names for d in data):
            raise ValueError(f"field names must match to concat, got "
                             f"{[d.field_names for d in data]}")
        keys = None if any(d.keys is None for d in data) else \
            [k for d in data for k in d.keys or ()]
        return cls([i for d in data for i in d.global_indexes],
                   [p for d in data for p in d.partition_ids],
                   copy.deepcopy(data[0].field_schema),
                   _merge_extra([d.extra_info for d in data]),
                   [copy.deepcopy(m) for d in data for m in d.custom_meta], keys)

    @classmethod
    def empty(cls, extra_info: dict[str, Any] | None = None) -> BatchMeta:
        return cls(extra_info=extra_info)

    def __str__(self) -> str:
        return f"BatchMeta(size={self.size}, field_names={self.field_names}, " \
               f"global_indexes={self.global_indexes}, extra_info={self.extra_info})"

    __repr__ = __str__


def _bounds(n: int, chunks: int) -> list[tuple[int, int]]:
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive int, got {chunks!r}")
    base, extra = divmod(n, chunks)
    out, start = [], 0
    for i in range(chunks):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def _check_permutation(indexes: list[int], n: int) -> None:
    if len(indexes) != n or sorted(indexes) != list(range(n)):
        raise ValueError(f"indexes must be a permutation of range({n}), got {list(indexes)[:8]}")


def _merge_extra(infos: list[dict[str, Any] | None]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for info in infos:
        for k, v in (info or {}).items():
            if k in out and not _same(out[k], v):
                raise ValueError(f"extra_info[{k!r}] must agree across the batches to concat")
            out.setdefault(k, v)
    return copy.deepcopy(out)


def _same(a: Any, b: Any) -> bool:
    try:
        import torch

        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) \
                and a.shape == b.shape and bool((a == b).all())
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values that cannot be compared differ
        return a is b
