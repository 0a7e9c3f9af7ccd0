"""Record files: a sequence of ``serialization.encode``'d objects, written and read one
at a time (a storage unit's checkpoint, streamed in bounded chunks).

Layout (little-endian)::

    magic "TQSRECS1"
    records: frame count n (u64) | n x (length u64, crc32 u32, 4 zero bytes)
             | crc32 of the record's table (u32, 4 zero bytes)
             | the n frames, each padded to a multiple of 64 bytes
    end:     END (u64) | record count (u64) | crc32 of those 16 bytes (u32, 4 zero bytes)

Unlike ``framefile``, nothing holds the whole file: ``write`` takes records from an
iterator and writes each before asking for the next, ``read`` yields each record once
its checksums passed (every length is checked against the bytes left in the file before
anything is allocated). A file cut anywhere, even between two records, lacks its end
and raises ``CheckpointError``. Written atomically, mode 0600, never pickled.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterable, Iterator
from io import BufferedReader
from typing import Any, BinaryIO

import numpy as np
import torch

from tq_stream.errors import CheckpointError
from tq_stream.framefile import FILE_MODE, write_atomically
from tq_stream.serialization import decode, encode

MAGIC = b"TQSRECS1"
END = 2**64 - 1
_COUNT = struct.Struct("<Q")
_ENTRY = struct.Struct("<QI4x")
_CRC = struct.Struct("<I4x")
_END = struct.Struct("<QQ")
_ALIGN = 64  # each frame starts 64-byte aligned within its record (and its buffer)


def write(path: str, records: Iterable[Any], durable: bool = True) -> int:
    """Write every record of ``records`` (each encoded, written, then dropped) to
    ``path`` atomically (``durable``: fsynced, renamed into place; else a plain new file
    of mode 0600, for scratch data); returns how many were written.

    Raises:
        SerializationError: a record is not serializable (nothing is left at ``path``).
        OSError: the file could not be written.
    """
    count = 0

    def write_all(f: BinaryIO) -> None:
        nonlocal count
        f.write(MAGIC)
        for record in records:
            frames = [memoryview(x).cast("B") for x in encode(record)]
            table = bytearray(_COUNT.pack(len(frames)))
            for frame in frames:
                table += _ENTRY.pack(frame.nbytes, zlib.crc32(frame))
            table += _CRC.pack(zlib.crc32(table))
            f.write(table)
            for frame in frames:
                f.write(frame)
                f.write(bytes(-frame.nbytes % _ALIGN))
            count += 1
        end = _END.pack(END, count)
        f.write(end + _CRC.pack(zlib.crc32(end)))

    if durable:
        write_atomically(path, write_all)
    else:
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE), "wb") as f:
            write_all(f)
    return count


def is_record_file(path: str) -> bool:
    """True if ``path`` starts with this format's magic."""
    with open(path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def read(path: str) -> Iterator[Any]:
    """Yield the records of ``path`` in order, each checked before it is decoded; its
    tensors share one buffer of that record only.

    Raises:
        CheckpointError: not a record file, or a truncated or corrupted one (raised
            when the damage is reached: records before it were yielded).
        OSError: the file could not be read.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if f.read(len(MAGIC)) != MAGIC:
            raise CheckpointError(f"{path!r} is not a tq_stream record file "
                                  f"(magic {MAGIC!r} expected)")
        count = 0
        while True:
            head = _exact(f, _COUNT.size, path, size)
            (n,) = _COUNT.unpack(head)
            if n == END:
                rest = _exact(f, _END.size - _COUNT.size + _CRC.size, path, size)
                (stored_count,) = _COUNT.unpack_from(rest, 0)
                (crc,) = _CRC.unpack_from(rest, _COUNT.size)
                if zlib.crc32(head + rest[:_COUNT.size]) != crc or rest[-4:] != bytes(4):
                    raise CheckpointError(f"{path!r} is corrupted: its end fails its checksum")
                if stored_count != count or f.read(1):
                    raise CheckpointError(f"{path!r} is corrupted: its end names "
                                          f"{stored_count} records, {count} were read, or "
                                          f"bytes follow it")
                return
            yield _record(f, head, n, path, size)
            count += 1


def _record(f: BufferedReader, head: bytes, n: int, path: str, size: int) -> object:
    left = size - f.tell()
    if not 1 <= n <= left // _ENTRY.size:
        raise CheckpointError(f"{path!r} is truncated or corrupted: a record announces "
                              f"{n} frames with {left} bytes left")
    table = head + _exact(f, _ENTRY.size * n + _CRC.size, path, size)
    (crc,) = _CRC.unpack_from(table, len(table) - _CRC.size)
    if zlib.crc32(table[: len(table) - _CRC.size]) != crc:
        raise CheckpointError(f"{path!r} is corrupted: a record's table fails its checksum")
    entries = [_ENTRY.unpack_from(table, _COUNT.size + _ENTRY.size * i) for i in range(n)]
    total = sum(length + -length % _ALIGN for length, _ in entries)
    if total > size - f.tell():
        raise CheckpointError(f"{path!r} is truncated: a record of {total} bytes has "
                              f"{size - f.tell()} left")
    buf = torch.empty(total, dtype=torch.uint8).numpy()  # aligned, one per record
    view, frames, at = buf.data, [], 0
    if f.readinto(view) != total:
        raise CheckpointError(f"{path!r} changed size while being read")
    for length, frame_crc in entries:
        frame = view[at: at + length]
        if zlib.crc32(frame) != frame_crc:
            raise CheckpointError(f"{path!r} is corrupted: a frame of {length} bytes "
                                  f"fails its checksum")
        frames.append(frame)
        at += length + -length % _ALIGN
    if _padding_dirty(buf, entries):
        raise CheckpointError(f"{path!r} is corrupted: a record's padding is not zero")
    try:
        return decode(frames)
    except Exception as exc:  # checksums matched, yet the contents do not decode
        raise CheckpointError(f"{path!r} holds a record that does not decode: "
                              f"{exc}") from None


def _padding_dirty(buf: np.ndarray, entries: list[tuple[int, int]]) -> bool:
    """True if a byte between two frames of a record is not zero (unchecked otherwise)."""
    at = 0
    for length, _ in entries:
        at += length
        pad = -length % _ALIGN
        if pad and buf[at: at + pad].any():
            return True
        at += pad
    return False


def _exact(f: BufferedReader, n: int, path: str, size: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise CheckpointError(f"{path!r} is truncated ({size} bytes): it ends inside a "
                              f"record or before its end")
    return data
