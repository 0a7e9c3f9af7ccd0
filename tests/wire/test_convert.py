"""User data in (TensorDict, dict, lists, nested tensors, plain values) and out."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from tq_stream.columns import Ragged
from tq_stream.convert import single_row, to_column, to_columns, to_tensordict
from tq_stream.errors import ConfigError, SchemaError


def rows_of(r: Ragged) -> list[list]:
    return [r.row(i).tolist() for i in range(len(r))]


def test_tensordict_in():
    td = TensorDict({"x": torch.ones(3, 2), "m": torch.zeros(3, dtype=torch.bool)}, [3])
    cols = to_columns(td, 3)
    assert cols["x"].shape == (3, 2) and cols["m"].dtype == torch.bool
    with pytest.raises(SchemaError, match=r"batch size \[2\]"):
        to_columns(td, 2)


def test_dict_in_with_numpy_and_strings():
    cols = to_columns({"a": np.arange(3), "s": np.array(["x", "y", "z"])}, 3)
    assert cols["a"].tolist() == [0, 1, 2] and cols["s"] == ["x", "y", "z"]
    with pytest.raises(ConfigError, match="TensorDict or a dict"):
        to_columns([1, 2], 2)


def test_list_of_tensors_is_ragged_even_with_equal_lengths():
    col = to_column("r", [torch.ones(2), torch.ones(2)], 2)
    assert isinstance(col, Ragged) and col.lengths.tolist() == [2, 2]
    col = to_column("r", [torch.ones(2, 3), torch.ones(5, 3)], 2)
    assert isinstance(col, Ragged) and col.values.shape == (7, 3)
    scalars = to_column("s", [torch.tensor(1.0), torch.tensor(2.0)], 2)
    assert isinstance(scalars, torch.Tensor) and scalars.tolist() == [1.0, 2.0]
    with pytest.raises(SchemaError, match="'r' rows must share dtype"):
        to_column("r", [torch.ones(2), torch.ones(2, dtype=torch.int64)], 2)
    with pytest.raises(SchemaError, match="'r' must not mix"):
        to_column("r", [torch.ones(2), 3], 2)


def test_jagged_nested_tensor_in():
    nt = torch.nested.nested_tensor([torch.arange(3), torch.arange(1)], layout=torch.jagged)
    col = to_column("r", nt, 2)
    assert rows_of(col) == [[0, 1, 2], [0]] and col.offsets.tolist() == [0, 3, 4]


def test_non_contiguous_nested_view_in():
    base = torch.arange(12.0).reshape(3, 4)
    nt = torch.nested.narrow(base, 1, torch.tensor([0, 1, 2]), torch.tensor([2, 1, 2]),
                             layout=torch.jagged)
    col = to_column("r", nt, 3)
    assert rows_of(col) == [[0.0, 1.0], [5.0], [10.0, 11.0]]
    assert col.offsets.tolist() == [0, 2, 3, 5] and col.values.shape == (5,)


def test_nested_with_offsets_not_from_zero():
    nt = torch.nested.nested_tensor_from_jagged(torch.arange(10.0),
                                                offsets=torch.tensor([2, 4, 7]))
    col = to_column("r", nt, 2)
    assert rows_of(col) == [[2.0, 3.0], [4.0, 5.0, 6.0]] and col.offsets.tolist() == [0, 2, 5]


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_strided_nested_tensor_in():
    nt = torch.nested.nested_tensor([torch.ones(2, 3), torch.zeros(4, 3)])
    col = to_column("r", nt, 2)
    assert isinstance(col, Ragged) and col.lengths.tolist() == [2, 4]


def test_object_values():
    values = ["a", 1, None, [1, "b"], {"k": 2.5}, b"raw"]
    assert to_column("o", values, 6) == values
    assert to_column("o", NonTensorStack.from_list(["p", "q"]), 2) == ["p", "q"]
    assert to_column("o", NonTensorData("same"), 3) == ["same"] * 3
    with pytest.raises(SchemaError, match="'o'.*object"):
        to_column("o", [object()], 1)
    with pytest.raises(SchemaError, match="'o' must have 2 rows.*got 1"):
        to_column("o", ["a"], 2)


def test_bad_values():
    with pytest.raises(SchemaError, match="'x'.*0-d tensor"):
        to_column("x", torch.tensor(1.0), 1)
    with pytest.raises(ConfigError, match="field name"):
        to_columns({3: torch.ones(2)}, 2)
    with pytest.raises(SchemaError, match="'x' must be a tensor"):
        to_column("x", 3.0, 1)


def test_single_row():
    cols = single_row({"ids": torch.arange(4), "r": torch.tensor(0.5), "p": "hi",
                       "l": [1, 2], "n": np.arange(2)})
    assert isinstance(cols["ids"], Ragged) and rows_of(cols["ids"]) == [[0, 1, 2, 3]]
    assert cols["r"].tolist() == [0.5]
    assert cols["p"] == ["hi"] and cols["l"] == [[1, 2]]
    assert rows_of(cols["n"]) == [[0, 1]]
    with pytest.raises(ConfigError, match="at least one field"):
        single_row({})
    with pytest.raises(ConfigError, match="dict of fields"):
        single_row([1])


def test_to_tensordict_out():
    cols = {"x": torch.ones(2, 3), "r": Ragged.from_list([torch.ones(1), torch.ones(3)]),
            "o": ["a", "b"]}
    td = to_tensordict(cols, 2)
    assert td.batch_size == (2,) and td["x"].shape == (2, 3)
    assert td["r"].is_nested and [t.shape[0] for t in td["r"].unbind()] == [1, 3]
    assert td.get("o").tolist() == ["a", "b"]
    padded = to_tensordict(cols, 2, ragged="padded")
    assert padded["r"].shape == (2, 3)
    rows = to_tensordict(cols, 2, ragged="list").get("r").tolist()
    assert [r.shape[0] for r in rows] == [1, 3]
    with pytest.raises(ConfigError, match="ragged must be"):
        to_tensordict(cols, 2, ragged="jagged")


# ------------------------------------------------------------------ nested fields


def test_nested_fields_are_flattened_on_put_and_nested_on_get():
    td = TensorDict({"obs": TensorDict({"image": torch.ones(2, 3),
                                        "deep": TensorDict({"v": torch.arange(2)}, [2])}, [2]),
                     "r": torch.zeros(2)}, [2])
    cols = to_columns(td, 2)
    assert sorted(cols) == ["obs.deep.v", "obs.image", "r"]
    assert sorted(to_columns({"obs": {"image": torch.ones(2, 3)}, "r": [1, 2]}, 2)) == \
        ["obs.image", "r"]  # a dict inside a batch dict is nested fields too
    back = to_tensordict(cols, 2)
    assert sorted(back.keys()) == ["obs", "r"]
    assert torch.equal(back["obs", "deep", "v"], torch.arange(2))
    assert back["obs"].batch_size == torch.Size([2])
    one = single_row({"obs": TensorDict({"image": torch.ones(3)}, []), "info": {"k": 1}})
    assert sorted(one) == ["info", "obs.image"] and one["info"] == [{"k": 1}]


@pytest.mark.parametrize("data, words", [
    ({"obs": {"image": torch.ones(2)}, "obs.image": torch.ones(2)}, "'obs.image' is given twice"),
    ({"obs": torch.ones(2), "obs.image": torch.ones(2)}, "'obs.image' collides with field 'obs'"),
    ({"obs": {}}, "'obs' must hold at least one nested field"),
    ({"a..b": torch.ones(2)}, "empty segment"),
    ({"a.": torch.ones(2)}, "empty segment"),
])
def test_nested_names_cannot_collide(data, words):
    with pytest.raises(SchemaError, match=words.replace("(", r"\(").replace(".", r"\.")):
        to_columns(data, 2)


def test_a_dict_of_plain_tensors_passes_through_and_anything_else_is_normalized():
    """The cheap path for dicts of plain CPU tensors must give what the general one does."""
    x = torch.ones(2, 3)
    assert to_columns({"x": x}, 2)["x"] is x  # nothing to change: no copy, no alias
    grad = torch.ones(2, 3, requires_grad=True)
    col = to_columns({"g": grad}, 2)["g"]
    assert not col.requires_grad and col.grad_fn is None  # detached, as before
    assert to_columns({"a.b": torch.zeros(2)}, 2).keys() == {"a.b"}
    with pytest.raises(SchemaError, match="must not have an empty segment"):
        to_columns({"a..b": torch.zeros(2)}, 2)
    with pytest.raises(SchemaError, match="0-d tensor"):
        to_columns({"x": torch.tensor(1.0)}, 1)
    with pytest.raises(SchemaError, match="must have 3 rows"):
        to_columns({"x": x}, 3)
    with pytest.raises(SchemaError, match="dense"):
        to_columns({"s": torch.eye(2).to_sparse()}, 2)
    with pytest.raises(SchemaError, match="meta"):
        to_columns({"m": torch.empty(2, 3, device="meta")}, 2)
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
    assert isinstance(to_columns({"r": nested}, 2)["r"], Ragged)


def test_ragged_column_in_is_checked():
    r = Ragged(torch.arange(5.0), torch.tensor([0, 2, 5]))
    col = to_column("r", r, 2)
    assert isinstance(col, Ragged) and rows_of(col) == [[0.0, 1.0], [2.0, 3.0, 4.0]]
    assert to_columns({"r": r}, 2)["r"].offsets.tolist() == [0, 2, 5]
    for offsets in ([1, 2, 5], [0, 2, 4], [0, 3, 2, 5]):
        with pytest.raises(SchemaError, match="field 'r' must have Ragged offsets"):
            to_column("r", Ragged(torch.arange(5.0), torch.tensor(offsets)), len(offsets) - 1)
    with pytest.raises(SchemaError, match="int64"):
        to_column("r", Ragged(torch.arange(5.0), torch.tensor([0, 5], dtype=torch.int32)), 1)
    with pytest.raises(SchemaError, match="must have 3 rows"):
        to_column("r", r, 3)
