"""Checks of what a put carries (its keys and tags), below the client and the controller.

The writer and ``KV`` check a put before anything is stored, and the controller checks
the same arguments when they arrive over a wire; both call these, so a put is refused
with the same message whichever side sees it first.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from tq_stream.errors import ConfigError, KeyConflictError

TagValue = str | int | float | bool | None
_SCALARS = (str, int, float, bool, type(None))
_INT_MIN, _INT_MAX = -(2**63), 2**63 - 1
RESERVED = "\x00"  # no user key starts with it (``controller.shared_entries.ENTRY_PREFIX``)


def check_unreserved(keys: Sequence[str]) -> None:
    """No key of ``keys`` (non-empty str) starts with ``RESERVED``."""
    bad = [k for k in keys if k[0] == RESERVED]
    if bad:
        raise ConfigError(f"keys must not start with {RESERVED!r} (reserved for shared "
                          f"entries), got {bad[:5]!r}")


def check_keys(keys: object) -> list[str]:
    """Keys of a put: a non-empty list of distinct non-empty str, none starting with
    ``RESERVED`` (the prefix of shared entries' own keys)."""
    if type(keys) is list and len(keys) == 1 and type(keys[0]) is str and keys[0] and \
            keys[0][0] != RESERVED:
        return list(keys)  # one key: the common small put, checked without the ABCs
    if isinstance(keys, str) or not isinstance(keys, Sequence):
        raise ConfigError(f"keys must be a list of str, got {type(keys).__name__}")
    keys = list(keys)
    if not keys:
        raise ConfigError("keys must name at least one row, got []")
    bad = [k for k in keys if not isinstance(k, str) or not k]
    if bad:
        raise ConfigError(f"keys must be non-empty str, got {bad[:5]!r}")
    check_unreserved(keys)
    if len(set(keys)) != len(keys):
        seen: set[str] = set()
        dup = [k for k in keys if k in seen or seen.add(k)]  # type: ignore[func-returns-value]
        raise KeyConflictError(f"keys must be distinct within one put, got duplicates "
                               f"{sorted(set(dup))[:5]}")
    out: list[str] = keys
    return out


def check_fields(fields: object) -> list[str] | None:
    """Field names to read: None (every written field) or a list of str. A single str
    is refused (it would be read as its characters)."""
    if fields is None:
        return None
    if isinstance(fields, str) or not isinstance(fields, Sequence):
        raise ConfigError(f"fields must be a list of str (one name: [{fields!r}]), got "
                          f"{type(fields).__name__} {fields!r:.80}")
    bad = [f for f in fields if not isinstance(f, str) or not f]
    if bad:
        raise ConfigError(f"fields must be non-empty str, got {bad[:5]!r}")
    return list(fields)


# What a put takes as tags: one dict per row (one dict for one row), or None.
TagsIn = Mapping[str, object] | Sequence[Mapping[str, object]] | None


def check_tags(tags: Any, n: int) -> list[dict[str, TagValue]] | None:
    """Validate ``tags`` for a put of ``n`` rows: None or n dicts of JSON-like scalars."""
    if tags is None:
        return None
    if isinstance(tags, Mapping):
        tags = [tags] * n if n == 1 else None
        if tags is None:
            raise ConfigError(f"tags must be a list of {n} dicts (one per row), got one dict")
    if not isinstance(tags, Sequence) or isinstance(tags, str | bytes) or len(tags) != n:
        got = type(tags).__name__ if not isinstance(tags, Sequence) or \
            isinstance(tags, str | bytes) else len(tags)
        raise ConfigError(f"tags must be a list of {n} dicts (one per row), got {got}")
    for i, row in enumerate(tags):
        _check_row(row, f"tags[{i}]")
    return [dict(r) for r in tags]


def check_tag(tag: object) -> dict[str, TagValue] | None:
    """The tags of one row, as ``KV.put``'s ``tag=`` takes them: None or one dict."""
    if tag is None:
        return None
    _check_row(tag, "tag")
    rows = check_tags([tag], 1)
    return rows[0] if rows else None


def _check_row(row: object, name: str) -> None:
    if not isinstance(row, Mapping):
        raise ConfigError(f"{name} must be a dict, got {type(row).__name__}")
    for k, v in row.items():
        if not isinstance(k, str) or not k:
            raise ConfigError(f"{name} keys must be non-empty str, got {k!r}")
        if not isinstance(v, _SCALARS) or isinstance(v, float) and math.isnan(v):
            raise ConfigError(
                f"{name}[{k!r}] must be a str, int, float, bool or None (not NaN), got {v!r}"
            )
        if type(v) is int and not _INT_MIN <= v <= _INT_MAX:
            raise ConfigError(f"{name}[{k!r}] must fit in int64, got {v!r}")


__all__ = ["TagValue", "check_keys", "check_tag", "check_tags"]
