"""Ragged columns, take/concat, and converting a column to its field's schema."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

from tq_stream.columns import (
    Ragged,
    coerce,
    column_len,
    concat,
    dtype_from_name,
    flat_plain,
    schema_of,
    span,
    take,
)
from tq_stream.errors import SchemaError
from tq_stream.schemas import FieldSchema

ROWS = [torch.tensor([1, 2, 3]), torch.tensor([], dtype=torch.int64), torch.tensor([4, 5])]


def rows_of(r: Ragged) -> list[list]:
    return [r.row(i).tolist() for i in range(len(r))]


def test_from_list_offsets_and_lengths():
    r = Ragged.from_list(ROWS)
    assert len(r) == 3
    assert r.offsets.tolist() == [0, 3, 3, 5]
    assert r.lengths.tolist() == [3, 0, 2]
    assert rows_of(r) == [[1, 2, 3], [], [4, 5]]


def test_from_list_empty():
    r = Ragged.from_list([])
    assert len(r) == 0 and r.offsets.tolist() == [0]


def test_to_padded():
    r = Ragged.from_list(ROWS)
    assert r.to_padded(pad_value=-1).tolist() == [[1, 2, 3], [-1, -1, -1], [4, 5, -1]]
    tail = Ragged.from_list([torch.ones(2, 2), torch.zeros(1, 2)])
    padded = tail.to_padded()
    assert padded.shape == (2, 2, 2) and padded[1, 1].tolist() == [0, 0]


def test_to_nested_shares_values():
    r = Ragged.from_list([torch.arange(3.0), torch.arange(2.0)])
    nt = r.to_nested()
    assert nt.is_nested and [t.tolist() for t in nt.unbind()] == [[0, 1, 2], [0, 1]]
    assert nt.values().data_ptr() == r.values.data_ptr()


def test_take_and_concat():
    a, b = Ragged.from_list(ROWS), Ragged.from_list([torch.tensor([9])])
    assert rows_of(take(a, torch.tensor([2, 0]))) == [[4, 5], [1, 2, 3]]
    joined = concat([a, b])
    assert joined.offsets.tolist() == [0, 3, 3, 5, 6] and rows_of(joined)[-1] == [9]
    dense = concat([torch.ones(2, 3), torch.zeros(1, 3)])
    assert dense.shape == (3, 3) and take(dense, torch.tensor([2])).sum() == 0
    assert concat([["a"], ["b", "c"]]) == ["a", "b", "c"]
    assert take(["a", "b", "c"], torch.tensor([2, 2])) == ["c", "c"]


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.bfloat16, torch.bool])
def test_take_of_ragged_rows_in_any_order_with_repeats_tails_and_views(dtype):
    g = torch.Generator().manual_seed(0)
    rows = [(torch.randn(int(k), 2, 3, generator=g) * 4).to(dtype)
            for k in torch.randint(0, 5, (40,), generator=g)]
    whole = Ragged.from_list(rows)
    view = Ragged(whole.values, whole.offsets[7:34])  # offsets from offsets[7], not 0
    pos = torch.randint(0, 26, (60,), generator=g)
    got = take(view, pos)
    assert got.values.dtype == dtype and got.values.shape[1:] == (2, 3)
    assert got.offsets.dtype == torch.int64 and int(got.offsets[0]) == 0
    assert len(got) == 60 and all(torch.equal(got.row(i), rows[7 + int(p)])
                                  for i, p in enumerate(pos))


def test_take_of_no_ragged_rows_keeps_dtype_and_tail():
    got = take(Ragged.from_list([torch.ones(2, 3, dtype=torch.float16)]),
               torch.tensor([], dtype=torch.int64))
    assert len(got) == 0 and got.offsets.tolist() == [0]
    assert got.values.dtype == torch.float16 and got.values.shape == (0, 3)


@pytest.mark.parametrize(("rows", "flat"), [
    ([1, "a", 2.5, True, None, b"x"], True),
    ([{"a": 1, "b": "x"}, {}], True),
    ([{"a": 1}, [1, 2], (3,), 5, []], True),
    ([], True),
    ([{1: "int key"}], False),
    ([[[1]]], False),  # nested: the per-row walk decides
    ([{"a": [1]}], False),
    ([object()], False),
    ([{"a": torch.ones(1)}], False),
    ([collections.OrderedDict(a=1)], False),  # a subclass: walked, not trusted
    ([True, (1,)], True),
])
def test_flat_plain_says_true_only_for_flat_rows_of_exact_plain_types(rows, flat):
    assert flat_plain(rows) is flat


def test_flat_plain_takes_the_containers_to_accept():
    assert flat_plain([(1,)]) and not flat_plain([(1,)], frozenset({list, dict}))
    assert flat_plain([{"a": 1}, [2]], frozenset({list, dict}))


def test_span_shares_values_and_keeps_rows():
    a = Ragged.from_list(ROWS)
    mid = span(a, 1, 3)
    assert rows_of(mid) == rows_of(a)[1:3] and mid.offsets[0] == 0
    assert mid.values.data_ptr() == a.values[int(a.offsets[1]):].data_ptr()  # no copy
    dense = torch.arange(12.0).reshape(4, 3)
    assert span(dense, 1, 3).data_ptr() == dense[1].data_ptr()
    assert torch.equal(span(dense, 1, 3), dense[1:3])
    assert span(["a", "b", "c"], 2, 3) == ["c"]


def test_concat_of_ragged_views_not_starting_at_zero():
    base = Ragged.from_list(ROWS)
    view = Ragged(base.values, base.offsets[2:])  # just the last row, offsets from 3
    joined = concat([view, Ragged.from_list([torch.tensor([7])])])
    assert joined.offsets.tolist() == [0, 2, 3] and rows_of(joined) == [[4, 5], [7]]


def test_schema_and_sizes():
    assert schema_of(torch.ones(4, 2, dtype=torch.float16)) == FieldSchema("dense", "float16",
                                                                           (2,))
    assert schema_of(Ragged.from_list(ROWS)) == FieldSchema("ragged", "int64", ())
    assert schema_of(["x"]) == FieldSchema("object")
    assert FieldSchema("ragged", "int64", (3,)).describe() == "ragged int64[*, 3]"
    assert FieldSchema.from_dict(FieldSchema("dense", "bool", (1,)).to_dict()) == \
        FieldSchema("dense", "bool", (1,))
    assert column_len(Ragged.from_list(ROWS)) == 3 and column_len(["a"]) == 1
    with pytest.raises(SchemaError, match="'nope'"):
        dtype_from_name("nope")


def test_coerce_dense_into_ragged_and_back():
    ragged_schema = FieldSchema("ragged", "float32", ())
    as_ragged = coerce(torch.arange(6.0).reshape(2, 3), ragged_schema)
    assert isinstance(as_ragged, Ragged) and rows_of(as_ragged) == [[0, 1, 2], [3, 4, 5]]
    dense_schema = FieldSchema("dense", "float32", (2,))
    same = Ragged.from_list([torch.ones(2), torch.zeros(2)])
    assert coerce(same, dense_schema).tolist() == [[1, 1], [0, 0]]
    assert coerce(Ragged.from_list([torch.ones(2), torch.ones(3)]), dense_schema) is None
    assert coerce(torch.ones(2, 3, dtype=torch.float64), ragged_schema) is None  # dtype
    assert coerce(["a"], dense_schema) is None


def test_schemas_from_dicts_are_shared_and_odd_ones_still_made():
    d = {"kind": "dense", "dtype": "float32", "shape": [4]}
    a, b = FieldSchema.from_dict(d), FieldSchema.from_dict(dict(d))
    assert a == FieldSchema("dense", "float32", (4,)) and a is b  # made once, immutable
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.shape = (5,)  # type: ignore[misc]
    odd = FieldSchema.from_dict({"kind": "dense", "dtype": "float32", "shape": [[1], 2]})
    assert odd.shape == ([1], 2)  # unhashable parts: not kept, made as before
    assert FieldSchema.from_dict({"kind": "object", "dtype": "", "shape": []}).kind == "object"


def test_a_schema_of_look_alike_values_does_not_poison_the_shared_ones():
    """``(True, 2.0) == (1, 2)`` with equal hashes: the shared schemas key on exact types."""
    odd = FieldSchema.from_dict({"kind": "dense", "dtype": "float32", "shape": [True, 2.0]})
    plain = FieldSchema.from_dict({"kind": "dense", "dtype": "float32", "shape": [1, 2]})
    assert [type(n) for n in plain.shape] == [int, int] and odd.shape == (True, 2.0)
    huge = FieldSchema.from_dict({"kind": "dense", "dtype": "float32", "shape": [1] * 100})
    again = FieldSchema.from_dict({"kind": "dense", "dtype": "float32", "shape": [1] * 100})
    assert huge == again and huge is not again  # a long shape is not kept
