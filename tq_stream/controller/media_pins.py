"""Media pins: shared entries held by the handles (``MediaRef``) of live sessions.

Media put by reference (``Media.put``) is a shared entry (``shared_entries.py``) that
no row may name yet: the agent loop hands its handle to an inference server, whose
rows come later. So every handle is a *pin* on its entry, held by a session (the
process's producer session on the partition, renewed by its heartbeat, as
``reservations.py`` holds uncommitted rows):

- the producer's pin (made by the put) is handed over to the rows once a row names
  the entry (``handed``): from then on the rows keep it, and it is freed with the
  last of them (acked by every declared consumer, discarded, cleared);
- an explicit pin (``Media.pin``) keeps it until released, whatever the rows do;
- a pin ends by ``release`` or when its session stops renewing for its lease; an
  entry no pin holds and no row names is freed then (``expire``, ``release``).

Every ended pin is remembered (the last ``ENDED_KEPT``) with what ended it, so a
handle used after its release, or released twice, is refused naming what released
it. Plain bookkeeping guarded by the controller's lock; the controller frees rows.

Checkpoints keep the pins, the ended ones and the deployment ids handles may carry
(``state_dict``, ``load_state_dict``). A controller restarted in its deployment takes them as
they were (its live processes go on renewing their sessions). A restore into a new
deployment (``for_new_deployment``) has a new id and accepts handles of the old
ones; the old sessions died with their processes, so each restored pin is held by
the restored deployment (holder ``"restored from <holder>"``) until it is
released, handed to rows naming its entry, or its partition is cleared; a pending
pin (a put under way at the save) ends at once, freeing what its put left.
"""

from __future__ import annotations

import logging
import uuid
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tq_stream.controller.partition import PartitionMeta
from tq_stream.controller.shared_entries import entry_key
from tq_stream.errors import ConfigError, KeyConflictError, StateError
from tq_stream.messages.media import MediaPin, MediaPlace

logger = logging.getLogger(__name__)
ENDED_KEPT = 65536  # ended pins remembered (what ended each)
HANDED = "handed to the rows naming its entry"


@dataclass
class Pin:
    """Entry ``row`` (of ``generation``) of ``partition``, held by ``session``."""

    partition: str
    key: str
    row: int
    generation: int
    session: str
    holder: str  # who the session is ("host:pid"), for stats and messages
    lease: float
    expiry: float  # time.time() after which the pin ends unless renewed
    producer: bool  # made by the put: handed over to the rows naming the entry
    deadline: float = float("inf")  # a pending pin (row -1) ends by then, renewed or not


class MediaPins:
    """The pins of every partition (see module doc)."""

    def __init__(self) -> None:
        self.deployment = uuid.uuid4().hex  # names this deployment in every handle
        self.earlier: list[str] = []  # of the deployments it was restored from
        self.pins: dict[str, Pin] = {}
        self.ended: OrderedDict[str, tuple[str, bool]] = OrderedDict()  # pin -> why, released

    # ------------------------------------------------------------- pinning
    def pend(self, part: PartitionMeta, keys: Sequence[str], session: str, holder: str,
             lease: float, put_timeout: float, now: float) -> list[str]:
        """Pending pins of a producer about to put ``keys``: should its session lapse
        before ``hold`` confirms them, the entries it put and nothing holds are freed."""
        out = []
        for k in keys:
            pin = uuid.uuid4().hex
            self.pins[pin] = Pin(part.name, k, -1, -1, session, holder, lease, now + lease,
                                 True, now + put_timeout + lease)
            out.append(pin)
        return out

    def hold(self, part: PartitionMeta, keys: Sequence[str], session: str, holder: str,
             lease: float, producer: bool, now: float,
             confirm: Sequence[str] | None = None) -> list[MediaPin]:
        """A pin of ``session`` on the committed entry of each of ``keys`` (``confirm``:
        the pending pins of ``pend`` that become these pins)."""
        out = []
        rows = [self._entry(part, k) for k in keys]  # all checked before any pin
        if confirm is not None:
            self._check_pending(part, keys, session, confirm)
        for i, (k, e) in enumerate(zip(keys, rows, strict=True)):
            pin = uuid.uuid4().hex if confirm is None else confirm[i]
            self.pins.pop(pin, None)
            if producer and part.shared.refs[e] > 0:  # rows hold it already
                self.ended[pin] = (HANDED, False)
            else:
                self.pins[pin] = Pin(part.name, k, e, int(part.generation[e]), session,
                                     holder, lease, now + lease, producer)
                part.shared.holds[e] += 1
            out.append(MediaPin(key=k, pin=pin, index=e, generation=int(part.generation[e]),
                                fields=sorted(f for f in part.shared.fields
                                              if f in part.ready and part.ready[f][e])))
        return out

    def _check_pending(self, part: PartitionMeta, keys: Sequence[str], session: str,
                       confirm: Sequence[str]) -> None:
        ok = isinstance(confirm, list | tuple) and len(confirm) == len(keys) and all(
            isinstance(c, str) and c in self.pins and self.pins[c].row < 0
            and (self.pins[c].partition, self.pins[c].key, self.pins[c].session)
            == (part.name, k, session) for c, k in zip(confirm, keys, strict=True))
        if not ok:
            raise ConfigError(f"pins must be the live pending pins of session "
                              f"{session[:12]!r} for keys {list(keys)[:5]} (media_hold with "
                              f"pending first), got {confirm!r:.120}")

    def _entry(self, part: PartitionMeta, key: str) -> int:
        e = part.key_index.get(entry_key(key), -1) if isinstance(key, str) else -1
        if e < 0 or not part.shared.entry[e] or not any(
                part.ready[f][e] for f in part.shared.fields if f in part.ready):
            raise KeyConflictError(f"key must name media put in partition {part.name!r} "
                                   f"(a committed shared entry), got {key!r}")
        return e

    def handed(self, part: PartitionMeta, keys: Sequence[str | None]) -> None:
        """Rows now name the entries ``keys``: their producers' pins go to the rows."""
        named = {part.key_index.get(entry_key(k), -1) for k in keys if k is not None}
        for pin, p in list(self.pins.items()):
            if p.producer and p.partition == part.name and p.row in named and \
                    part.shared.refs[p.row] > 0:
                self._end(part, pin, HANDED, released=False)

    def renew(self, partition: str, session: str, now: float) -> int:
        """``session``'s heartbeat: extend its pins on ``partition``; how many."""
        n = 0
        for p in self.pins.values():
            if p.session == session and p.partition == partition and p.expiry > now:
                p.expiry = min(p.deadline, now + p.lease)
                n += 1
        return n

    def _end(self, part: PartitionMeta | None, pin: str, why: str, released: bool) -> int:
        """End ``pin``; returns its entry's row if nothing holds the entry now, else -1."""
        p = self.pins.pop(pin)
        self.ended[pin] = (why, released)
        while len(self.ended) > ENDED_KEPT:
            self.ended.popitem(last=False)
        if part is None or not _alive(part, p):
            return -1
        part.shared.holds[p.row] -= 1
        if part.shared.holds[p.row] == 0 and part.shared.refs[p.row] == 0:
            part.shared.note_freed(part, np.array([p.row]), f"its last pin was {why}")
            return p.row
        return -1

    # ----------------------------------------------------------- releasing
    def release(self, part: PartitionMeta, pin: str, session: str,
                holder: str) -> list[int]:
        """End ``pin`` (a handle's ``release``); the entry rows to free."""
        p = self.pins.get(pin)
        if p is None:
            why, released = self.ended.get(pin, ("", False))
            if released:
                raise StateError(f"ref must be released once, got a handle already "
                                 f"released: {why}")
            if not why:
                raise KeyConflictError(f"ref must be a handle of partition {part.name!r} "
                                       f"still known to this deployment, got pin {pin[:12]}")
            self.ended[pin] = (f"{why}, then released by {holder}", True)
            return []
        if p.partition != part.name:
            raise ConfigError(f"ref must name the partition of its pin {p.partition!r}, "
                              f"got {part.name!r}")
        e = self._end(part, pin, f"released by {holder} (session {session[:12]})",
                      released=True)
        return [] if e < 0 else [e]

    def expire(self, parts: Mapping[str, PartitionMeta],
               now: float) -> list[tuple[PartitionMeta, list[int]]]:
        """End the pins whose session stopped renewing; the entry rows to free."""
        out: dict[str, list[int]] = {}
        for pin, p in list(self.pins.items()):
            part = parts.get(p.partition)
            if p.row < 0:
                e = self._end_pending(part, pin, now)
                if e >= 0 and part is not None:
                    out.setdefault(part.name, []).append(e)
                continue
            if part is not None and _alive(part, p) and p.expiry > now:
                continue
            e = self._end(part, pin, f"ended when its holder {p.holder} (session "
                          f"{p.session[:12]}) stopped renewing its lease of {p.lease:g} s"
                          if part is not None and _alive(part, p) else
                          "dropped: its entry was freed", released=False)
            if e >= 0 and part is not None:
                out.setdefault(part.name, []).append(e)
        return [(parts[name], rows) for name, rows in out.items()]

    def _end_pending(self, part: PartitionMeta | None, pin: str, now: float) -> int:
        """End pending ``pin`` if due; returns the entry its put left that nothing
        holds (to free), else -1."""
        p = self.pins[pin]
        if p.expiry > now:
            return -1
        del self.pins[pin]
        self.ended[pin] = (f"ended when its producer {p.holder} (session {p.session[:12]}) "
                           f"stopped before it held the media it put", False)
        if part is None:
            return -1
        e = part.key_index.get(entry_key(p.key), -1)
        if e < 0 or not part.shared.entry[e] or part.shared.refs[e] or part.shared.holds[e] \
                or any(q.row < 0 and (q.partition, q.key) == (p.partition, p.key)
                       for q in self.pins.values()):
            return -1
        part.shared.note_freed(part, np.array([e]), "its producer stopped before it held it")
        return e

    def soonest(self) -> float:
        return min((p.expiry for p in self.pins.values()), default=float("inf"))

    # ------------------------------------------------------------- reading
    def lookup(self, part: PartitionMeta, key: str, index: int, generation: int, pin: str,
               deployment: str, fields: Sequence[str]) -> MediaPlace:
        """Where the entry of a handle lives, if the handle may still be resolved."""
        if deployment != self.deployment and deployment not in self.earlier:
            raise ConfigError(f"ref must be a handle of this deployment ({self.deployment[:12]})"
                              f", got one of deployment {deployment[:12]!r} (key {key!r})")
        if pin not in self.pins:
            why, _ = self.ended.get(pin, ("", False))
            if why and why != HANDED:
                raise StateError(f"ref must not be released to be resolved: media {key!r} "
                                 f"of partition {part.name!r} was {why}")
        e = part.key_index.get(entry_key(key), -1)
        if e != index or int(part.generation[e]) != generation or not part.shared.entry[e]:
            freed = part.shared.why(key, index, generation)
            if freed is None and pin not in self.pins and pin not in self.ended:
                raise KeyConflictError(f"ref must name media put in partition {part.name!r}"
                                       f" (and not freed long ago), got key {key!r}")
            raise StateError(f"ref must name media still held to be resolved: media {key!r} "
                             f"of partition {part.name!r} was freed"
                             f"{': ' + freed if freed else ''}")
        missing = [f for f in fields if f not in part.ready or not part.ready[f][e]]
        if missing:
            raise KeyConflictError(f"fields must be held by media {key!r}, got {missing}")
        return MediaPlace(index=np.array([e]), generation=np.array([generation]),
                          unit=part.unit[[e]], slot=part.slot[[e]],
                          schemas={f: part.schemas[f].to_dict() for f in fields})

    def stats(self, part: PartitionMeta, now: float) -> dict[str, Any]:
        """Entries pinned, the bytes put into them, live pins per holder and the bytes
        of the entries each holder pins (``stats.MediaStats``)."""
        held: dict[str, int] = {}
        rows: dict[str, set[int]] = {}
        for p in self.pins.values():
            if p.partition == part.name and p.expiry > now and _alive(part, p):
                held[p.holder] = held.get(p.holder, 0) + 1
                rows.setdefault(p.holder, set()).add(p.row)
        size = part.shared.nbytes
        every = set().union(*rows.values())
        return {"entries": len(every), "bytes": sum(size.get(e, 0) for e in every),
                "pins": held,
                "bytes_by_holder": {h: sum(size.get(e, 0) for e in es) for h, es in rows.items()}}

    # ---------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The pins, the ended ones and the deployment ids, as plain data."""
        ps = list(self.pins.values())
        return {
            "own": True, "deployments": [self.deployment, *self.earlier],
            "pins": {"pin": list(self.pins), "partition": [p.partition for p in ps],
                     "key": [p.key for p in ps], "session": [p.session for p in ps],
                     "holder": [p.holder for p in ps],
                     "row": np.array([p.row for p in ps], dtype=np.int64),
                     "generation": np.array([p.generation for p in ps], dtype=np.int64),
                     "lease": np.array([p.lease for p in ps], dtype=np.float64),
                     "expiry": np.array([p.expiry for p in ps], dtype=np.float64),
                     "producer": np.array([p.producer for p in ps], dtype=bool),
                     "deadline": np.array([p.deadline for p in ps], dtype=np.float64)},
            "ended": {"pin": list(self.ended), "why": [w for w, _ in self.ended.values()],
                      "released": np.array([r for _, r in self.ended.values()], dtype=bool)}}

    def load_state_dict(self, state: Mapping[str, Any],
                        parts: Mapping[str, PartitionMeta]) -> None:
        """The pins of ``state_dict`` into these (new) pins, over the restored
        ``parts``; their entries' holds are counted again. ConfigError if ``state`` is
        not one."""
        try:
            ids = [str(d) for d in state["deployments"]]
            if state["own"] is True:
                self.deployment, ids = ids[0], ids[1:]
            self.earlier = ids
            c = state["pins"]
            rows, gens = (np.asarray(c[k], dtype=np.int64).tolist() for k in ("row",
                                                                               "generation"))
            lease, expiry, deadline = (np.asarray(c[k], dtype=np.float64).tolist()
                                       for k in ("lease", "expiry", "deadline"))
            producer = np.asarray(c["producer"], dtype=bool).tolist()
            for i, pin in enumerate(c["pin"]):
                self.pins[str(pin)] = Pin(
                    str(c["partition"][i]), str(c["key"][i]), rows[i], gens[i],
                    str(c["session"][i]), str(c["holder"][i]), lease[i], expiry[i],
                    producer[i], deadline[i])
            e = state["ended"]
            self.ended.update((str(k), (str(w), bool(r))) for k, w, r in zip(
                e["pin"], e["why"], np.asarray(e["released"], dtype=bool).tolist(),
                strict=True))
            while len(self.ended) > ENDED_KEPT:
                self.ended.popitem(last=False)
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ConfigError(f"media pins of a checkpoint must be MediaPins.state_dict's, "
                              f"got {type(exc).__name__}: {exc}") from None
        for pin, p in list(self.pins.items()):
            part = parts.get(p.partition)
            if part is not None and p.row >= part.used.shape[0]:
                raise ConfigError(f"media pins of a checkpoint must name rows of their "
                                  f"partition {p.partition!r} (below {part.used.shape[0]}), "
                                  f"got row {p.row}")
            if p.row >= 0 and part is not None and _alive(part, p):
                part.shared.holds[p.row] += 1
            elif p.row >= 0:
                self._end(None, pin, "dropped: its entry was freed", released=False)
        held = sum(1 for p in self.pins.values() if p.row >= 0 and p.expiry == float("inf"))
        if held:
            logger.warning("restored %d media pins of an earlier deployment: held until "
                           "released, handed to rows naming their media, or cleared "
                           "(stats()[partition]['media'], holder 'restored from ...')", held)


def for_new_deployment(state: dict[str, Any]) -> None:
    """``state`` (of ``state_dict``) for a restore into a new deployment, in place: its
    sessions died, so every pin is held by the deployment until released, handed to
    rows or cleared, and pending pins end (see module doc)."""
    state["own"] = False
    cols = state["pins"]
    rows = np.asarray(cols["row"], dtype=np.int64)
    cols["session"] = [""] * len(rows)  # no session renews (or lapses) it
    cols["holder"] = [h if r < 0 else f"restored from {h}"
                      for h, r in zip(cols["holder"], rows.tolist(), strict=True)]
    cols["expiry"] = np.where(rows < 0, 0.0, np.inf)  # pending: due at once
    cols["deadline"] = np.where(rows < 0, 0.0, np.inf)
    cols["lease"] = np.where(rows < 0, 0.0, np.inf)


def _alive(part: PartitionMeta, p: Pin) -> bool:
    return p.row >= 0 and bool(part.used[p.row]) and \
        int(part.generation[p.row]) == p.generation and bool(part.shared.entry[p.row])


__all__ = ["MediaPins", "Pin", "for_new_deployment"]
