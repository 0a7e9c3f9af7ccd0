"""BatchMeta: which rows a batch holds, where their bytes live, and their tags."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from tq_stream.errors import ConfigError
from tq_stream.messages.reads import Found, StepMeta
from tq_stream.schemas import FieldSchema
from tq_stream.shared_refs import SharedRefs

_INT64 = np.dtype(np.int64)
_INT32 = np.dtype(np.int32)


def _int_array(values: Any, dtype: np.dtype = _INT64) -> np.ndarray:
    """``values`` as a read-only array of ``dtype``. Decoded from a reply they mostly
    are one already (views of the received bytes); in embedded mode an array may be the
    controller's own (a step's share), so a writable one is handed out as a read-only
    view: a caller cannot change controller state through a BatchMeta."""
    array: np.ndarray = values
    if type(values) is not np.ndarray or values.dtype is not dtype:
        array = np.asarray(values, dtype=dtype)
    elif not values.flags.writeable:
        return array
    out: np.ndarray = array.view()
    out.flags.writeable = False
    return out


@dataclass(frozen=True)
class BatchMeta:
    """The rows of one batch (a step's share, or a KV lookup).

    Attributes:
        partition: the partition the rows live in.
        keys: the rows' user keys, in batch order.
        index: int64 row indexes in the controller.
        generation: int64 reuse counters of those indexes (stale-handle check).
        unit, slot: where each row's bytes live (storage unit, slot in the unit).
        tags: one dict of tags per row.
        fields: the fields this batch is about.
        schemas: the schema of each of ``fields``.
        task, step, dp_rank: the consumer step this batch belongs to ("" / -1 if none).
        replica: which TP/PP peer of ``dp_rank`` read it (acks count per replica).
        session: the consumer session holding the lease (its heartbeat renews it).
        end: True for the end-of-stream marker (no rows).
        lost: True for an empty batch whose whole share was lost with its storage unit
            (counted ``unit_lost``): nothing to train, go on with the next step.
        turn: the consumer version a step's share is within its sampler's staleness
            bound for (None: no bound); a loader whose version is newer when it yields
            the batch asks for the step again (``datasets/at_yield.py``).
        shared: the shared entries the rows read shared fields from (None: no shared
            field among ``fields``); see ``shared_refs.py``.

    A BatchMeta is frozen, and ``index``, ``generation``, ``unit`` and ``slot`` are
    read-only arrays (``select`` and ``chunk`` build new ones).

    Example:
        >>> meta = client.get_meta("train", "actor", step=0)
        >>> first, second = meta.chunk(2)
    """

    partition: str
    keys: tuple[str, ...]
    index: np.ndarray
    generation: np.ndarray
    unit: np.ndarray
    slot: np.ndarray
    tags: tuple[dict[str, Any], ...] = ()
    fields: tuple[str, ...] = ()
    schemas: Mapping[str, FieldSchema] = field(default_factory=dict)
    task: str = ""
    step: int = -1
    dp_rank: int = 0
    replica: int = 0
    session: str = ""
    end: bool = False
    turn: int | None = None
    lost: bool = False
    shared: SharedRefs | None = None

    def __len__(self) -> int:
        return len(self.keys)

    @staticmethod
    def from_reply(reply: Found, session: str = "") -> BatchMeta:
        """The BatchMeta of a ``lookup``, ``locate`` or ``get_meta`` reply (``session``:
        the reading session)."""
        keys = reply.keys
        fields: dict[str, Any] = {
            "partition": reply.partition, "keys": tuple(keys),
            "index": _int_array(reply.index), "generation": _int_array(reply.generation),
            "unit": _int_array(reply.unit, _INT32), "slot": _int_array(reply.slot),
            "tags": tuple(reply.tags or [{} for _ in keys]),
            "fields": tuple(reply.fields),
            "schemas": {f: FieldSchema.from_dict(s) for f, s in reply.schemas.items()},
            "session": session, "shared": SharedRefs.from_reply(reply.shared),
        }
        if isinstance(reply, StepMeta):
            fields.update(task=reply.task, step=int(reply.step), dp_rank=int(reply.dp_rank),
                          replica=int(reply.replica), end=bool(reply.end),
                          turn=None if reply.turn is None else int(reply.turn),
                          lost=bool(reply.lost))
        else:
            fields.update(task="", step=-1, dp_rank=0, replica=0, end=False, turn=None,
                          lost=False)
        # Every field at once: the frozen dataclass's __init__ sets them one by one
        # through object.__setattr__, a cost each consumer's every batch pays.
        meta = object.__new__(BatchMeta)
        meta.__dict__.update(fields)
        return meta

    def select(self, positions: Sequence[int] | np.ndarray) -> BatchMeta:
        """The rows at ``positions`` (integer positions or a boolean mask)."""
        pos = np.asarray(positions)
        if pos.dtype == bool:
            if pos.shape != (len(self),):
                raise ConfigError(f"a mask must have {len(self)} entries, got {pos.shape}")
            pos = np.flatnonzero(pos)
        pos = pos.astype(np.int64)
        if len(pos) and (pos.min() < -len(self) or pos.max() >= len(self)):
            raise ConfigError(f"positions must be in [0, {len(self)}), got {pos.tolist()[:8]}")
        keys = tuple(self.keys[i] for i in pos.tolist())
        tags = tuple(self.tags[i] for i in pos.tolist()) if self.tags else ()
        return replace(self, keys=keys, index=self.index[pos], generation=self.generation[pos],
                       unit=self.unit[pos], slot=self.slot[pos], tags=tags,
                       shared=None if self.shared is None else self.shared.select(pos))

    def chunk(self, chunks: int) -> list[BatchMeta]:
        """Split into ``chunks`` consecutive parts (sizes differ by at most one)."""
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ConfigError(f"chunks must be an int >= 1, got {chunks!r}")
        return [self.select(p) for p in np.array_split(np.arange(len(self)), chunks)]

    @staticmethod
    def concat(metas: Sequence[BatchMeta]) -> BatchMeta:
        """Join batches of one partition (and one step, if they carry one)."""
        if not metas:
            raise ConfigError("metas must be a non-empty list, got []")
        first = metas[0]
        for m in metas[1:]:
            if (m.partition, m.task, m.step, m.dp_rank) != (first.partition, first.task,
                                                            first.step, first.dp_rank):
                raise ConfigError(
                    f"metas must share partition, task, step and dp_rank to concat, got "
                    f"{(first.partition, first.task, first.step, first.dp_rank)} and "
                    f"{(m.partition, m.task, m.step, m.dp_rank)}"
                )
        return replace(
            first, keys=sum((m.keys for m in metas), ()),
            index=np.concatenate([m.index for m in metas]),
            generation=np.concatenate([m.generation for m in metas]),
            unit=np.concatenate([m.unit for m in metas]),
            slot=np.concatenate([m.slot for m in metas]),
            tags=sum((m.tags for m in metas), ()),
            fields=tuple(dict.fromkeys(f for m in metas for f in m.fields)),
            schemas={k: v for m in metas for k, v in m.schemas.items()},
            shared=SharedRefs.concat([m.shared for m in metas], [len(m) for m in metas]),
        )
