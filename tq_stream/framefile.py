"""Frame files: ``serialization.encode``'d objects in one file (checkpoints).

Layout (little-endian)::

    magic "TQSDUMP2" | frame count (u64)
    count x (offset u64, length u64, crc32 u32, 4 zero bytes)
    crc32 of everything above (u32), 4 zero bytes
    each frame at a 64-byte aligned offset

Every frame carries a CRC-32 (``zlib.crc32``: no dependency, GB/s) and the header
has its own. ``load`` checks the header, the bounds of every frame and every
checksum before it decodes anything, so a damaged file raises ``CheckpointError``
naming the file and the damage instead of loading wrong values (or failing later
with an IndexError or a MemoryError from a length nobody checked). Files are written
atomically (tmp file, fsync, ``os.replace``) and readable by their owner only (0600);
never pickled.
"""

from __future__ import annotations

import os
import secrets
import struct
import zlib
from collections.abc import Callable
from typing import Any, BinaryIO

from tq_stream.errors import CheckpointError
from tq_stream.serialization import decode, encode

_FILE_MAGIC = b"TQSDUMP2"
_ALIGN = 64  # every frame starts 64-byte aligned in the file (and in load's buffer)
_HEAD = struct.Struct("<8sQ")
_ENTRY = struct.Struct("<QQI4x")
_CRC = struct.Struct("<I4x")
FILE_MODE = 0o600


def _table_end(count: int) -> int:
    return _HEAD.size + _ENTRY.size * count + _CRC.size


def dump(obj: object, path: str | os.PathLike[str]) -> None:
    """Write ``encode(obj)`` to ``path`` atomically, mode 0600 (see module docstring).

    Raises:
        SerializationError: ``obj`` is not serializable (nothing is written).
        OSError: the file could not be written.
    """
    frames = [memoryview(f).cast("B") for f in encode(obj)]
    offsets, pos = [], _table_end(len(frames))
    for frame in frames:
        pos += -pos % _ALIGN
        offsets.append(pos)
        pos += frame.nbytes
    prefix = bytearray(_HEAD.pack(_FILE_MAGIC, len(frames)))
    for offset, frame in zip(offsets, frames, strict=True):
        prefix += _ENTRY.pack(offset, frame.nbytes, zlib.crc32(frame))
    prefix += _CRC.pack(zlib.crc32(prefix))
    path = os.fspath(path)

    def write(f: BinaryIO) -> None:
        f.write(prefix)
        written = len(prefix)
        for offset, frame in zip(offsets, frames, strict=True):
            f.write(bytes(offset - written))
            written = offset + f.write(frame)

    write_atomically(path, write)


def write_atomically(path: str, write: Callable[[Any], None]) -> None:
    """Create ``path`` with what ``write(binary_file)`` writes: into a new temporary
    file of mode 0600 beside it, fsynced, renamed over ``path`` (and the rename made
    durable); on any error nothing is left but what ``path`` held before.

    Raises:
        OSError: the file could not be written.
    """
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
        with open(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(folder)


def fsync_dir(folder: str) -> None:
    """Make renames in ``folder`` durable (not supported on every filesystem)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load(path: str | os.PathLike[str], *, mmap: bool = False) -> Any:
    """Read an object written by ``dump``, after checking every checksum.

    Args:
        path: the file.
        mmap: map the file copy-on-write instead of reading it into memory (the
            checksums still read every page once); writes to the returned tensors
            never reach the file.

    Returns:
        The object; its tensors share one buffer holding the whole file.

    Raises:
        CheckpointError: not a dump file, or a truncated or corrupted one.
        OSError: the file could not be read.
    """
    name = os.fspath(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < _table_end(0):
            raise CheckpointError(f"{name!r} is too short ({size} bytes) for a dump")
        if mmap:
            import mmap as mmap_module

            buf = memoryview(mmap_module.mmap(f.fileno(), 0, access=mmap_module.ACCESS_COPY))
        else:
            data = bytearray(size)
            if f.readinto(data) != size:
                raise CheckpointError(f"{name!r} changed size while being read")
            buf = memoryview(data)
    frames = _file_frames(buf, name)
    try:
        return decode(frames)
    except Exception as exc:  # checksums matched, yet the contents do not decode
        raise CheckpointError(f"{name!r} holds frames that do not decode: {exc}") from None


def _file_frames(buf: memoryview, path: str) -> list[memoryview]:
    """The checked frames of a dump held in ``buf``."""
    magic, count = _HEAD.unpack_from(buf, 0)
    if magic != _FILE_MAGIC:
        raise CheckpointError(f"{path!r} is not a tq_stream dump (magic {magic!r}, "
                              f"expected {_FILE_MAGIC!r})")
    if not 1 <= count <= (len(buf) - _table_end(0)) // _ENTRY.size:
        raise CheckpointError(f"{path!r} is truncated or corrupted: it announces {count} "
                              f"frames; the file has {len(buf)} bytes")
    end = _table_end(count)
    (stored,) = _CRC.unpack_from(buf, end - _CRC.size)
    if zlib.crc32(buf[: end - _CRC.size]) != stored:
        raise CheckpointError(f"{path!r} is corrupted: its frame table fails its checksum")
    frames, low = [], end
    for i in range(count):
        offset, length, crc = _ENTRY.unpack_from(buf, _HEAD.size + _ENTRY.size * i)
        if offset < low or offset + length > len(buf):
            raise CheckpointError(
                f"{path!r} is truncated or corrupted: frame {i} spans [{offset}, "
                f"{offset + length}), outside [{low}, {len(buf)})")
        frame = buf[offset: offset + length]
        if zlib.crc32(frame) != crc:
            raise CheckpointError(f"{path!r} is corrupted: frame {i} ({length} bytes at "
                                  f"{offset}) fails its checksum")
        frames.append(frame)
        low = offset + length
    return frames
