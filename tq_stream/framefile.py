"""Frame files: ``serialization.encode``'d objects in one file (checkpoints).

Layout: magic (8 bytes), frame count (u64), (offset, length) u64 pairs, then each
frame at a 64-byte aligned offset. Written atomically; read with one ``readinto``
(or mmap); never pickled.
"""

from __future__ import annotations

import os
import secrets
import struct
from typing import Any

from tq_stream.errors import SerializationError
from tq_stream.serialization import decode, encode

_FILE_MAGIC = b"TQSDUMP1"
_ALIGN = 64  # every frame starts 64-byte aligned in the file (and in load's buffer)
_U64 = struct.Struct("<Q")


def dump(obj: Any, path: str | os.PathLike[str]) -> None:
    """Write ``encode(obj)`` to ``path`` atomically (tmp file, fsync, os.replace).

    Layout: magic (8 bytes), frame count (u64), (offset, length) u64 pairs, then
    each frame at a 64-byte aligned offset.

    Raises:
        SerializationError: ``obj`` is not serializable (nothing is written).
        OSError: the file could not be written.
    """
    frames = encode(obj)
    table_end = len(_FILE_MAGIC) + 8 + 16 * len(frames)
    offsets, pos = [], table_end
    for frame in frames:
        pos += -pos % _ALIGN
        offsets.append(pos)
        pos += memoryview(frame).nbytes
    prefix = bytearray(_FILE_MAGIC + _U64.pack(len(frames)))
    for offset, frame in zip(offsets, frames, strict=True):
        prefix += _U64.pack(offset) + _U64.pack(memoryview(frame).nbytes)
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(prefix)
            written = len(prefix)
            for offset, frame in zip(offsets, frames, strict=True):
                f.write(bytes(offset - written))
                written = offset + f.write(frame)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(folder)


def _fsync_dir(folder: str) -> None:
    # Makes the rename durable; not supported on every platform/filesystem.
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
    """Read an object written by ``dump``.

    Args:
        path: the file.
        mmap: map the file copy-on-write instead of reading it into memory;
            tensors then page in lazily and writes to them never reach the file.

    Returns:
        The object; its tensors share one buffer holding the whole file.

    Raises:
        SerializationError: not a dump file, or a truncated/corrupt one.
        OSError: the file could not be read.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < len(_FILE_MAGIC) + 8:
            raise SerializationError(f"{os.fspath(path)!r} is too short ({size} bytes) for a dump")
        if mmap:
            import mmap as mmap_module

            buf = memoryview(mmap_module.mmap(f.fileno(), 0, access=mmap_module.ACCESS_COPY))
        else:
            data = bytearray(size)
            if f.readinto(data) != size:
                raise SerializationError(f"{os.fspath(path)!r} changed size while being read")
            buf = memoryview(data)
    return decode(_file_frames(buf, os.fspath(path)))


def _file_frames(buf: memoryview, path: str) -> list[memoryview]:
    if bytes(buf[:8]) != _FILE_MAGIC:
        raise SerializationError(f"{path!r} is not a tq_stream dump (magic {bytes(buf[:8])!r})")
    (count,) = _U64.unpack_from(buf, 8)
    if not 1 <= count <= (len(buf) - 16) // 16:
        raise SerializationError(f"{path!r} announces {count} frames; file has {len(buf)} bytes")
    frames = []
    for i in range(count):
        offset, length = struct.unpack_from("<QQ", buf, 16 + 16 * i)
        if offset + length > len(buf):
            raise SerializationError(
                f"{path!r} is truncated: frame {i} spans [{offset}, {offset + length}) "
                f"beyond {len(buf)} bytes"
            )
        frames.append(buf[offset : offset + length])
    return frames
