"""A field's schema as its first write fixed it, and which schemas one may become: plain
values, no torch (the controller checks schemas and holds no tensors; ``columns.py``
turns columns into schemas)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["dense", "ragged", "multiragged", "object"]
ANY = -1  # a dim of a multi-ragged ``dims`` whose size varies per row


@dataclass(frozen=True)
class FieldSchema:
    """What a field's first write fixed.

    Attributes:
        kind: "dense", "ragged", "multiragged" or "object".
        dtype: torch dtype name ("float32", ...), "" for object fields.
        shape: per-row shape for dense; per-row shape after the ragged dim for ragged;
            per-row shape with -1 for each dim that varies per row for multiragged.
    """

    kind: Kind
    dtype: str = ""
    shape: tuple[int, ...] = ()

    def describe(self) -> str:
        if self.kind == "object":
            return "object"
        if self.kind == "multiragged":
            return f"{self.kind} {self.dtype}{pattern(self.shape)}"
        dims = ", ".join(str(d) for d in self.shape)
        head = "*, " if self.kind == "ragged" else ""
        return f"{self.kind} {self.dtype}[{head}{dims}]".replace(", ]", "]")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "dtype": self.dtype, "shape": list(self.shape)}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> FieldSchema:
        # Every message about rows carries their schemas: the few distinct ones are
        # made once (a schema is immutable, so one object may serve every caller).
        key = (d["kind"], d["dtype"], tuple(d["shape"]))
        schema = _SCHEMAS.get(key) if _cacheable(key) else None
        if schema is None:
            schema = FieldSchema(*key)
            if _cacheable(key) and len(_SCHEMAS) < MAX_SCHEMAS:
                _SCHEMAS[key] = schema
        return schema


def _cacheable(key: tuple[Any, Any, tuple[Any, ...]]) -> bool:
    """A schema key of exact types only: ``(True, 2.0) == (1, 2)`` must not make the
    cache hand ``shape=(True, 2.0)`` to a later ``[1, 2]``; a short shape: the cache
    must not keep what a client chose to make large."""
    kind, dtype, shape = key
    return type(kind) is str and type(dtype) is str and len(shape) <= MAX_SCHEMA_DIMS and \
        all(type(n) is int for n in shape)


MAX_SCHEMAS = 1024  # distinct schemas kept by FieldSchema.from_dict (then made anew)
MAX_SCHEMA_DIMS = 16  # longer shapes are not kept
_SCHEMAS: dict[tuple[Any, Any, tuple[Any, ...]], FieldSchema] = {}


def coercible(fixed: FieldSchema, given: FieldSchema) -> bool:
    """True if a column of schema ``given`` may be converted to ``fixed`` (see ``coerce``)."""
    if fixed.dtype != given.dtype:
        return False
    if fixed.kind == "multiragged":  # rows of any kind may fit: their shapes decide
        if given.kind == "ragged":
            return fits(fixed.shape, (-1, *given.shape))
        return given.kind in ("dense", "multiragged") and fits(fixed.shape, given.shape)
    if fixed.kind == "ragged" and given.kind == "dense":
        return bool(given.shape) and given.shape[1:] == fixed.shape
    if fixed.kind == "dense" and given.kind == "ragged":
        return bool(fixed.shape) and fixed.shape[1:] == given.shape
    return False


def pattern(dims: Sequence[int]) -> str:
    """``(3, -1, -1)`` as ``"[3, *, *]"``."""
    return "[" + ", ".join("*" if d == ANY else str(d) for d in dims) + "]"


def fits(dims: Sequence[int], given: Sequence[int]) -> bool:
    """True if rows of pattern ``given`` may fit ``dims`` (equal ndim; each fixed size
    of one is the other's or varies there: the rows' shapes decide)."""
    return len(dims) == len(given) and all(
        a == ANY or b == ANY or a == b for a, b in zip(dims, given, strict=True))
