"""The one round-trip check every stateful object passes (STYLE habit 3).

    from tests.helpers.state_roundtrip import assert_state_roundtrip
    assert_state_roundtrip(sampler, GroupSampler(group_size=4),
                           probe=lambda s: s.sample(candidates, 8))

checks that ``obj.state_dict()`` loads into ``fresh`` and ``fresh.state_dict()``
then equals it; that loading is strict (an unexpected key raises ConfigError and
leaves ``fresh`` loadable); that the state is plain data the loaded object does
not alias; and, with ``probe``, that both objects then behave the same.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pytest
import torch

from tq_stream.errors import ConfigError

UNEXPECTED = "__unexpected_state_key__"


def plain(value: Any) -> Any:
    """``value`` with arrays, tensors, tuples and dataclasses as comparable plain data."""
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, np.ndarray | torch.Tensor):
        return {"array": plain(value.tolist()), "dtype": str(value.dtype)}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, np.generic):
        return plain(value.item())
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {type(value).__name__: plain(dataclasses.asdict(value))}
    return value


def assert_state_roundtrip(obj: Any, fresh: Any,
                           probe: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    """Round-trip ``obj``'s state through ``fresh`` (see module docstring); returns the state."""
    state = obj.state_dict()
    assert isinstance(state, Mapping), f"state_dict must return a mapping, got {type(state)}"
    expected = plain(state)
    assert plain(obj.state_dict()) == expected, "state_dict must not change the state"

    with pytest.raises(ConfigError):
        fresh.load_state_dict({**copy.deepcopy(state), UNEXPECTED: 0})

    given = copy.deepcopy(state)
    fresh.load_state_dict(given)
    assert plain(given) == expected, "load_state_dict must not modify its argument"
    loaded = plain(fresh.state_dict())
    assert loaded == expected, _diff(expected, loaded)
    _scramble(given)
    again = plain(fresh.state_dict())
    assert again == expected, "the loaded object aliases the state: " + _diff(expected, again)
    if probe is not None:
        mine, theirs = plain(probe(obj)), plain(probe(fresh))
        assert mine == theirs, f"behaviour after loading differs: {mine!r} != {theirs!r}"
    return state


def _scramble(value: Any) -> None:
    """Overwrite mutable containers in a state in place (to detect aliasing)."""
    if isinstance(value, dict):
        for v in value.values():
            _scramble(v)
    elif isinstance(value, list):
        for v in value:
            _scramble(v)
        value.append("scrambled")
    elif isinstance(value, np.ndarray) and value.size and value.flags.writeable:
        value.fill(value.flat[0] if value.dtype == object else 7)


def _diff(a: Any, b: Any, path: str = "state") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in a.keys() | b.keys():
            if k not in a or k not in b:
                return f"{path}[{k!r}] present in only one state"
            if a[k] != b[k]:
                return _diff(a[k], b[k], f"{path}[{k!r}]")
    return f"{path}: {a!r:.300} != {b!r:.300}"
