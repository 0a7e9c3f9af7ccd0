"""Shared entries: fields written once under a key of their own, named by many rows.

A shared entry (a GRPO group's prompt and image, say) is a hidden row of its
partition, keyed ``ENTRY_PREFIX + key`` (a prefix no user key may start with,
``checks.check_keys``), placed, stored, checkpointed and freed like any row. It is
never offered to a task, listed or counted as a row. A row that names it
(``Writer.put(..., shared=[key, ...])``) sees the entry's fields as its own:
``ready[f]`` of the row mirrors the entry's, so readiness, ``lookup`` and samplers
need nothing else, and a read loads each distinct entry once (``shared_read.py``).

The entry lives while a live row names it or a holder pins it (``holds[e]``,
kept by ``media_pins.MediaPins``): freeing the last such row (acked by every
declared consumer, discarded, cleared, lost) frees an entry no pin holds in the
same ``PartitionMeta.release``. An entry no row names and no pin holds stays until
its partition is cleared. Why an entry was freed is kept for a while (``why``).
Its bytes are written once: every field carries a digest, a put of the same bytes
again is a no-op, other bytes are refused (also while the first put is under way:
its claim holds the digests; a put that aborted holds none).

Invariants (``SharedTable``): ``entry[e]`` only for used rows keyed with the prefix;
``of[r] >= 0`` only for used rows that are not entries, and then ``entry[of[r]]``;
``refs[e]`` is the number of used rows ``r`` with ``of[r] == e``; ``holds[e] > 0``
only for entries; a field of
``fields`` is never a field of a row's own.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from tq_stream.checks import RESERVED
from tq_stream.errors import ConfigError, KeyConflictError, SchemaError, StateError
from tq_stream.messages.reads import SharedPlaces

if TYPE_CHECKING:
    from tq_stream.schemas import FieldSchema


class PartRows(Protocol):
    """What the table reads of its partition (a ``controller.partition.PartitionMeta``)."""

    name: str
    schemas: dict[str, FieldSchema]
    used: np.ndarray
    key_index: dict[str, int]
    keys: np.ndarray
    ready: dict[str, np.ndarray]
    unit: np.ndarray
    slot: np.ndarray
    generation: np.ndarray

ENTRY_PREFIX = RESERVED + "shared:"  # keys of shared entries; refused as a user key
FREED_KEPT = 4096  # entries whose reason for being freed is remembered (``why``)
NAMERS_FREED = ("the last row naming it was freed (acked by every declared consumer, "
                "discarded by a sampler, or cleared)")


def entry_key(key: str) -> str:
    return ENTRY_PREFIX + key


def shown_keys(keys: list[str]) -> list[str]:
    """Keys as their user wrote them: an entry's as ``shared 'p1'``, for messages."""
    return [f"shared {k[len(ENTRY_PREFIX):]!r}" if k.startswith(ENTRY_PREFIX) else k
            for k in keys]


def _grown(arr: np.ndarray, n: int, fill: int | bool) -> np.ndarray:
    return np.concatenate([arr, np.full(n - arr.shape[0], fill, dtype=arr.dtype)])


class SharedTable:
    """The shared entries of one partition and which rows name them (see module doc)."""

    def __init__(self, size: int) -> None:
        self.entry = np.zeros(size, dtype=bool)
        self.of = np.full(size, -1, dtype=np.int64)
        self.refs = np.zeros(size, dtype=np.int64)
        self.holds = np.zeros(size, dtype=np.int64)  # pins on each entry (media_pins.py)
        self.freed: OrderedDict[tuple[str, int, int], str] = OrderedDict()  # key, row, gen
        self.fields: set[str] = set()
        self.digests: dict[int, dict[str, str]] = {}  # entry row -> field -> digest
        self.nbytes: dict[int, int] = {}  # entry row -> bytes put
        self.count = 0  # live entries

    def grow(self, n: int) -> None:
        if n > self.entry.shape[0]:
            self.entry = _grown(self.entry, n, False)
            self.of = _grown(self.of, n, -1)
            self.refs = _grown(self.refs, n, 0)
            self.holds = _grown(self.holds, n, 0)

    # ----------------------------------------------------------------- puts
    def check_fields(self, part: PartRows, keys: Sequence[str],
                     schemas: Mapping[str, object]) -> None:
        """A put's fields: a shared put writes no field a row holds, a row put no shared
        one (claimed by an entry, committed or not; ``check_commit`` sees the rest)."""
        if not self.fields and not (keys and keys[0].startswith(ENTRY_PREFIX)):
            return
        shared_put = bool(keys) and keys[0].startswith(ENTRY_PREFIX)
        for f in schemas:
            if shared_put and f not in self.fields and f in part.ready and \
                    (part.ready[f] & ~self.entry).any():  # a row committed it
                raise SchemaError(
                    f"field {f!r} of partition {part.name!r} is a field of its rows, so a "
                    f"shared entry must not have it (a read would not know whose to give); "
                    f"got it in put_shared of {keys[0][len(ENTRY_PREFIX):]!r}")
            if not shared_put and f in self.fields:
                raise SchemaError(
                    f"field {f!r} of partition {part.name!r} is a shared field (put once "
                    f"per entry with put_shared), so a row put must not write it; got it "
                    f"in a put of keys {list(keys)[:5]}")

    def to_write(self, part: PartRows, key: str, digests: Mapping[str, str]) -> bool:
        """False if every field of a shared put of ``key`` is stored (committed) with
        these bytes already; ConfigError if one was stored with other bytes, or is
        claimed with other bytes by a put not committed yet (it may still succeed). A
        field claimed by a put that aborted may be put again (``unclaim``)."""
        row = part.key_index.get(entry_key(key), -1)
        have = self.digests.get(row, {}) if row >= 0 else {}
        stored = {f for f in have if f in part.ready and part.ready[f][row]}
        for f, d in digests.items():
            old = have.get(f)
            if old is not None and old != d:
                how = "holds" if f in stored else "is being put with"
                raise ConfigError(
                    f"shared entry {key!r} of partition {part.name!r} is written once: its "
                    f"field {f!r} {how} other bytes (digest {old[:16]} of the row's dtype, "
                    f"shape and bytes), got {d[:16]}; put it under a new key")
        return any(f not in stored for f in digests)

    def claim(self, part: PartRows, row: int, generation: int, key: str,
              digests: Mapping[str, str], nbytes: int) -> None:
        """Row ``row`` (reserved for ``key`` with ``generation``) is a shared entry with
        ``digests``' fields; StateError if the row was freed since (the put is made
        again), SchemaError if a row put committed one of the fields meanwhile."""
        if not (part.used[row] and int(part.generation[row]) == generation
                and part.keys[row] == entry_key(key)):
            raise StateError(f"shared entry {key!r} of partition {part.name!r} must still "
                             f"hold the row reserved for it, but the row was freed meanwhile")
        self.check_fields(part, [entry_key(key)], digests)
        self.to_write(part, key, digests)  # a concurrent put of other bytes came first
        if not self.entry[row]:
            self.entry[row] = True
            self.count += 1
        self.digests.setdefault(row, {}).update(digests)
        self.nbytes[row] = self.nbytes.get(row, 0) + int(nbytes)
        self.fields.update(digests)

    def claims(self, rows: np.ndarray) -> set[str]:
        """The fields entries among ``rows`` claim (committed or not)."""
        if not self.digests:
            return set()
        return set().union(*(self.digests.get(e, {}) for e in rows[self.entry[rows]].tolist()))

    def forget(self, names: set[str]) -> None:
        """Fields ``names`` are shared fields no more unless a live entry still claims
        one (their claims aborted, their partition was cleared)."""
        if names:
            self.fields -= names - set().union(*self.digests.values())

    def check_commit(self, part: PartRows, index: np.ndarray,
                     schemas: Mapping[str, FieldSchema]) -> None:
        """A row put of rows ``index`` commits no shared field (one claimed after the
        put was reserved: its check_fields came first)."""
        if not self.fields or (self.count and self.entry[index].all()):
            return
        clash = sorted(set(schemas) & self.fields)
        if clash:
            raise SchemaError(
                f"field {clash[0]!r} of partition {part.name!r} is a shared field (put "
                f"once per entry with put_shared, claimed while this put was under way), "
                f"so a row put must not write it; got it in a commit of rows "
                f"{part.keys[index[:5]].tolist()}")

    def bind(self, part: PartRows, index: np.ndarray,
             shared: Sequence[str | None]) -> None:
        """Rows ``index`` name the entries ``shared`` (None: none); checked in full
        before anything changes. A row names one entry for its life."""
        if len(shared) != len(index):
            raise ConfigError(f"shared must name one entry (or None) per row, got "
                              f"{len(shared)} for {len(index)} rows")
        rows, ents = [], []
        for r, k in zip(index.tolist(), shared, strict=True):
            if k is None:
                continue
            e = part.key_index.get(entry_key(k), -1) if isinstance(k, str) else -1
            if e < 0 or not self.entry[e] or not self._committed(part, e):
                raise KeyConflictError(
                    f"shared must name entries put with put_shared in partition "
                    f"{part.name!r} first (committed), got {k!r} for row {part.keys[r]!r}")
            old = int(self.of[r])
            if old == e:
                continue
            if old >= 0:
                raise ConfigError(
                    f"shared of row {part.keys[r]!r} names one entry for the row's life: "
                    f"had {part.keys[old][len(ENTRY_PREFIX):]!r}, got {k!r}")
            rows.append(r)
            ents.append(e)
        if rows:
            r_, e_ = np.asarray(rows, dtype=np.int64), np.asarray(ents, dtype=np.int64)
            self.of[r_] = e_
            np.add.at(self.refs, e_, 1)
            self._mirror(part, r_, e_)

    def _committed(self, part: PartRows, e: int) -> bool:
        """Entry ``e`` holds a committed field (an entry whose put may still fail, and
        free it, is not named)."""
        return any(bool(part.ready[f][e]) for f in self.fields if f in part.ready)

    def _mirror(self, part: PartRows, rows: np.ndarray, ents: np.ndarray) -> None:
        for f in self.fields:
            r = part.ready.get(f)
            if r is not None:
                r[rows] = r[ents]

    def written(self, part: PartRows, index: np.ndarray) -> np.ndarray:
        """Fields of rows ``index`` were committed: entries among them pass them to the
        rows naming them; returns ``index`` plus those rows (to offer to the tasks)."""
        if not self.count:
            return index
        ents = index[self.entry[index]]
        if not len(ents):
            return index
        rows = np.flatnonzero(np.isin(self.of, ents))
        self._mirror(part, rows, self.of[rows])
        return np.concatenate([index, rows])

    # ---------------------------------------------------------------- frees
    def release(self, part: PartRows, idx: np.ndarray) -> np.ndarray:
        """Used rows ``idx`` are being freed: returns them plus the entries no live row
        names any more. Rows naming an entry freed under them (a lost unit) lose its
        fields."""
        if not self.count:
            return idx
        of = self.of[idx]
        named = of >= 0
        if named.any():
            ents = of[named]
            np.subtract.at(self.refs, ents, 1)
            self.of[idx[named]] = -1
            dead = np.unique(ents[(self.refs[ents] == 0) & (self.holds[ents] == 0)])
            dead = dead[~np.isin(dead, idx)]
            self.note_freed(part, dead, NAMERS_FREED)
            idx = np.concatenate([idx, dead])
        gone = idx[self.entry[idx]]
        if len(gone):
            self.note_freed(part, gone, "it was cleared, or lost with its storage unit")
            orphans = np.flatnonzero(np.isin(self.of, gone))
            for f in self.fields:
                r = part.ready.get(f)
                if r is not None:
                    r[orphans] = False
            self.of[orphans] = -1
            self.entry[gone] = False
            self.refs[gone] = 0
            self.holds[gone] = 0
            for e in gone.tolist():
                self.digests.pop(e, None)
                self.nbytes.pop(e, None)
            self.count -= len(gone)
        return idx

    def note_freed(self, part: PartRows, ents: np.ndarray, why: str) -> None:
        """Entries ``ents`` are being freed because of ``why`` (a reason noted first
        stays)."""
        for e in ents.tolist():
            self.freed.setdefault((str(part.keys[e]), e, int(part.generation[e])), why)
        while len(self.freed) > FREED_KEPT:
            self.freed.popitem(last=False)

    def why(self, key: str, row: int, generation: int) -> str | None:
        """Why the entry of ``key`` (row ``row`` of ``generation``) was freed, if
        remembered."""
        return self.freed.get((entry_key(key), row, generation))

    def with_namers(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` plus the rows naming the entries among them (lost with them)."""
        if not self.count:
            return rows
        ents = rows[self.entry[rows]]
        namers = np.flatnonzero(np.isin(self.of, ents)) if len(ents) else ents
        return np.concatenate([rows, namers[~np.isin(namers, rows)]])

    # ---------------------------------------------------------------- reads
    def rows(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` without the shared entries (what listings and counts show)."""
        return rows[~self.entry[rows]] if self.count else rows

    def describe(self, part: PartRows, idx: np.ndarray,
                 fields: Sequence[str]) -> SharedPlaces | None:
        """What a reader of ``fields`` of rows ``idx`` needs beyond their own slots: the
        shared entries they name (``SharedPlaces``), or None if no field is shared."""
        names = [f for f in fields if f in self.fields]
        if not names:
            return None
        of = self.of[idx]
        has = of >= 0
        ents, inv = np.unique(of[has], return_inverse=True)
        pos = np.full(len(idx), -1, dtype=np.int64)
        pos[has] = inv
        return SharedPlaces(fields=names, pos=pos, index=ents, unit=part.unit[ents],
                            slot=part.slot[ents], generation=part.generation[ents])

    def stats(self) -> dict[str, Any]:
        """Live entries, the bytes put into them, and how many rows name them."""
        return {"entries": self.count, "bytes": int(sum(self.nbytes.values())),
                "refs": int(self.refs.sum()), "fields": sorted(self.fields)}

    # ----------------------------------------------------------- checkpoints
    def own_ready(self, part: PartRows, rows: np.ndarray) -> dict[str, np.ndarray]:
        """``ready[f][rows]`` of what each row's own slot holds (a shared field only in
        its entry's): what a checkpoint saves, ``load_state_dict`` mirrors it again."""
        out = {f: r[rows] for f, r in part.ready.items()}
        for f in self.fields & set(out):
            out[f] = out[f] & self.entry[rows]
        return out

    def state_dict(self) -> dict[str, Any]:
        named = np.flatnonzero(self.of >= 0)
        return {"entries": np.flatnonzero(self.entry), "named": named,
                "of": self.of[named], "fields": sorted(self.fields),
                "digests": [[e, d] for e, d in self.digests.items()],
                "nbytes": [[e, n] for e, n in self.nbytes.items()]}

    def load_state_dict(self, part: PartRows, state: Mapping[str, Any]) -> None:
        """The state of ``state_dict``, into the table of ``part`` (its rows loaded)."""
        entries = np.asarray(state["entries"], dtype=np.int64)
        named = np.asarray(state["named"], dtype=np.int64)
        of = np.asarray(state["of"], dtype=np.int64)
        self.entry[entries] = True
        self.count = len(entries)
        self.of[named] = of
        np.add.at(self.refs, of, 1)
        self.fields = set(state["fields"])
        self.digests = {int(e): dict(d) for e, d in state["digests"]}
        self.nbytes = {int(e): int(n) for e, n in state["nbytes"]}
        self._mirror(part, named, of)


__all__ = ["ENTRY_PREFIX", "SharedTable", "entry_key", "shown_keys"]
