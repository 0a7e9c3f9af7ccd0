"""The physical limit: one ``copy_`` of the same bytes into a preallocated buffer.

``put`` copies every field of the TensorDict into a flat byte slab allocated the first
time a key set of that size is seen (cleared slabs are pooled, not freed); ``get`` copies
the requested fields out of the slab into an output buffer preallocated per size and per
thread, and returns views of it (valid until the same thread's next get of that size). So a
warmed-up put or get costs exactly one memory copy of the payload and nothing else.
Jagged fields copy their values (offsets are shared); strings are UTF-8 encoded on put
and copied as bytes both ways (``get`` returns the stored ``str`` objects).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from tensordict import NonTensorStack, TensorDict

from benchmarks.systems.base import System


@dataclass
class _Field:
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    offsets: torch.Tensor | None = None  # jagged: per-row offsets into the values
    strings: list[str] | None = None  # non-tensor field


def _leaf_bytes(value) -> tuple[torch.Tensor, _Field]:
    if isinstance(value, NonTensorStack):
        strings = [str(s) for s in value.tolist()]
        raw = torch.frombuffer(bytearray("\0".join(strings).encode()), dtype=torch.uint8)
        return raw, _Field(0, raw.numel(), torch.uint8, tuple(raw.shape), strings=strings)
    if value.is_nested:
        values = value.values()
        flat = values.reshape(-1).view(torch.uint8)
        f = _Field(0, flat.numel(), values.dtype, tuple(values.shape), offsets=value.offsets())
        return flat, f
    flat = value.contiguous().reshape(-1).view(torch.uint8)
    return flat, _Field(0, flat.numel(), value.dtype, tuple(value.shape))


def _align(n: int, to: int = 64) -> int:
    return (n + to - 1) // to * to


class _Pool:
    """Buffers by size. A cleared slab's buffer is kept (already faulted in) for the next
    put of the same size, so a put never pays for allocation or first-touch page faults."""

    def __init__(self) -> None:
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.setdefault(buf.numel(), []).append(buf)


class _Slab:
    """One flat uint8 buffer holding the fields of one put."""

    def __init__(self, raws: dict[str, tuple[torch.Tensor, _Field]], rows: int, pool: _Pool):
        self.layout, self.rows, off = {}, rows, 0
        for name, (_, f) in raws.items():
            self.layout[name] = _Field(off, f.nbytes, f.dtype, f.shape, f.offsets, f.strings)
            off = _align(off + f.nbytes)
        self.buf = pool.take(off)

    def fits(self, raws: dict[str, tuple[torch.Tensor, _Field]], rows: int) -> bool:
        sizes = {n: f.nbytes for n, (_, f) in raws.items()}
        return rows == self.rows and sizes == {n: f.nbytes for n, f in self.layout.items()}

    def write(self, raws: dict[str, tuple[torch.Tensor, _Field]]) -> None:
        for name, (raw, f) in raws.items():
            dst = self.layout[name]
            self.buf[dst.offset : dst.offset + dst.nbytes].copy_(raw)
            dst.dtype, dst.shape, dst.offsets, dst.strings = f.dtype, f.shape, f.offsets, f.strings

    def view(self, name: str, buf: torch.Tensor, at: int):
        f = self.layout[name]
        if f.strings is not None:
            return NonTensorStack(*f.strings)
        t = buf[at : at + f.nbytes].view(f.dtype).view(f.shape)
        if f.offsets is not None:
            return torch.nested.nested_tensor_from_jagged(t, f.offsets)
        return t


class MemcpySystem(System):
    """The memcpy limit. Only whole key sets previously put can be read back."""

    name = "memcpy"

    def __init__(self) -> None:
        self._slabs: dict[tuple[str, ...], _Slab] = {}
        self._pool = _Pool()
        self._out = threading.local()  # per thread: output buffers by size
        self._lock = threading.Lock()

    def start(self) -> None:
        pass

    def stop(self) -> None:
        self._slabs.clear()
        self._pool = _Pool()
        self._out = threading.local()

    def put(self, keys: list[str], td: TensorDict) -> None:
        k = tuple(keys)
        raws = {name: _leaf_bytes(value) for name, value in td.items()}
        slab = self._slabs.get(k)
        if slab is None or not slab.fits(raws, len(keys)):
            slab = _Slab(raws, len(keys), self._pool)
            with self._lock:
                old, self._slabs[k] = self._slabs.get(k), slab
            if old is not None:
                self._pool.give(old.buf)
        slab.write(raws)

    def get(self, keys: list[str], fields: list[str] | None = None) -> TensorDict:
        k = tuple(keys)
        slab = self._slabs.get(k)
        if slab is None:
            raise KeyError(f"memcpy reads whole key sets that were put; unknown: {keys[:3]}...")
        names = tuple(fields) if fields is not None else tuple(slab.layout)
        cache = getattr(self._out, "bufs", None)
        if cache is None:
            cache = self._out.bufs = {}
        size = sum(_align(slab.layout[n].nbytes) for n in names)
        out = cache.get(size)
        if out is None:
            out = cache[size] = torch.empty(size, dtype=torch.uint8)
        result, at = {}, 0
        for n in names:
            f = slab.layout[n]
            out[at : at + f.nbytes].copy_(slab.buf[f.offset : f.offset + f.nbytes])
            result[n] = slab.view(n, out, at)
            at += _align(f.nbytes)
        return TensorDict(result, batch_size=[len(keys)])

    def clear(self, keys: list[str]) -> None:
        with self._lock:
            slab = self._slabs.pop(tuple(keys), None)
        if slab is not None:
            self._pool.give(slab.buf)
