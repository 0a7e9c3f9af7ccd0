"""Periodic checkpoints of a controller's metadata, and a restarted controller's way back.

The controller's state (``Controller.state_dict``: partitions, rows, tasks, steps)
plus the registrations of its tasks (so a restarted controller serves them at once)
is written every ``interval`` seconds to one file: metadata only, the units keep the
bytes. The write is atomic (a temporary file, fsync, rename) and the file is 0600;
it carries a CRC-32 of its content, checked on load.

A restarted controller loads the last file, then, once the units are attached,
reconciles with what they hold (``reconcile``): a row of the checkpoint whose slot
no longer holds its token (freed or overwritten after the checkpoint, or its unit
restarted) is dropped and counted ``unit_lost``; a slot holding a token no row of the
checkpoint has (written after the checkpoint: its key is unknown) is freed. So rows
written after the last checkpoint are lost, and rows acked after it may be handed
out again while their bytes are still stored (declared consumers free them on ack).
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from tq_stream.backends.base import occupancy
from tq_stream.errors import StateError, check_timeout
from tq_stream.serialization import decode, encode
from tq_stream.transport.dispatch import OWNER_ARG

MAGIC = b"TQMETA1\n"
_LEN = struct.Struct("<Q")
logger = logging.getLogger(__name__)


def write(path: str, state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically (0600)."""
    frames = [bytes(memoryview(f)) for f in encode(state)]
    body = _LEN.pack(len(frames)) + b"".join(_LEN.pack(len(f)) + f for f in frames)
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + struct.pack("<I", zlib.crc32(body)) + body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read(path: str) -> dict[str, Any]:
    """The state written by ``write``; StateError naming the file if it is damaged."""
    with open(path, "rb") as f:
        raw = f.read()
    head = len(MAGIC) + 4
    if raw[: len(MAGIC)] != MAGIC or len(raw) < head + _LEN.size:
        raise StateError(f"controller checkpoint {path!r} must start with {MAGIC!r}: "
                         f"not a checkpoint, or truncated")
    body = raw[head:]
    if zlib.crc32(body) != struct.unpack("<I", raw[len(MAGIC):head])[0]:
        raise StateError(f"controller checkpoint {path!r} fails its CRC-32 check: damaged")
    (n,), pos, frames = _LEN.unpack_from(body), _LEN.size, []
    for _ in range(n):
        (size,) = _LEN.unpack_from(body, pos)
        frames.append(body[pos + _LEN.size : pos + _LEN.size + size])
        pos += _LEN.size + size
    return decode(frames)


class Checkpointer:
    """Writes ``snapshot()`` to ``path`` every ``interval`` seconds from a daemon thread.

    Returns nothing; a failed write is logged and tried again next time.
    """

    def __init__(self, path: str, interval: float,
                 snapshot: Callable[[], dict[str, Any]]) -> None:
        self.path = path
        self.interval = check_timeout("checkpoint_interval", interval)
        self._snapshot = snapshot
        self._stop = threading.Event()
        self.written = 0
        self.last_seconds = 0.0  # how long the last checkpoint took
        self._thread = threading.Thread(target=self._run, daemon=True, name="tq-checkpoint")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.write_now()

    def write_now(self) -> None:
        started = time.perf_counter()
        try:
            write(self.path, self._snapshot())
        except Exception as exc:  # noqa: BLE001 — logged, retried next interval
            logger.warning("controller checkpoint to %r failed: %s", self.path, exc)
            return
        self.written += 1
        self.last_seconds = time.perf_counter() - started

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10.0)


def reconcile(part: Any, unit: int, held: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Compare the rows partition ``part`` places on ``unit`` with what it ``held``
    (``{"slots", "tokens"}``). Returns (rows whose bytes are gone, slots to free)."""
    rows = np.flatnonzero(part.used & (part.unit[: part.size] == unit))
    want = occupancy(rows, part.generation[rows])
    slots = np.asarray(held["slots"], dtype=np.int64)
    tokens = np.asarray(held["tokens"], dtype=np.int64)
    have = dict(zip(slots.tolist(), tokens.tolist(), strict=True))
    ok = np.array([have.get(s) == t for s, t in
                   zip(part.slot[rows].tolist(), want.tolist(), strict=True)], dtype=bool)
    known = set(zip(part.slot[rows[ok]].tolist(), want[ok].tolist(), strict=True))
    orphans = np.array([s for s, t in have.items() if (s, t) not in known], dtype=np.int64)
    return rows[~ok] if len(rows) else rows, orphans


class Recovery:
    """Mixin of ControllerService: periodic checkpoints and the restart from one."""

    def _init_recovery(self, path: str | None, interval: float | None) -> None:
        self._registrations: dict[tuple[str, str], dict[str, Any]] = {}
        self._restored = False
        self.recovery: dict[str, Any] = {}  # what the last restart found (stats)
        self._checkpointer: Checkpointer | None = None
        if path and os.path.exists(path):
            self._restore(path)
        if path and interval:
            self._checkpointer = Checkpointer(path, interval, self._checkpoint_state)

    def _remember(self, args: dict[str, Any]) -> None:
        """A task's registration, replayed by a restarted controller."""
        with self._cond:  # type: ignore[attr-defined]
            self._registrations[(args["partition"], args["task"])] = args

    def _checkpoint_state(self) -> dict[str, Any]:
        with self._cond:  # type: ignore[attr-defined]
            return {"controller": self.state_dict(),  # type: ignore[attr-defined]
                    "registrations": list(self._registrations.values())}

    def _restore(self, path: str) -> None:
        started = time.perf_counter()
        saved = read(path)
        self.load_state_dict(saved["controller"])  # type: ignore[attr-defined]
        for args in saved["registrations"]:
            self.register_task(**args)  # type: ignore[attr-defined]
        self._restored = True
        self.recovery = {"checkpoint": path, "load_seconds": time.perf_counter() - started}
        logger.warning("controller restarted from checkpoint %r (%d partitions)", path,
                       len(saved["controller"]["partitions"]))

    def _reconcile(self, clients: list[Any]) -> None:
        """After a restart: keep the rows the units still hold, drop the rest, free what
        the units hold that the checkpoint does not know (see the module docstring)."""
        if not self._restored:
            return
        self._restored = False
        started = time.perf_counter()
        lost = orphaned = 0
        for unit, client in enumerate(clients):
            try:
                held = client.call("held", {OWNER_ARG: self._owner_token},  # type: ignore[attr-defined]
                                   timeout=30.0)
            except Exception as exc:  # noqa: BLE001 — a unit that does not answer is lost
                logger.warning("unit %d did not answer after the restart: %s", unit, exc)
                lost += sum(self.unit_lost(unit).values())  # type: ignore[attr-defined]
                continue
            frees: list[tuple[str, np.ndarray]] = []
            with self._cond:  # type: ignore[attr-defined]
                for name, part in self._parts.items():  # type: ignore[attr-defined]
                    empty = {"slots": np.zeros(0, np.int64), "tokens": np.zeros(0, np.int64)}
                    gone, orphans = reconcile(part, unit, held.get(name, empty))
                    if len(gone):
                        self._lose_rows(name, part, gone)  # type: ignore[attr-defined]
                    lost += len(gone)
                    if len(orphans):
                        frees.append((name, orphans))
                unknown = [n for n in held if n not in self._parts]  # type: ignore[attr-defined]
            for name, slots in frees:
                client.call("free", {"partition": name, "slots": slots})
                orphaned += len(slots)
            for name in unknown:
                client.call("drop", {"partition": name,
                                     OWNER_ARG: self._owner_token})  # type: ignore[attr-defined]
                orphaned += len(held[name]["slots"])
        self.recovery.update(rows_lost=lost, slots_freed=orphaned,
                             reconcile_seconds=time.perf_counter() - started)
        logger.warning("controller restart reconciled: %s", self.recovery)

    def _stop_recovery(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.stop()
