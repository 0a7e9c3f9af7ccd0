"""Media by reference: a producer stores media once and hands a small handle
(``MediaRef``) to another process, which resolves it to the tensors.

The agent loop puts an image (``stream.media.put``) and passes the ``MediaRef`` it
gets to an inference-server actor; the actor joins the deployment
(``tq.connect(ref.address)``) and calls ``stream.resolve(ref)``: on the same host
multi-ragged media (images, video) come as views of the storage unit's shared
memory (no copy, the first resolve too), across hosts in one transfer. Rows later
written with ``shared=[ref.key]`` read the media as their own field.

Lifetime (``controller/media_pins.py``): the media is a shared entry held by pins.
The producer's pin (the put's) is handed to the rows once a row names the entry:
it is freed with the last of them (acked by every declared consumer, discarded by a
sampler, cleared). ``pin(ref)`` adds a pin of the calling process, held until
``release``; every pin also ends when its process's session stops renewing (its
lease lapses: a killed process). An entry no pin holds and no row names is freed.
Views returned by ``resolve`` are valid while the media is held.

Checkpoints keep the pins: after a restore into a new deployment the handles given
out before the save resolve and release as before, their pins held by the restored
deployment until released, handed to rows or cleared (``controller/media_pins.py``).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from tq_stream.backends.base import occupancy
from tq_stream.checks import check_keys
from tq_stream.columns import Column, Ragged
from tq_stream.connection import placement
from tq_stream.connection.connection import Connection
from tq_stream.convert import single_row, to_columns
from tq_stream.errors import ConfigError, check_name
from tq_stream.messages.media import MediaPlace
from tq_stream.multiragged import MultiRagged
from tq_stream.shared_put import put_shared


def holder() -> str:
    """Who this process is, in stats and messages: ``"host:pid"``."""
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True)
class MediaRef:
    """A handle on media stored in a deployment: plain values, picklable, and
    ``to_dict`` / ``from_dict`` for JSON. ``pin`` is this handle's own hold."""

    partition: str
    key: str
    fields: tuple[str, ...]
    index: int  # the entry's row, and its reuse count: this media and no later one
    generation: int
    pin: str
    deployment: str
    # ``tq.connect(address)`` reaches the deployment; an embedded one's is
    # ``embedded://host:pid``, which no other process can join (``tq.connect`` says so)
    address: str | None = None
    curve_server_key: bytes | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> MediaRef:
        try:
            return MediaRef(str(d["partition"]), str(d["key"]), tuple(d["fields"]),
                            int(d["index"]), int(d["generation"]), str(d["pin"]),
                            str(d["deployment"]),
                            d.get("address"), d.get("curve_server_key"))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"ref must be a MediaRef's dict, got {dict(d)!r:.120} "
                              f"({exc})") from None


EMBEDDED = "embedded://"  # the address scheme of handles from an embedded deployment


def embedded_address() -> str:
    """The address handles of an embedded deployment carry: this process, by name."""
    return f"{EMBEDDED}{holder()}"


def check_ref(ref: object) -> MediaRef:
    if not isinstance(ref, MediaRef):
        raise ConfigError(f"ref must be a MediaRef (from media.put or media.pin), got "
                          f"{type(ref).__name__} {ref!r:.80}")
    if ref.address and ref.address.startswith(EMBEDDED) and ref.address != embedded_address():
        raise ConfigError(f"ref must be used in the process whose embedded deployment made it "
                          f"({ref.address[len(EMBEDDED):]}), got it in {holder()}: start the "
                          "deployment with mode='local' or 'ray' to hand media to other "
                          "processes")
    return ref


class Media:
    """Media by reference on one deployment (see module doc); ``stream.media``.

    Args:
        connection: the deployment (``stream.connection``).
    """

    def __init__(self, connection: Connection) -> None:
        self._conn = connection

    def put(self, partition: str, keys: str | Sequence[str], data: object,
            timeout: float | None = None) -> MediaRef | list[MediaRef]:
        """Store media under ``keys`` (one key and one row, or a list and ``[n]``, as in
        ``Writer.put_shared``); returns a handle per key, pinned by this process until
        rows name the media, ``release``, or this process's session lapses."""
        check_name("partition", partition)
        one = isinstance(keys, str)
        keys_ = check_keys([keys] if isinstance(keys, str) else keys)
        cols = single_row(data) if one else to_columns(data, len(keys_))
        timeout = self._conn.config.timeout if timeout is None else timeout
        ctrl, session = self._conn.controller(), self._session(partition)
        pending = ctrl.media_hold(  # held from before the put: a producer that dies
            partition=partition, keys=keys_, session=session, holder=holder(),  # leaks none
            lease=self._conn.config.lease_timeout, producer=True, pending=timeout).pending or []
        try:
            put_shared(self._conn, partition, self._conn.preferred_unit(), keys_, cols,
                       timeout)
        except BaseException:
            for pin in pending:
                ctrl.media_release(partition=partition, pin=pin, session=session,
                                   holder=holder())
            raise
        refs = self._hold(partition, keys_, producer=True, pins=pending)
        return refs[0] if one else refs

    def pin(self, ref: MediaRef) -> MediaRef:
        """A new handle on ``ref``'s media, pinned by this process until ``release``d
        (or its session lapses): the media stays while this process uses it."""
        ref = check_ref(ref)
        self._lookup(ref, ref.fields[:1])  # refused as resolve would be
        new = self._hold(ref.partition, [ref.key], producer=False)[0]
        if (new.index, new.generation) != (ref.index, ref.generation):  # put again since
            self.release(new)
            self._lookup(ref, ref.fields[:1])
        return new

    def release(self, ref: MediaRef) -> None:
        """End ``ref``'s pin; media nothing else holds (no pin, no row naming it) is
        freed. A second release of one handle raises StateError."""
        ref = check_ref(ref)
        self._conn.controller().media_release(
            partition=ref.partition, pin=ref.pin, session=self._session(ref.partition),
            holder=holder())

    def resolve(self, ref: MediaRef, fields: Sequence[str] | None = None) -> dict[str, Any]:
        """The media's ``fields`` (all by default) as tensors, one per field: views of
        shared memory where the storage unit is on this host and the field is
        multi-ragged (valid while the media is held: ``clone()`` what is kept after
        ``release``), else read once (one transfer). Refused (StateError) once the handle was
        released or its media freed, saying by what; a handle of another deployment
        is a ConfigError."""
        ref = check_ref(ref)
        names = list(ref.fields if fields is None else fields)
        place = self._lookup(ref, names)
        cols = placement.load(self._conn.units(), ref.partition,
                              np.asarray(place.unit, dtype=np.int32),
                              np.asarray(place.slot, dtype=np.int64), names,
                              occupancy(np.asarray(place.index, dtype=np.int64),
                                        np.asarray(place.generation, dtype=np.int64)))
        return {f: _one(c) for f, c in cols.items()}

    def _lookup(self, ref: MediaRef, fields: Sequence[str]) -> MediaPlace:
        return self._conn.controller().media_lookup(
            partition=ref.partition, key=ref.key, index=ref.index, generation=ref.generation,
            pin=ref.pin, deployment=ref.deployment, fields=list(fields))

    def _session(self, partition: str) -> str:
        return self._conn.keeper().producer_session(partition, self._conn.config.lease_timeout)

    def _hold(self, partition: str, keys: list[str], producer: bool,
              pins: list[str] | None = None) -> list[MediaRef]:
        out = self._conn.controller().media_hold(
            partition=partition, keys=keys, session=self._session(partition), holder=holder(),
            lease=self._conn.config.lease_timeout, producer=producer, pins=pins)
        return [MediaRef(partition, p.key, tuple(p.fields), int(p.index), int(p.generation),
                         p.pin, out.deployment, self._conn.address or embedded_address(),
                         self._conn.curve_server_key) for p in out.pins]


def _one(col: Column) -> object:
    """The single row of a column read (a view where the column holds one)."""
    if isinstance(col, MultiRagged):
        return col.rows()[0]
    if isinstance(col, Ragged):
        return col.row(0)
    return col[0]


__all__ = ["Media", "MediaRef", "check_ref"]
