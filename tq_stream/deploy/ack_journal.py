"""The ack journal: delivery-state changes since the last metadata checkpoint.

A periodic checkpoint (``meta_checkpoint``) is seconds old when the controller
dies; without more, a restarted controller would hand out again rows acked
since then. So every change of delivery state is appended to a journal file
next to the checkpoint, *before* the call that made it replies:

- ``formed``: a step formed (its shares, so replayed acks find their step);
- ``share_set``: a rank's share of a step formed again at its turn (its rows went
  stale against a version set since, ``controller/turns.py``);
- ``ended``: a closed partition's end step;
- ``discarded``: rows a sampler discarded;
- ``acked``: rows a replica of a rank acked;
- ``registered``: a task registered (so a task that appeared after the
  checkpoint exists again before its acks are replayed).

Files: ``<checkpoint>.acks.<epoch>``, 0600, a header (magic, epoch) then
records ``[u32 length][u32 crc32][msgpack payload]``; arrays travel as raw
little-endian int64 bytes (no pickle). Appends happen under the controller's
lock, in the order the changes were made.

Rotation: the checkpoint thread takes the controller's state and switches the
journal to epoch ``e + 1`` under the same lock hold, so the checkpoint (which
records ``journal: e + 1``) covers exactly the records of the files before
``e + 1``; those are deleted once the checkpoint is safely written. A restarted
controller loads the checkpoint and replays, in order, every file whose epoch is
at least the checkpoint's (a failed checkpoint write leaves the older files in
place: they are replayed on top of the older checkpoint).

Durability: each record is one ``os.write`` of an unbuffered file, so it is in
the kernel's page cache before the reply: a killed controller process (SIGKILL,
OOM) loses nothing. There is no fsync per record (it would cost a disk flush
per ack): an operating-system crash or power loss may lose the last
records, but the units' bytes live in memory and die with the machine anyway.

Damage: a torn last record of a file (a write cut short) is ignored; a record
that fails its checksum with more records after it, or a damaged header, is a
CheckpointError naming the file.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import struct
import zlib
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np

from tq_stream.errors import CheckpointError

MAGIC = b"TQACKS1\n"
_HEAD = struct.Struct("<8sQ")  # magic, epoch
_REC = struct.Struct("<II")  # payload length, crc32 of the payload
MAX_RECORD = 1 << 30  # a larger declared length is damage, not a record
logger = logging.getLogger(__name__)
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode


def _rows(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype="<i8").tobytes()


def rows_of(raw: bytes) -> np.ndarray:
    """The int64 array written by the journal (a copy: the caller may keep it)."""
    return np.frombuffer(raw, dtype="<i8").astype(np.int64)


def journal_files(path: str) -> list[tuple[int, str]]:
    """``(epoch, file)`` of every journal file of checkpoint ``path``, oldest first."""
    pattern = re.compile(re.escape(os.path.basename(path)) + r"\.acks\.(\d+)$")
    out = []
    for name in glob.glob(glob.escape(path) + ".acks.*"):
        m = pattern.match(os.path.basename(name))
        if m:
            out.append((int(m.group(1)), name))
    return sorted(out)


def read_records(file: str, epoch: int) -> Iterator[list[Any]]:
    """The records of one journal file, in order (a torn last record is skipped).

    Raises:
        CheckpointError: a damaged header, or a damaged record before the last one.
    """
    with open(file, "rb") as f:
        raw = f.read()
    if len(raw) < _HEAD.size:
        if raw and not MAGIC.startswith(raw[: len(MAGIC)]):
            raise CheckpointError(f"ack journal {file!r} must start with {MAGIC!r}")
        return  # created, header cut short by the kill: no record in it
    magic, got = _HEAD.unpack_from(raw)
    if magic != MAGIC or got != epoch:
        raise CheckpointError(f"ack journal {file!r} must start with {MAGIC!r} and epoch "
                              f"{epoch}, got {magic!r} and epoch {got}: damaged")
    pos = _HEAD.size
    while pos < len(raw):
        if pos + _REC.size > len(raw):
            logger.warning("ack journal %r ends in a torn record header: ignored", file)
            return
        size, crc = _REC.unpack_from(raw, pos)
        end = pos + _REC.size + size
        if end > len(raw):
            if size > MAX_RECORD:
                raise CheckpointError(f"ack journal {file!r} has a damaged record at byte "
                                      f"{pos} (length {size})")
            logger.warning("ack journal %r ends in a torn record: ignored", file)
            return
        payload = raw[pos + _REC.size : end]
        if zlib.crc32(payload) != crc:
            if end == len(raw):
                logger.warning("ack journal %r ends in a torn record: ignored", file)
                return
            raise CheckpointError(f"ack journal {file!r} has a record at byte {pos} that "
                                  f"fails its CRC-32 check, with records after it: damaged")
        try:
            record = _decode(payload)
        except msgspec.DecodeError as exc:
            raise CheckpointError(f"ack journal {file!r} has a record at byte {pos} that "
                                  f"does not decode: {exc}") from None
        if not isinstance(record, list) or not record or not isinstance(record[0], str):
            raise CheckpointError(f"ack journal {file!r} has a malformed record at byte {pos}")
        yield record
        pos = end


class AckJournal:
    """The journal file of the current epoch, appended to under the controller's lock.

    Args:
        path: the checkpoint file; journal files are ``<path>.acks.<epoch>``.
        epoch: the epoch of the first file written.
    """

    def __init__(self, path: str, epoch: int) -> None:
        self.path = path
        self.epoch = epoch
        self.records = 0  # appended since this object was made
        self._fd = self._open(epoch)

    def file(self, epoch: int | None = None) -> str:
        return f"{self.path}.acks.{self.epoch if epoch is None else epoch}"

    def _open(self, epoch: int) -> int:
        fd = os.open(self.file(epoch), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND,
                     0o600)
        try:
            os.write(fd, _HEAD.pack(MAGIC, epoch))
        except BaseException:
            os.close(fd)
            raise
        return fd

    # -- records (called with the controller's lock held)
    def acked(self, partition: str, task: str, step: int, dp_rank: int, replica: int,
              rows: np.ndarray, generation: np.ndarray) -> None:
        self._append(["a", partition, task, step, dp_rank, replica, _rows(rows),
                      _rows(generation)])

    def formed(self, partition: str, task: str, step: int, shares: list[np.ndarray],
               generations: list[np.ndarray]) -> None:
        self._append(["f", partition, task, step, [_rows(s) for s in shares],
                      [_rows(g) for g in generations]])

    def share_set(self, partition: str, task: str, step: int, rank: int, rows: np.ndarray,
                  generation: np.ndarray) -> None:
        self._append(["s", partition, task, step, rank, _rows(rows), _rows(generation)])

    def ended(self, partition: str, task: str, step: int) -> None:
        self._append(["e", partition, task, step])

    def discarded(self, partition: str, task: str, reason: str, rows: np.ndarray,
                  generation: np.ndarray) -> None:
        self._append(["d", partition, task, reason, _rows(rows), _rows(generation)])

    def registered(self, args: dict[str, Any]) -> None:
        self._append(["r", args])

    def _append(self, record: list[Any]) -> None:
        payload = _encode(record)
        frame = _REC.pack(len(payload), zlib.crc32(payload)) + payload
        start = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            done = os.write(self._fd, frame)
            while done < len(frame):  # a short write (disk full): finish or undo
                done += os.write(self._fd, frame[done:])
        except BaseException:
            os.ftruncate(self._fd, start)  # no torn record in the middle of the file
            raise
        self.records += 1

    # -- rotation
    def rotate(self) -> int:
        """Switch to a new file, epoch + 1 (lock held, with the state taken); returns
        the new epoch, which the checkpoint of that state records."""
        fd = self._open(self.epoch + 1)
        os.close(self._fd)
        self._fd, self.epoch = fd, self.epoch + 1
        return self.epoch

    def drop_before(self, epoch: int) -> int:
        """Delete the files older than ``epoch`` (a checkpoint covers them); returns
        how many were deleted."""
        n = 0
        for e, name in journal_files(self.path):
            if e < epoch:
                try:
                    os.unlink(name)
                    n += 1
                except FileNotFoundError:
                    pass
        return n

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


__all__ = ["AckJournal", "journal_files", "read_records", "rows_of"]
