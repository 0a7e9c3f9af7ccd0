"""SharedRefs: which shared entries the rows of a BatchMeta read, and where they live.

A row reading a shared field (``Writer.put(..., shared=)``) reads it from its entry:
``pos[i]`` is row i's position among the batch's distinct entries (-1: none), and
``index``, ``generation``, ``unit``, ``slot`` place each distinct entry, as
``BatchMeta``'s arrays place its rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from tq_stream.messages.reads import SharedPlaces


def _ro(values: np.ndarray | Sequence[int], dtype: type = np.int64) -> np.ndarray:
    out: np.ndarray = np.array(values, dtype=dtype)
    out.flags.writeable = False
    return out


@dataclass(frozen=True)
class SharedRefs:
    """Shared fields of a batch: ``fields``, and per row ``pos`` into the distinct
    entries placed by ``index``, ``generation``, ``unit``, ``slot``."""

    fields: tuple[str, ...]
    pos: np.ndarray
    index: np.ndarray
    generation: np.ndarray
    unit: np.ndarray
    slot: np.ndarray

    @staticmethod
    def from_reply(places: SharedPlaces | None) -> SharedRefs | None:
        """The refs of a reply's ``shared`` (None: no shared field)."""
        if places is None:
            return None
        return SharedRefs(tuple(places.fields), _ro(places.pos), _ro(places.index),
                          _ro(places.generation), _ro(places.unit, np.int32),
                          _ro(places.slot))

    def __len__(self) -> int:
        return len(self.index)

    def select(self, positions: np.ndarray) -> SharedRefs:
        """The rows at ``positions`` (every entry kept: positions stay valid)."""
        return replace(self, pos=self.pos[positions])

    @staticmethod
    def concat(refs: Sequence[SharedRefs | None], sizes: Sequence[int]) -> SharedRefs | None:
        """The refs of batches joined (``sizes``: their row counts)."""
        if all(r is None for r in refs):
            return None
        parts = [SharedRefs((), np.full(n, -1, np.int64), *([np.zeros(0, np.int64)] * 4))
                 if r is None else r for r, n in zip(refs, sizes, strict=True)]
        offsets = np.cumsum([0] + [len(p) for p in parts[:-1]])
        pos = np.concatenate([np.where(p.pos >= 0, p.pos + o, -1)
                              for p, o in zip(parts, offsets.tolist(), strict=True)])
        fields = tuple(dict.fromkeys(f for p in parts for f in p.fields))
        return SharedRefs(fields, _ro(pos), _ro(np.concatenate([p.index for p in parts])),
                          _ro(np.concatenate([p.generation for p in parts])),
                          _ro(np.concatenate([p.unit for p in parts]), np.int32),
                          _ro(np.concatenate([p.slot for p in parts])))


__all__ = ["SharedRefs"]
