"""Field values as TransferQueue accepts them, in the forms tq_stream stores.

TransferQueue keeps whatever a row was given (it pickles). tq_stream stores tensors,
jagged tensors and plain values (str, int, float, bool, bytes, None, lists/dicts of
those), never pickle. This module bridges the two, per field:

- an ``np.ndarray(dtype=object)`` (which a TensorDict wraps as one ``NonTensorData``
  holding the whole array) becomes a list of its rows;
- rows that hold tensors inside Python objects (verl's ``multi_modal_inputs``: a dict
  of tensors per row) are encoded: every tensor becomes the plain dict
  ``{TENSOR: {"dtype", "shape", "data": bytes}}``; ``decode_rows`` turns them back,
  byte-exact with their dtype. Such a field is stored under its own physical name
  (``variants.ENCODED``) so only it is decoded on reads.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack

from tq_stream.columns import dtype_from_name, dtype_name, flat_plain

TENSOR = "__tq_compat_tensor__"
_MAX_DEPTH = 16


def rows_of(value: object, n: int) -> list[Any] | None:
    """``value``'s rows as a list when it is a non-tensor field, else None."""
    if isinstance(value, NonTensorStack):
        rows: list[Any] = value.tolist()
        return rows
    if isinstance(value, NonTensorData):
        data = value.data
        if isinstance(data, np.ndarray) and data.dtype == object and data.shape[:1] == (n,):
            listed: list[Any] = data.tolist()
            return listed
        if isinstance(data, list) and len(data) == n and n != 1:
            return list(data)
        return [data] * n
    if isinstance(value, np.ndarray) and value.dtype == object:
        objects: list[Any] = value.tolist()
        return objects
    if isinstance(value, list | tuple):
        return list(value)
    return None


def _has_tensor(value: object, depth: int = 0) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if depth >= _MAX_DEPTH:
        return False
    if isinstance(value, dict):
        return any(_has_tensor(v, depth + 1) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_has_tensor(v, depth + 1) for v in value)
    return False


def needs_encoding(rows: list[Any]) -> bool:
    """Some row holds a tensor inside a dict or list (a row that is itself a tensor is
    a tensor field, not this)."""
    if flat_plain(rows):  # the common field: no Python call per row
        return False
    return any(isinstance(r, dict | list | tuple) and _has_tensor(r) for r in rows)


def _encode(value: object, depth: int = 0) -> object:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {TENSOR: {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "data": data}}
    if depth >= _MAX_DEPTH:
        return value
    if isinstance(value, dict):
        return {k: _encode(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_encode(v, depth + 1) for v in value]
    return value


def _decode(value: object, depth: int = 0) -> object:
    if isinstance(value, dict):
        spec = value.get(TENSOR) if len(value) == 1 else None
        if isinstance(spec, dict):
            dtype = dtype_from_name(spec["dtype"])
            shape = tuple(spec["shape"])
            if not spec["data"]:
                return torch.empty(shape, dtype=dtype)
            raw = torch.frombuffer(bytearray(spec["data"]), dtype=torch.uint8)
            return raw.view(dtype).reshape(shape)
        if depth >= _MAX_DEPTH:
            return value
        return {k: _decode(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list) and depth < _MAX_DEPTH:
        return [_decode(v, depth + 1) for v in value]
    return value


def encode_rows(rows: list[Any]) -> list[Any]:
    """Rows with every tensor inside replaced by its plain encoding."""
    return [_encode(r) for r in rows]


def decode_rows(rows: list[Any]) -> list[Any]:
    """``encode_rows`` undone."""
    return [_decode(r) for r in rows]
