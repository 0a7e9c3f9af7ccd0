"""The wire format's codes and dtype tables, shared by its encoder
(``serialization.py``, which documents the format) and its decoder (``wire_decode.py``)."""

from __future__ import annotations

import reprlib

import numpy as np
import torch

VERSION = 3  # 2: ext 7 added, 3: ext 8 (an older reader then says so, not "unknown ext")
READS = frozenset({1, 2, VERSION})  # what 1 and 2 wrote is read as before
MAGIC = "tqs"
EXT_TENSOR, EXT_NDARRAY, EXT_RAGGED, EXT_TUPLE = 1, 2, 3, 4
EXT_SMALL_TENSOR, EXT_SMALL_NDARRAY = 5, 6
EXT_INTS = 7  # a small 1-D int64/int32 array inline: a dtype letter, then its raw bytes
EXT_MULTIRAGGED = 8
INT_CODES = {"<i8": b"q", "<i4": b"i"}  # numpy dtype str -> its letter in an ext 7 value
TORCH_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "bool uint8 int8 int16 int32 int64 uint16 uint32 uint64 float16 bfloat16 float32 "
        "float64 complex64 complex128 float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz"
    ).split()
    if isinstance(getattr(torch, name, None), torch.dtype)
}
# Keyed by dtype.str ("<f4", "|b1"); decode looks names up here and never parses
# a received string with np.dtype().
NUMPY_DTYPES: dict[str, np.dtype] = {
    dt.str: dt
    for name in (
        "bool int8 int16 int32 int64 uint8 uint16 uint32 uint64 float16 float32 float64 "
        "complex64 complex128"
    ).split()
    for dt in (np.dtype(name).newbyteorder("<"), np.dtype(name).newbyteorder(">"))
}



def describe(value: object) -> str:
    return f"{type(value).__name__} {reprlib.repr(value)}"
