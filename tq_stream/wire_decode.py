"""Decoding the wire format that ``serialization.py`` documents and encodes: every
received byte is untrusted, every frame is referenced exactly once, tensors are views
over the frames."""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import torch
from torch.utils.dlpack import from_dlpack

from tq_stream.columns import Ragged
from tq_stream.errors import SerializationError
from tq_stream.multiragged import MultiRagged
from tq_stream.wire_codes import (
    EXT_INTS,
    EXT_MULTIRAGGED,
    EXT_NDARRAY,
    EXT_RAGGED,
    EXT_SMALL_NDARRAY,
    EXT_SMALL_TENSOR,
    EXT_TENSOR,
    EXT_TUPLE,
    INT_CODES,
    MAGIC,
    NUMPY_DTYPES,
    READS,
    TORCH_DTYPES,
    describe,
)

__all__ = ["decode"]

_INT_DTYPES = {ord(c): np.dtype(name) for name, c in INT_CODES.items()}
_ENVELOPE = msgspec.msgpack.Decoder(list[msgspec.Raw])
_HEAD = msgspec.msgpack.Decoder(tuple[str, int, int, msgspec.Raw])  # the envelope, typed
_STR = msgspec.msgpack.Decoder(str)
_INT = msgspec.msgpack.Decoder(int)
_BUFFER_DESC = msgspec.msgpack.Decoder(tuple[str, list[int], int, int])
_SMALL_DESC = msgspec.msgpack.Decoder(tuple[str, list[int], bytes])
_PAIR = msgspec.msgpack.Decoder(tuple[msgspec.msgpack.Ext, msgspec.msgpack.Ext])
_MULTI = msgspec.msgpack.Decoder(tuple[msgspec.msgpack.Ext, msgspec.msgpack.Ext, list[int]])



def decode(frames: Sequence[Any]) -> Any:
    """Rebuild the object ``encode`` produced, sharing memory with ``frames``.

    Args:
        frames: bytes, bytearray, memoryview or zmq.Frame objects.

    Returns:
        The object; tensors and arrays are views over the frames (no copy).

    Raises:
        SerializationError: for any malformed, truncated or unsupported message;
            decode of arbitrary bytes raises nothing else.
    """
    views = [_frame_view(i, f) for i, f in enumerate(frames)]
    if not views:
        raise SerializationError("message has no frames; expected a header frame")
    try:
        return _decode_views(views)
    except SerializationError:
        raise
    except Exception as exc:
        # Received bytes are untrusted: whatever msgspec/numpy/torch raise while
        # interpreting them (RecursionError, ValueError, ...) is a malformed message.
        raise SerializationError(f"malformed message: {type(exc).__name__}: {exc}") from exc


def _frame_view(i: int, frame: Any) -> memoryview:
    if type(frame) is bytes:  # what the unix transport receives: a flat byte view
        return memoryview(frame)
    if not isinstance(frame, bytes | bytearray | memoryview):
        frame = getattr(frame, "buffer", None)  # zmq.Frame, without importing zmq here
        if not isinstance(frame, memoryview):
            raise SerializationError(f"frame {i} must be bytes-like or a zmq.Frame, got {frame!r}")
    view = memoryview(frame)
    if view.format != "B" or view.ndim != 1:
        if not view.c_contiguous:
            raise SerializationError(f"frame {i} is not a contiguous buffer")
        view = view.cast("B")
    return view


def _body(header: memoryview, n_views: int) -> msgspec.Raw:
    """The body of a header frame, once its envelope is checked."""
    try:  # a well-formed envelope in one decode (the common case)
        magic, version, n_frames, body = _HEAD.decode(header)
        if magic == MAGIC and version in READS and n_frames == n_views:
            return body
    except msgspec.MsgspecError:
        pass  # the checks below name what is wrong
    try:
        parts = _ENVELOPE.decode(header)
    except msgspec.MsgspecError as exc:
        raise SerializationError(f"malformed header frame ({len(header)} bytes): {exc}") from exc
    if len(parts) != 4 or _STR.decode(parts[0]) != MAGIC:
        raise SerializationError("header frame is not a tq_stream message (bad magic or length)")
    version = _INT.decode(parts[1])
    if version not in READS:
        raise SerializationError(f"unsupported format version {version}; this reads "
                                 f"{sorted(READS)}")
    n_frames = _INT.decode(parts[2])
    if n_frames != n_views:
        raise SerializationError(f"header announces {n_frames} frames, got {n_views}")
    raise SerializationError("header frame is not a tq_stream message (bad envelope)")


def _decode_views(views: list[memoryview]) -> Any:
    reader = _BodyReader.of_this_thread()
    reader.start(views)
    try:
        try:  # a well-formed message in one pass: envelope and body (the common case)
            magic, version, n_frames, obj = reader.message.decode(views[0])
            whole = magic == MAGIC and version in READS and n_frames == len(views)
        except Exception:  # noqa: BLE001 — decoded again below, the envelope checked first
            whole = False
        if not whole:  # the envelope checked first, so the error names what is wrong
            body = _body(views[0], len(views))
            reader.start(views)
            obj = reader.decoder.decode(body)
    finally:
        used, reader.views, reader.used = reader.used, [], []
    unused = [i for i, u in enumerate(used) if not u] if len(used) > 1 else ()
    if unused:
        raise SerializationError(f"frames {unused} are not referenced by the header")
    return obj


class _BodyReader:
    """The ext hook of one thread's decoder: turns ext values into tensors over the
    frames of the message being decoded (one reader per thread, reused: building a
    msgspec Decoder per message costs more than decoding a small one).

    Invariant: while a message is decoded, every frame i >= 1 is consumed exactly
    once (``used``).
    """

    _local = threading.local()

    def __init__(self) -> None:
        self.views: list[memoryview] = []
        self.used: list[bool] = []
        self.decoder = msgspec.msgpack.Decoder(ext_hook=self.ext_hook)
        self.message = msgspec.msgpack.Decoder(tuple[str, int, int, Any], ext_hook=self.ext_hook)

    @classmethod
    def of_this_thread(cls) -> _BodyReader:
        reader = getattr(cls._local, "reader", None)
        if reader is None or reader.views:  # none yet, or a decode inside a decode
            reader = cls()
            if getattr(cls._local, "reader", None) is None:
                cls._local.reader = reader
        return reader

    def start(self, views: list[memoryview]) -> None:
        self.views = views
        self.used = [True] + [False] * (len(views) - 1)

    def ext_hook(self, code: int, data: memoryview) -> Any:
        if code == EXT_INTS:  # the most common one: a few row indexes
            return self._ints(data)
        if code == EXT_TENSOR:
            return self._tensor(data)
        if code == EXT_NDARRAY:
            return self._ndarray(data)
        if code == EXT_RAGGED:
            values, offsets = (
                self.ext_hook(e.code, memoryview(e.data)) for e in _PAIR.decode(data)
            )
            if not isinstance(values, torch.Tensor) or not isinstance(offsets, torch.Tensor):
                raise SerializationError("ragged value must hold two tensors")
            return Ragged(values, offsets)
        if code == EXT_MULTIRAGGED:
            return self._multiragged(data)
        if code == EXT_SMALL_TENSOR:
            dtype, shape, raw = self._small(data, TORCH_DTYPES)
            if not raw:
                return torch.empty(shape, dtype=dtype)
            return torch.frombuffer(bytearray(raw), dtype=dtype).view(shape)  # private copy
        if code == EXT_SMALL_NDARRAY:
            dtype, shape, raw = self._small(data, NUMPY_DTYPES)
            return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
        if code == EXT_TUPLE:
            items = self.decoder.decode(data)
            if not isinstance(items, list):
                raise SerializationError(f"tuple payload must be an array, got {describe(items)}")
            return tuple(items)
        raise SerializationError(f"unknown ext type {code} in header")

    def _multiragged(self, data: memoryview) -> MultiRagged:
        values_ext, shapes_ext, dims = _MULTI.decode(data)
        values, shapes = (self.ext_hook(e.code, memoryview(e.data))
                          for e in (values_ext, shapes_ext))
        if not isinstance(values, torch.Tensor) or not isinstance(shapes, torch.Tensor):
            raise SerializationError("multi-ragged value must hold two tensors")
        col = MultiRagged(values, shapes, tuple(dims))
        bad = col.problem()
        if bad:
            raise SerializationError(f"malformed multi-ragged value: {bad}")
        return col

    @staticmethod
    def _ints(data: memoryview) -> np.ndarray:
        dtype = _INT_DTYPES.get(data[0]) if len(data) else None
        if dtype is None or (len(data) - 1) % dtype.itemsize:
            raise SerializationError(f"int array payload must be a dtype letter "
                                     f"{sorted(INT_CODES.values())} and whole items, got "
                                     f"{bytes(data[:1])!r} and {len(data) - 1} bytes")
        out: np.ndarray = np.frombuffer(data[1:], dtype).copy()  # private: ``data`` is reused
        return out

    def _buffer(self, data: memoryview, table: dict[str, Any]) -> tuple[Any, list[int], memoryview]:
        """Validate one buffer descriptor against ``table`` and claim its frame."""
        name, shape, nbytes, frame = _BUFFER_DESC.decode(data)
        dtype = table.get(name)
        if dtype is None:
            raise SerializationError(f"unsupported dtype {name!r} in header")
        if len(shape) > 64 or any(d < 0 for d in shape):
            raise SerializationError(f"invalid shape {shape} for dtype {name}")
        expected = math.prod(shape) * dtype.itemsize
        if expected != nbytes:
            raise SerializationError(f"{name}{shape} takes {expected} bytes, header says {nbytes}")
        if not 1 <= frame < len(self.views) or self.used[frame]:
            raise SerializationError(f"header references frame {frame}: missing or used twice")
        view = self.views[frame]
        if view.nbytes != nbytes:
            raise SerializationError(f"frame {frame} has {view.nbytes} bytes, header says {nbytes}")
        self.used[frame] = True
        return dtype, shape, view

    @staticmethod
    def _small(data: memoryview, table: dict[str, Any]) -> tuple[Any, list[int], bytes]:
        """Validate a small (inline) buffer against ``table``."""
        name, shape, raw = _SMALL_DESC.decode(data)
        dtype = table.get(name)
        if dtype is None:
            raise SerializationError(f"unsupported dtype {name!r} in header")
        if len(shape) > 64 or any(d < 0 for d in shape):
            raise SerializationError(f"invalid shape {shape} for dtype {name}")
        if math.prod(shape) * dtype.itemsize != len(raw):
            raise SerializationError(f"{name}{shape} takes {math.prod(shape) * dtype.itemsize} "
                                     f"bytes, header holds {len(raw)}")
        return dtype, shape, raw

    def _tensor(self, data: memoryview) -> torch.Tensor:
        dtype, shape, view = self._buffer(data, TORCH_DTYPES)
        if view.nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        if view.readonly:
            # torch.frombuffer would warn (torch has no read-only tensors); DLPack over
            # a read-only numpy view shares the memory the same way, without the warning.
            flat = from_dlpack(np.frombuffer(view, dtype=np.uint8)).view(dtype)
        else:
            flat = torch.frombuffer(view, dtype=dtype)
        return flat.view(shape)

    def _ndarray(self, data: memoryview) -> np.ndarray:
        dtype, shape, view = self._buffer(data, NUMPY_DTYPES)
        return np.frombuffer(view, dtype=dtype).reshape(shape)
