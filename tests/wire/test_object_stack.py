"""Object columns read back as NonTensorStack: ``object_stack`` builds what tensordict's
public ``NonTensorStack.from_list`` builds, member for member."""

from __future__ import annotations

import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from tq_stream.object_stack import _flat_dicts_ok, member_state, object_stack

COLUMNS = {
    "dicts": [{"acc": float(i % 2), "turns": i} for i in range(5)],
    "dicts and scalars": [{"a": 1}, "s", 2, 2.5, None, True, b"x", {}],
    "deep dicts": [{"l": [1, {"b": None}], "d": {"e": [True, "x"]}}, {"k": []}],
    "scalars": ["a", 1, None, 2.5, True, b"x"],
    "strings": [f"src-{i}" for i in range(5)],
    "lists": [[1, 2], [3, 4]],
    "one dict": [{"x": "y"}],
}


def _state(stack: NonTensorStack) -> tuple:
    attrs = {k: v for k, v in vars(stack).items() if k != "tensordicts"}
    members = [member_state(m) if type(m) is NonTensorData else _state(m)
               for m in stack.tensordicts]
    return type(stack), attrs, members


def test_flat_constructor_matches_the_public_one():
    # False would keep reads correct (from_list) but slow: the installed tensordict
    # changed what its private _flat_ntd builds; look again before trusting it.
    assert _flat_dicts_ok()


@pytest.mark.parametrize("name", sorted(COLUMNS))
def test_same_stack_as_from_list(name):
    col = COLUMNS[name]
    got, want = object_stack(col), NonTensorStack.from_list(col)
    assert _state(got) == _state(want)
    assert got.tolist() == want.tolist() == col
    assert all(a.data is b for a, b in zip(got.tensordicts, col, strict=True)
               if type(a) is NonTensorData)


def test_in_a_tensordict_reads_as_from_list():
    col = COLUMNS["dicts"]
    td = TensorDict({"o": object_stack(col), "x": torch.arange(5)}, batch_size=[5])
    ref = TensorDict({"o": NonTensorStack.from_list(col), "x": torch.arange(5)}, batch_size=[5])
    assert td["o"] == ref["o"] == col and td[2]["o"] == col[2]
    assert type(td[1:3].get("o")) is NonTensorStack and td[1:3]["o"] == col[1:3]
    assert type(td.get("o")[0]) is NonTensorData


def test_empty_column():
    assert _state(object_stack([])) == _state(NonTensorStack())
