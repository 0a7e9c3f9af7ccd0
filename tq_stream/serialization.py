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

Supported values: ``msgspec.Struct`` (a typed message, ``tq_stream.messages``: written
as the map of its fields, those None by default left out while None), dict (str keys),
list, tuple, str, int, float, bool, None, bytes, and as leaves ``torch.Tensor``
(strided, any common dtype incl. bfloat16/float8), ``numpy.ndarray``
(bool/int/uint/float/complex dtypes) and
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

from enum import Enum
from typing import Any

import msgspec
import numpy as np
import torch

from tq_stream.columns import SCALARS, Ragged, flat_plain
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
    TORCH_DTYPES,
    VERSION,
    describe,
)
from tq_stream.wire_decode import decode

__all__ = ["VERSION", "decode", "encode"]

_INT_LETTERS = {np.dtype(name): c for name, c in INT_CODES.items()}  # cheaper than .str
_MAX_DEPTH = 64  # nesting limit: bounds recursion on encode (msgspec bounds decode)

_PLAIN = SCALARS  # what msgspec writes as it is
_LISTS_AND_DICTS = frozenset({list, dict})  # written by msgspec as they are (not tuples)

_TORCH_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}
# Dtypes whose CPU tensors ``Tensor.numpy()`` exposes directly (no bfloat16/float8, and
# no complex: a lazily conjugated tensor must be resolved first).
_NUMPY_VIEWABLE = frozenset(
    getattr(torch, name) for name in
    "bool uint8 int8 int16 int32 int64 float16 float32 float64".split()
)

_ENCODER = msgspec.msgpack.Encoder()
_OPTIONAL: dict[type, tuple[str, ...]] = {}  # per struct type: fields whose default is None

# ---------------------------------------------------------------------------- encode


class _Buffers(list[memoryview]):
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
        header = _ENCODER.encode([MAGIC, VERSION, 1 + len(buffers), body])
    except (TypeError, ValueError, OverflowError) as exc:  # e.g. an int beyond 64 bits
        raise SerializationError(f"cannot encode message: {exc}") from exc
    return [header, *buffers]


def _fields(obj: msgspec.Struct) -> dict[str, Any]:
    """A typed message as the map of its fields, without the ones that are None by
    default and None (the decoder fills them in again: the map is what a dict reply
    was)."""
    out = msgspec.structs.asdict(obj)
    kind = type(obj)
    optional = _OPTIONAL.get(kind)
    if optional is None:
        optional = _OPTIONAL[kind] = tuple(f.name for f in msgspec.structs.fields(kind)
                                           if f.default is None)
    for name in optional:
        if out[name] is None:
            del out[name]
    return out


def _all_plain(values: Any) -> bool:
    # set(map(type, ...)) scans in C; most lists (object columns) are all plain.
    return set(map(type, values)) <= _PLAIN


def _prepare(obj: Any, buffers: _Buffers, depth: int) -> Any:
    """Return ``obj`` with tensor-like leaves and tuples replaced by ext values."""
    kind = type(obj)
    if kind in _PLAIN:
        return obj
    if depth >= _MAX_DEPTH:
        raise SerializationError(f"value is nested deeper than {_MAX_DEPTH} levels")
    if isinstance(obj, dict):
        if not set(map(type, obj)) <= {str}:
            bad = next(k for k in obj if type(k) is not str)
            raise SerializationError(f"dict keys must be str, got key {describe(bad)}")
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
    if isinstance(obj, msgspec.Struct):
        return _prepare(_fields(obj), buffers, depth)
    if isinstance(obj, list):
        if kind is list and (_all_plain(obj) or (depth + 2 < _MAX_DEPTH and
                                                 flat_plain(obj, _LISTS_AND_DICTS))):
            return obj  # e.g. an object column of flat dicts: msgspec writes it as it is
        return [_prepare(v, buffers, depth + 1) for v in obj]
    if isinstance(obj, tuple):
        items = [_prepare(v, buffers, depth + 1) for v in obj]
        return msgspec.msgpack.Ext(EXT_TUPLE, _ENCODER.encode(items))
    if isinstance(obj, torch.Tensor):
        return _tensor_ext(obj, buffers)
    if isinstance(obj, np.ndarray):
        return _ndarray_ext(obj, buffers)
    if isinstance(obj, Ragged):
        if not isinstance(obj.values, torch.Tensor) or not isinstance(obj.offsets, torch.Tensor):
            raise SerializationError(f"Ragged values and offsets must be tensors, got {obj!r}")
        pair = [_tensor_ext(obj.values, buffers), _tensor_ext(obj.offsets, buffers)]
        return msgspec.msgpack.Ext(EXT_RAGGED, _ENCODER.encode(pair))
    if isinstance(obj, MultiRagged):
        bad = obj.problem()
        if bad:
            raise SerializationError(f"MultiRagged must be well-formed to be sent: {bad}")
        parts = [_tensor_ext(obj.values, buffers), _tensor_ext(obj.shapes, buffers),
                 list(obj.dims)]
        return msgspec.msgpack.Ext(EXT_MULTIRAGGED, _ENCODER.encode(parts))
    if isinstance(obj, np.generic):
        raise SerializationError(
            f"cannot serialize numpy scalar {describe(obj)}; convert it with .item() or "
            "wrap it in a 0-d array"
        )
    if isinstance(obj, Enum):
        return _prepare(obj.value, buffers, depth + 1)
    if isinstance(obj, str | int | float | bytes | bytearray | memoryview):
        return obj  # subclasses of plain types; msgspec writes them as the base type
    raise SerializationError(
        f"cannot serialize {describe(obj)}: supported are dict (str keys), list, tuple, str, "
        "int, float, bool, None, bytes, torch.Tensor, numpy.ndarray, Ragged and MultiRagged "
        "(no pickle)"
    )


def _tensor_ext(t: torch.Tensor, buffers: _Buffers) -> msgspec.msgpack.Ext:
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
        view = (t.detach() if t.requires_grad else t).numpy().data.cast("B")
        return _buffer_ext(EXT_TENSOR, name, shape, view, buffers)
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()  # device memory cannot back a frame; this is the one copy
    t = t.resolve_conj().resolve_neg().contiguous()  # no-ops (no copy) in the common case
    # view(uint8) exposes any dtype's bytes, including ones numpy lacks (bfloat16).
    view = t.reshape(-1).view(torch.uint8).numpy().data
    return _buffer_ext(EXT_TENSOR, name, shape, view, buffers)


def _ndarray_ext(a: np.ndarray, buffers: _Buffers) -> msgspec.msgpack.Ext:
    letter = _INT_LETTERS.get(a.dtype)
    if letter is not None and a.ndim == 1 and a.nbytes <= buffers.inline:
        # Row indexes, units, slots, generations: most messages carry a few. Without a
        # nested descriptor they cost about half as much to encode and to decode.
        return msgspec.msgpack.Ext(EXT_INTS, letter + a.tobytes())
    if a.dtype.str not in NUMPY_DTYPES:
        raise SerializationError(
            f"unsupported ndarray dtype {a.dtype} (shape {a.shape}); "
            "only bool, int, uint, float and complex dtypes are supported"
        )
    shape = list(a.shape)
    if a.size and a.flags.c_contiguous:
        view = memoryview(a).cast("B")  # type: ignore[arg-type]  # numpy's stubs lack __buffer__
    else:
        flat = np.ascontiguousarray(a).reshape(-1)  # no copy if already C-contiguous
        view = memoryview(flat.view(np.uint8))  # type: ignore[arg-type]
    return _buffer_ext(EXT_NDARRAY, a.dtype.str, shape, view, buffers)


def _buffer_ext(
    code: int, dtype: str, shape: list[int], view: memoryview, buffers: _Buffers
) -> msgspec.msgpack.Ext:
    if view.nbytes <= buffers.inline:
        small = EXT_SMALL_TENSOR if code == EXT_TENSOR else EXT_SMALL_NDARRAY
        return msgspec.msgpack.Ext(small, _ENCODER.encode([dtype, shape, view]))
    buffers.append(view)
    desc = [dtype, shape, view.nbytes, len(buffers)]  # frame number: header is frame 0
    return msgspec.msgpack.Ext(code, _ENCODER.encode(desc))
