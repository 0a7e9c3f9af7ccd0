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
written after the last checkpoint are lost. Acks (and steps formed, discards, task
registrations) made after it are not: with ``interval`` set they are appended to
the ack journal next to the checkpoint before their reply (``ack_journal``), and
a restarted controller replays them on top of the checkpoint, so no acked row is
handed out again.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from tq_stream.backends.base import occupancy
from tq_stream.connection.unit_client import UnitClient
from tq_stream.controller import Controller
from tq_stream.controller.partition import PartitionMeta
from tq_stream.controller.task_config import TaskConfig
from tq_stream.controller.units import Units
from tq_stream.deploy.ack_journal import AckJournal, journal_files, read_records, rows_of
from tq_stream.errors import StateError, check_timeout
from tq_stream.messages import unit as um
from tq_stream.serialization import decode, encode

MAGIC = b"TQMETA1\n"
_LEN = struct.Struct("<Q")
logger = logging.getLogger(__name__)


def write(path: str, state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically (0600)."""
    frames = [bytes(memoryview(f)) for f in encode(state)]
    body = _LEN.pack(len(frames)) + b"".join(_LEN.pack(len(f)) + f for f in frames)
    # Imported here: serialization re-exports framefile, so a top-level import would
    # start framefile before serialization finished.
    from tq_stream.framefile import write_atomically

    write_atomically(path, lambda f: f.write(MAGIC + struct.pack("<I", zlib.crc32(body)) + body))


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
    state: dict[str, Any] = decode(frames)
    return state


class Checkpointer:
    """Writes ``snapshot()`` to ``path`` every ``interval`` seconds from a daemon thread.

    Returns nothing; a failed write is logged and tried again next time.
    """

    def __init__(self, path: str, interval: float,
                 snapshot: Callable[[], dict[str, Any]],
                 written: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.path = path
        self.interval = check_timeout("checkpoint_interval", interval)
        self._snapshot = snapshot
        self._written = written  # called with the state once its file is safely written
        self._one_at_a_time = threading.Lock()  # the thread and a restart's first write
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
            with self._one_at_a_time:  # an older state must not overwrite a newer one
                state = self._snapshot()
                write(self.path, state)
                if self._written is not None:
                    self._written(state)
        except Exception as exc:  # noqa: BLE001 — logged, retried next interval
            logger.warning("controller checkpoint to %r failed: %s", self.path, exc)
            return
        self.written += 1
        self.last_seconds = time.perf_counter() - started

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10.0)


def reconcile(part: PartitionMeta, unit: int,
              held: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
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
    """Periodic checkpoints of a controller's metadata and its restart from one.

    Handed the controller (its state, registrations, journal replay and lost units go
    through its methods), its condition, its partitions (read to reconcile them with
    the units) and its ``Units`` (which drop the rows whose bytes are gone); the units'
    clients (``reconcile``) carry the owner token their admin calls need. ``start``
    restores from ``path`` if a
    checkpoint is there, then checkpoints every ``interval`` seconds.
    """

    def __init__(self, controller: Controller, cond: threading.Condition,
                 parts: Mapping[str, PartitionMeta], units: Units,
                 path: str | None, interval: float | None) -> None:
        self._controller = controller
        self._cond = cond
        self._parts = parts
        self._units = units
        self._path, self._interval = path, interval
        self.journal: AckJournal | None = None
        self._registrations: dict[tuple[str, str], dict[str, Any]] = {}
        self._restored = False
        self.found: dict[str, Any] = {}  # what the last restart found (stats)
        self.checkpointer: Checkpointer | None = None

    def start(self) -> None:
        """Restore from the checkpoint if there is one, then start checkpointing."""
        path, interval = self._path, self._interval
        if path and os.path.exists(path):
            self._restore(path)
        if path and interval:
            epochs = [e for e, _ in journal_files(path)]
            self.journal = AckJournal(path, max(epochs, default=0) + 1)
            self._controller.set_journal(self.journal)
            self.checkpointer = Checkpointer(path, interval, self.snapshot,
                                             self._checkpoint_written)
            if self._restored:  # the replayed journal goes into a checkpoint at once
                self.checkpointer.write_now()

    def remember(self, partition: str, task: str, config: TaskConfig,
                 spec: dict[str, Any] | None) -> None:
        """A task's registration (``spec``: its sampler's, None: the default), replayed
        by a restarted controller as ``register_task``'s keyword arguments."""
        args = {"partition": partition, "task": task, **config.to_dict(), "sampler": spec}
        with self._cond:
            self._registrations[(args["partition"], args["task"])] = args
            if self.journal is not None:
                self.journal.registered(args)

    def snapshot(self) -> dict[str, Any]:
        """The state, and (same lock hold) the journal switched to a new epoch: the
        checkpoint covers exactly the records of the files before it."""
        with self._cond:
            state: dict[str, Any] = {"controller": self._controller.state_dict(),
                                     "registrations": list(self._registrations.values())}
            if self.journal is not None:
                state["journal"] = self.journal.rotate()
            return state

    def _checkpoint_written(self, state: dict[str, Any]) -> None:
        """The checkpoint of ``state`` is safely written: the journal files it covers go."""
        journal = self.journal
        if journal is not None and "journal" in state:
            journal.drop_before(state["journal"])

    def _restore(self, path: str) -> None:
        started = time.perf_counter()
        saved = read(path)
        self._controller.load_state_dict(saved["controller"])
        for args in saved["registrations"]:
            self._controller.register_task(**args)
        replayed = self._replay_journal(path, saved.get("journal"))
        self._restored = True
        self.found = {"checkpoint": path, "load_seconds": time.perf_counter() - started,
                      "journal": replayed}
        logger.warning("controller restarted from checkpoint %r (%d partitions)", path,
                       len(saved["controller"]["partitions"]))

    def reconcile(self, clients: Sequence[UnitClient]) -> None:
        """After a restart: keep the rows the units still hold, drop the rest, free what
        the units hold that the checkpoint does not know (see the module docstring)."""
        if not self._restored:
            return
        self._restored = False
        started = time.perf_counter()
        lost = orphaned = 0
        for unit, client in enumerate(clients):
            try:
                held = client.call(um.HELD, um.Nothing(), timeout=30.0)
            except Exception as exc:  # noqa: BLE001 — a unit that does not answer is lost
                logger.warning("unit %d did not answer after the restart: %s", unit, exc)
                lost += sum(self._controller.unit_lost(unit).values())
                continue
            frees: list[tuple[str, np.ndarray]] = []
            with self._cond:
                for name, part in self._parts.items():
                    empty = {"slots": np.zeros(0, np.int64), "tokens": np.zeros(0, np.int64)}
                    gone, orphans = reconcile(part, unit, held.get(name, empty))
                    if len(gone):
                        lost += self._units.lose_rows(part, gone, unit)
                    if len(orphans):
                        frees.append((name, orphans))
                unknown = [n for n in held if n not in self._parts]
            self._units.free_pending()  # rows elsewhere that named a lost entry
            for name, slots in frees:
                client.call(um.FREE, um.Slots(partition=name, slots=slots))
                orphaned += len(slots)
            for name in unknown:
                client.call(um.DROP, um.Partition(partition=name))
                orphaned += len(held[name]["slots"])
        self.found.update(rows_lost=lost, slots_freed=orphaned,
                          reconcile_seconds=time.perf_counter() - started)
        logger.warning("controller restart reconciled: %s", self.found)

    def _replay_journal(self, path: str, epoch: int | None) -> dict[str, int]:
        """Replay the journal files from ``epoch`` on (those of checkpoint ``path``)."""
        total: dict[str, int] = {}
        if epoch is None:  # a checkpoint written without a journal
            return total
        for e, file in journal_files(path):
            if e >= epoch:
                done = self._controller.replay_journal(read_records(file, e), rows_of, file)
                for k, v in done.items():
                    total[k] = total.get(k, 0) + v
        return total

    def stop(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.stop()
        if self.journal is not None:
            with self._cond:
                self._controller.set_journal(None)
                self.journal.close()
                self.journal = None
