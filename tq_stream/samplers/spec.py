"""Samplers as plain data, so a remote controller can build the same sampler.

A spec is ``{"class": "module.QualName", "args": [...], "kwargs": {...}}`` made
from the arguments the sampler was constructed with (``Sampler.__new__``
records them); nested samplers (``inner=...``) become nested specs. Nothing is
pickled: the controller imports the class by name, and only from
``tq_stream.samplers`` or from modules the deployment explicitly allows.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

from tq_stream.errors import ConfigError
from tq_stream.samplers.base import Sampler, check_sampler

BUILTIN_PREFIX = "tq_stream.samplers."
_PLAIN = (str, int, float, bool, type(None))


# Plain data as a sampler's spec carries it (a sampler becomes {"__sampler__": spec}).
Spec = str | int | float | bool | None | list["Spec"] | dict[str, "Spec"]


def _encode(value: object, where: str) -> Spec:
    if isinstance(value, Sampler):
        return {"__sampler__": to_spec(value)}
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, list | tuple):
        return [_encode(v, where) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _encode(v, where) for k, v in value.items()}
    raise ConfigError(
        f"{where} must be plain data (str, numbers, lists, dicts, samplers) to reach a "
        f"remote controller, got {type(value).__name__}: {value!r:.60}; "
        f"use an embedded stream for samplers built from functions"
    )


def to_spec(sampler: Sampler) -> dict[str, Any]:
    """The spec of ``sampler`` (raises ConfigError if an argument is not plain data)."""
    cls = type(check_sampler(sampler))
    args, kwargs = getattr(sampler, "_spec_args", ((), {}))
    name = f"{cls.__module__}.{cls.__qualname__}"
    return {
        "class": name,
        "args": [_encode(a, f"argument {i} of {name}") for i, a in enumerate(args)],
        "kwargs": {k: _encode(v, f"argument {k!r} of {name}") for k, v in kwargs.items()},
        "state": _encode(sampler.state_dict(), f"state of {name}"),
    }


def _decode(value: object, allowed: tuple[str, ...]) -> object:
    if isinstance(value, dict):
        if set(value) == {"__sampler__"}:
            return from_spec(value["__sampler__"], allowed)
        return {k: _decode(v, allowed) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v, allowed) for v in value]
    return value


def from_spec(spec: dict[str, Any], allowed_modules: Iterable[str] = ()) -> Sampler:
    """Build the sampler a spec describes.

    Raises:
        ConfigError: the class is outside tq_stream.samplers and the allowed
            modules, cannot be imported, or is not a Sampler.
    """
    allowed = tuple(allowed_modules)
    name = spec.get("class") if isinstance(spec, dict) else None
    if not isinstance(name, str) or "." not in name:
        raise ConfigError(f"sampler spec must name a class as 'module.Class', got {spec!r:.80}")
    module, _, qual = name.rpartition(".")
    ok = name.startswith(BUILTIN_PREFIX) or any(
        module == m or module.startswith(m + ".") for m in allowed)
    if not ok:
        raise ConfigError(
            f"sampler class must come from tq_stream.samplers or a module allowed by "
            f"init(..., sampler_modules=[...]), got {name!r}"
        )
    try:
        cls = getattr(importlib.import_module(module), qual)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"sampler class {name!r} cannot be imported: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, Sampler)):
        raise ConfigError(f"sampler class must subclass Sampler, got {name!r}")
    args = _decode(spec.get("args", []), allowed)
    kwargs = _decode(spec.get("kwargs", {}), allowed)
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise ConfigError(f"sampler spec of {name!r} must have a list of args and a dict "
                          f"of kwargs, got {type(args).__name__} and {type(kwargs).__name__}")
    sampler = cls(*args, **kwargs)
    state = spec.get("state")
    if state:
        sampler.load_state_dict(state)
    return sampler
