"""Object columns (lists of plain values) as the ``NonTensorStack`` a TensorDict holds:
what ``NonTensorStack.from_list`` builds, without its slow path for dict rows."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import cache
from typing import Any

from tensordict import NonTensorData, NonTensorStack, TensorDictBase

from tq_stream.columns import SCALARS

# tensordict's private flat NonTensorData constructor: used only as _flat_dicts_ok allows
_flat_ntd: Callable[..., NonTensorData] = vars(
    importlib.import_module("tensordict.tensorclass"))["_flat_ntd"]
_DICT_ROWS = SCALARS | {dict}  # the rows object_stack builds itself


def object_stack(column: list[Any]) -> NonTensorStack:
    """An object column as ``NonTensorStack.from_list(column)`` builds it, faster.

    ``from_list`` takes tensordict's flat path for scalar rows only: a dict row goes
    through the general ``NonTensorData(data=row)`` (~3x the time of a scalar). Here
    dict rows are built by tensordict's own flat constructor (``_flat_ntd``, what its
    fast path builds scalar rows with), while ``_flat_dicts_ok`` finds that it builds
    what the public constructor does; any other column goes to ``from_list``.
    """
    if not column:
        return NonTensorStack()
    kinds = set(map(type, column))
    if kinds <= SCALARS:  # what from_list passes on, without its call per row
        return NonTensorStack(*column)
    if dict in kinds and kinds <= _DICT_ROWS and _flat_dicts_ok():
        return NonTensorStack(*[_flat_ntd(v, None) if type(v) is dict else v for v in column])
    return NonTensorStack.from_list(column)


def member_state(obj: object) -> tuple[type, dict[str, Any]]:
    """What tells two NonTensorData apart: the type and every attribute (with its
    type), through the TensorDict inside."""
    return type(obj), {k: member_state(v) if isinstance(v, TensorDictBase) else (type(v), v)
                       for k, v in vars(obj).items()}


@cache
def _flat_dicts_ok() -> bool:
    """Whether ``_flat_ntd`` builds dict rows as ``NonTensorData(data=row)`` does, on
    the installed tensordict (checked once; False sends dict rows to ``from_list``)."""
    rows = [{"a": 1}, {"s": "x", "l": [1, 2.5, None], "d": {"b": True}}, {}]
    return all(member_state(_flat_ntd(r, None)) == member_state(NonTensorData(data=r))
               and _flat_ntd(r, None).data is r for r in rows)
