"""The wire format: one msgpack header frame plus one raw frame per tensor; never pickle.

A message is a list of frames. Frame 0 is the msgspec/msgpack header
``["tqs", VERSION, n_frames, body]``; ``body`` is the encoded object in which
every tensor-like leaf is a msgpack *ext* value (so it can never be confused
with user data) describing one raw buffer frame:

=========  ====================================================================
ext code   payload (msgpack)
=========  ====================================================================
1 tensor   ``[torch dtype name, shape, byte length, frame number]``
2 ndarray  ``[numpy dtype str ("<f4"), shape, byte length, frame number]``
3 ragged   ``[ext tensor values, ext tensor offsets]``
4 tuple    ``[item, ...]`` (so tuples come back as tuples)
5 tensor   ``[torch dtype name, shape, bytes]``: a small tensor inside the header
6 ndarray  ``[numpy dtype str, shape, bytes]``: a small array inside the header
7 ints     a small 1-D int64 or int32 array: ``b"q"`` or ``b"i"``, then its raw
           little-endian bytes (not msgpack)
8 multi-   ``[ext tensor values, ext tensor shapes, dims]``: a
  ragged   ``tq_stream.multiragged.MultiRagged`` (checked whole on decode)
=========  ====================================================================

``encode(obj, inline=n)`` puts tensors and arrays of at most ``n`` bytes in the
header (codes 5, 6 and 7) instead of frames of their own: for small messages each
frame costs more than copying its bytes (an RPC passes ``inline``; files do not).
Code 7 is for 1-D int64 and int32 arrays, the row addresses most messages carry: it
makes them about twice as cheap to encode and to decode as code 6.

Supported values: dict (str keys), list, tuple, str, int, float, bool, None,
bytes, and as leaves ``torch.Tensor`` (strided, any common dtype incl.
bfloat16/float8), ``numpy.ndarray`` (bool/int/uint/float/complex dtypes) and
``tq_stream.columns.Ragged`` and ``MultiRagged``. bytearray/memoryview leaves come back as bytes,
dict/list/tuple subclasses (OrderedDict, namedtuple) as the plain type, enum
members as their value. numpy scalars are refused (use ``.item()``). Anything
else raises SerializationError: nothing is ever pickled.

Zero copy: ``encode`` exposes each (contiguous) tensor's memory as a
memoryview; ``decode`` builds tensors over the received buffers. Decoded
tensors and arrays SHARE the frame memory and keep it alive. numpy keeps arrays
over read-only frames (bytes) read-only; torch has no read-only tensors, so
treat a tensor decoded from a read-only frame as read-only (``clone()`` before
writing in place). Frames received from zmq and files read by ``framefile.load`` are
private writable memory.
"""

from __future__ import annotations

import math
import reprlib
import threading
from collections.abc import Sequence
from enum import Enum
from typing import Any

import msgspec
import numpy as np
import torch

from tq_stream.columns import SCALARS, Ragged, flat_plain
from tq_stream.errors import SerializationError
from tq_stream.multiragged import MultiRagged

__all__ = ["VERSION", "decode", "encode"]

VERSION = 3  # 2: ext 7 added, 3: ext 8 (an older reader then says so, not "unknown ext")
_READS = frozenset({1, 2, VERSION})  # what 1 and 2 wrote is read as before
_MAGIC = "tqs"
_EXT_TENSOR, _EXT_NDARRAY, _EXT_RAGGED, _EXT_TUPLE = 1, 2, 3, 4
_EXT_SMALL_TENSOR, _EXT_SMALL_NDARRAY = 5, 6
_EXT_INTS = 7  # a small 1-D int64/int32 array inline: a dtype letter, then its raw bytes
_EXT_MULTIRAGGED = 8
_INT_CODES = {"<i8": b"q", "<i4": b"i"}  # numpy dtype str -> its letter in an ext 7 value
_INT_DTYPES = {ord(c): np.dtype(name) for name, c in _INT_CODES.items()}
_INT_LETTERS = {np.dtype(name): c for name, c in _INT_CODES.items()}  # cheaper than .str
_MAX_DEPTH = 64  # nesting limit: bounds recursion on encode (msgspec bounds decode)

_PLAIN = SCALARS  # what msgspec writes as it is
_LISTS_AND_DICTS = frozenset({list, dict})  # written by msgspec as they are (not tuples)

_TORCH_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "bool uint8 int8 int16 int32 int64 uint16 uint32 uint64 float16 bfloat16 float32 "
        "float64 complex64 complex128 float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz"
    ).split()
    if isinstance(getattr(torch, name, None), torch.dtype)
}
_TORCH_NAMES = {dtype: name for name, dtype in _TORCH_DTYPES.items()}
# Dtypes whose CPU tensors ``Tensor.numpy()`` exposes directly (no bfloat16/float8, and
# no complex: a lazily conjugated tensor must be resolved first).
_NUMPY_VIEWABLE = frozenset(
    getattr(torch, name) for name in
    "bool uint8 int8 int16 int32 int64 float16 float32 float64".split()
)

# Keyed by dtype.str ("<f4", "|b1"); decode looks names up here and never parses
# a received string with np.dtype().
_NUMPY_DTYPES: dict[str, np.dtype] = {
    dt.str: dt
    for name in (
        "bool int8 int16 int32 int64 uint8 uint16 uint32 uint64 float16 float32 float64 "
        "complex64 complex128"
    ).split()
    for dt in (np.dtype(name).newbyteorder("<"), np.dtype(name).newbyteorder(">"))
}

_ENCODER = msgspec.msgpack.Encoder()
_ENVELOPE = msgspec.msgpack.Decoder(list[msgspec.Raw])
_HEAD = msgspec.msgpack.Decoder(tuple[str, int, int, msgspec.Raw])  # the envelope, typed
_STR = msgspec.msgpack.Decoder(str)
_INT = msgspec.msgpack.Decoder(int)
_BUFFER_DESC = msgspec.msgpack.Decoder(tuple[str, list[int], int, int])
_SMALL_DESC = msgspec.msgpack.Decoder(tuple[str, list[int], bytes])
_PAIR = msgspec.msgpack.Decoder(tuple[msgspec.msgpack.Ext, msgspec.msgpack.Ext])
_MULTI = msgspec.msgpack.Decoder(tuple[msgspec.msgpack.Ext, msgspec.msgpack.Ext, list[int]])


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {reprlib.repr(value)}"


# ---------------------------------------------------------------------------- encode


class _Buffers(list):
    """The buffer frames of a message being encoded, and its inline limit."""

    def __init__(self, inline: int) -> None:
        super().__init__()
        self.inline = inline


def encode(obj: Any, inline: int = 0) -> list[bytes | memoryview]:
    """Encode ``obj`` as ``[header, *buffers]`` without copying tensor bytes.

    Args:
        obj: a nested dict/list/tuple of plain values and tensor-like leaves.
        inline: tensors and arrays of at most this many bytes are copied into the
            header instead (0: none).

    Returns:
        Frame 0 (bytes) is the header; frame i >= 1 is a memoryview over the
        bytes of the i-th tensor (a contiguous copy only if the tensor was not
        contiguous, or lives on a device other than the CPU).

    Raises:
        SerializationError: a value that is not supported, naming its type.
    """
    buffers = _Buffers(inline)
    body = _prepare(obj, buffers, 0)
    try:
        header = _ENCODER.encode([_MAGIC, VERSION, 1 + len(buffers), body])
    except (TypeError, ValueError, OverflowError) as exc:  # e.g. an int beyond 64 bits
        raise SerializationError(f"cannot encode message: {exc}") from exc
    return [header, *buffers]


def _all_plain(values: Any) -> bool:
    # set(map(type, ...)) scans in C; most lists (object columns) are all plain.
    return set(map(type, values)) <= _PLAIN


def _prepare(obj: Any, buffers: list[memoryview], depth: int) -> Any:
    """Return ``obj`` with tensor-like leaves and tuples replaced by ext values."""
    kind = type(obj)
    if kind in _PLAIN:
        return obj
    if depth >= _MAX_DEPTH:
        raise SerializationError(f"value is nested deeper than {_MAX_DEPTH} levels")
    if isinstance(obj, dict):
        if not set(map(type, obj)) <= {str}:
            bad = next(k for k in obj if type(k) is not str)
            raise SerializationError(f"dict keys must be str, got key {_describe(bad)}")
        if kind is not dict:
            return {k: _prepare(v, buffers, depth + 1) for k, v in obj.items()}
        # Only values that need a change are rebuilt; plain values and plain lists are
        # skipped without a call (most of a request's header is plain).
        changed = None
        inner = depth + 1 < _MAX_DEPTH
        for k, v in obj.items():
            kv = type(v)
            if kv in _PLAIN or (inner and kv is list and _all_plain(v)):
                continue
            new = _prepare(v, buffers, depth + 1)
            if new is not v:
                if changed is None:
                    changed = {}
                changed[k] = new
        return obj if changed is None else {**obj, **changed}
    if isinstance(obj, list):
        if kind is list and (_all_plain(obj) or (depth + 2 < _MAX_DEPTH and
                                                 flat_plain(obj, _LISTS_AND_DICTS))):
            return obj  # e.g. an object column of flat dicts: msgspec writes it as it is
        return [_prepare(v, buffers, depth + 1) for v in obj]
    if isinstance(obj, tuple):
        items = [_prepare(v, buffers, depth + 1) for v in obj]
        return msgspec.msgpack.Ext(_EXT_TUPLE, _ENCODER.encode(items))
    if isinstance(obj, torch.Tensor):
        return _tensor_ext(obj, buffers)
    if isinstance(obj, np.ndarray):
        return _ndarray_ext(obj, buffers)
    if isinstance(obj, Ragged):
        if not isinstance(obj.values, torch.Tensor) or not isinstance(obj.offsets, torch.Tensor):
            raise SerializationError(f"Ragged values and offsets must be tensors, got {obj!r}")
        pair = [_tensor_ext(obj.values, buffers), _tensor_ext(obj.offsets, buffers)]
        return msgspec.msgpack.Ext(_EXT_RAGGED, _ENCODER.encode(pair))
    if isinstance(obj, MultiRagged):
        bad = obj.problem()
        if bad:
            raise SerializationError(f"MultiRagged must be well-formed to be sent: {bad}")
        parts = [_tensor_ext(obj.values, buffers), _tensor_ext(obj.shapes, buffers),
                 list(obj.dims)]
        return msgspec.msgpack.Ext(_EXT_MULTIRAGGED, _ENCODER.encode(parts))
    if isinstance(obj, np.generic):
        raise SerializationError(
            f"cannot serialize numpy scalar {_describe(obj)}; convert it with .item() or "
            "wrap it in a 0-d array"
        )
    if isinstance(obj, Enum):
        return _prepare(obj.value, buffers, depth + 1)
    if isinstance(obj, str | int | float | bytes | bytearray | memoryview):
        return obj  # subclasses of plain types; msgspec writes them as the base type
    raise SerializationError(
        f"cannot serialize {_describe(obj)}: supported are dict (str keys), list, tuple, str, "
        "int, float, bool, None, bytes, torch.Tensor, numpy.ndarray, Ragged and MultiRagged "
        "(no pickle)"
    )


def _tensor_ext(t: torch.Tensor, buffers: list[memoryview]) -> msgspec.msgpack.Ext:
    name = _TORCH_NAMES.get(t.dtype)
    if name is None:
        raise SerializationError(f"unsupported tensor dtype {t.dtype} (shape {tuple(t.shape)})")
    if t.layout != torch.strided or t.is_nested or t.is_quantized:
        raise SerializationError(f"only dense strided tensors are supported, got {t.layout}")
    shape = list(t.shape)
    if t.dtype in _NUMPY_VIEWABLE and t.is_cpu and t.is_contiguous() and t.numel() and \
            not t.is_conj() and not t.is_neg():
        # The common case, about 3x cheaper than the general path below (which resolves
        # a lazy conjugate or negation: such a view's memory holds the values before it).
        view = memoryview((t.detach() if t.requires_grad else t).numpy()).cast("B")
        return _buffer_ext(_EXT_TENSOR, name, shape, view, buffers)
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()  # device memory cannot back a frame; this is the one copy
    t = t.resolve_conj().resolve_neg().contiguous()  # no-ops (no copy) in the common case
    # view(uint8) exposes any dtype's bytes, including ones numpy lacks (bfloat16).
    view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
    return _buffer_ext(_EXT_TENSOR, name, shape, view, buffers)


def _ndarray_ext(a: np.ndarray, buffers: list[memoryview]) -> msgspec.msgpack.Ext:
    letter = _INT_LETTERS.get(a.dtype)
    if letter is not None and a.ndim == 1 and a.nbytes <= getattr(buffers, "inline", 0):
        # Row indexes, units, slots, generations: most messages carry a few. Without a
        # nested descriptor they cost about half as much to encode and to decode.
        return msgspec.msgpack.Ext(_EXT_INTS, letter + a.tobytes())
    if a.dtype.str not in _NUMPY_DTYPES:
        raise SerializationError(
            f"unsupported ndarray dtype {a.dtype} (shape {a.shape}); "
            "only bool, int, uint, float and complex dtypes are supported"
        )
    shape = list(a.shape)
    if a.size and a.flags.c_contiguous:
        view = memoryview(a).cast("B")
    else:
        flat = np.ascontiguousarray(a).reshape(-1)  # no copy if already C-contiguous
        view = memoryview(flat.view(np.uint8))
    return _buffer_ext(_EXT_NDARRAY, a.dtype.str, shape, view, buffers)


def _buffer_ext(
    code: int, dtype: str, shape: list[int], view: memoryview, buffers: list[memoryview]
) -> msgspec.msgpack.Ext:
    if view.nbytes <= getattr(buffers, "inline", 0):
        small = _EXT_SMALL_TENSOR if code == _EXT_TENSOR else _EXT_SMALL_NDARRAY
        return msgspec.msgpack.Ext(small, _ENCODER.encode([dtype, shape, view]))
    buffers.append(view)
    desc = [dtype, shape, view.nbytes, len(buffers)]  # frame number: header is frame 0
    return msgspec.msgpack.Ext(code, _ENCODER.encode(desc))


# ---------------------------------------------------------------------------- decode


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
        if magic == _MAGIC and version in _READS and n_frames == n_views:
            return body
    except msgspec.MsgspecError:
        pass  # the checks below name what is wrong
    try:
        parts = _ENVELOPE.decode(header)
    except msgspec.MsgspecError as exc:
        raise SerializationError(f"malformed header frame ({len(header)} bytes): {exc}") from exc
    if len(parts) != 4 or _STR.decode(parts[0]) != _MAGIC:
        raise SerializationError("header frame is not a tq_stream message (bad magic or length)")
    version = _INT.decode(parts[1])
    if version not in _READS:
        raise SerializationError(f"unsupported format version {version}; this reads "
                                 f"{sorted(_READS)}")
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
            whole = magic == _MAGIC and version in _READS and n_frames == len(views)
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
        if code == _EXT_INTS:  # the most common one: a few row indexes
            return self._ints(data)
        if code == _EXT_TENSOR:
            return self._tensor(data)
        if code == _EXT_NDARRAY:
            return self._ndarray(data)
        if code == _EXT_RAGGED:
            values, offsets = (
                self.ext_hook(e.code, memoryview(e.data)) for e in _PAIR.decode(data)
            )
            if not isinstance(values, torch.Tensor) or not isinstance(offsets, torch.Tensor):
                raise SerializationError("ragged value must hold two tensors")
            return Ragged(values, offsets)
        if code == _EXT_MULTIRAGGED:
            return self._multiragged(data)
        if code == _EXT_SMALL_TENSOR:
            dtype, shape, raw = self._small(data, _TORCH_DTYPES)
            if not raw:
                return torch.empty(shape, dtype=dtype)
            return torch.frombuffer(bytearray(raw), dtype=dtype).view(shape)  # private copy
        if code == _EXT_SMALL_NDARRAY:
            dtype, shape, raw = self._small(data, _NUMPY_DTYPES)
            return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
        if code == _EXT_TUPLE:
            items = self.decoder.decode(data)
            if not isinstance(items, list):
                raise SerializationError(f"tuple payload must be an array, got {_describe(items)}")
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
                                     f"{sorted(_INT_CODES.values())} and whole items, got "
                                     f"{bytes(data[:1])!r} and {len(data) - 1} bytes")
        return np.frombuffer(data[1:], dtype).copy()  # private: ``data`` is reused

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
        dtype, shape, view = self._buffer(data, _TORCH_DTYPES)
        if view.nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        if view.readonly:
            # torch.frombuffer would warn (torch has no read-only tensors); DLPack over
            # a read-only numpy view shares the memory the same way, without the warning.
            flat = torch.from_dlpack(np.frombuffer(view, dtype=np.uint8)).view(dtype)
        else:
            flat = torch.frombuffer(view, dtype=dtype)
        return flat.view(shape)

    def _ndarray(self, data: memoryview) -> np.ndarray:
        dtype, shape, view = self._buffer(data, _NUMPY_DTYPES)
        return np.frombuffer(view, dtype=dtype).reshape(shape)
