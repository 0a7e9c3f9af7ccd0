"""TagTable: typed columns, promotion, missing values; check_tags."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tq_stream.checks import check_tags
from tq_stream.controller.tags import TagTable
from tq_stream.errors import ConfigError


def rows(*r: int) -> np.ndarray:
    return np.asarray(r, dtype=np.int64)


def test_typed_columns():
    t = TagTable(4)
    t.set(rows(0, 1), [{"i": 1, "f": 0.5, "b": True, "s": "x"},
                       {"i": 2, "f": 1.5, "b": False, "s": None}])
    assert t.kinds == {"i": "int", "f": "float", "b": "bool", "s": "object"}
    assert t.get("i", rows(0, 1)).dtype == np.int64 and t.get("b", rows(0, 1)).dtype == bool
    assert t.rows_as_dicts(rows(1)) == [{"i": 2, "f": 1.5, "b": False, "s": None}]


def test_promotion_int_to_float_and_to_object():
    t = TagTable(4)
    t.set(rows(0), [{"v": 1}])
    t.set(rows(1), [{"v": 2.5}])
    assert t.kinds["v"] == "float" and t.get("v", rows(0, 1)).tolist() == [1.0, 2.5]
    t.set(rows(2), [{"v": "high"}])
    assert t.kinds["v"] == "object" and t.rows_as_dicts(rows(0, 2)) == [{"v": 1.0},
                                                                       {"v": "high"}]


@pytest.mark.parametrize("first, then", [(1.5, True), (True, 1.5), (1, True), (True, 1)])
def test_bool_never_mixes_with_numbers(first, then):
    t = TagTable(2)
    t.set(rows(0), [{"v": first}])
    t.set(rows(1), [{"v": then}])
    assert t.kinds["v"] == "object"
    got = t.rows_as_dicts(rows(0, 1))
    assert [type(d["v"]) for d in got] == [type(first), type(then)]


def test_missing_values_are_visible():
    t = TagTable(4)
    t.set(rows(0, 1), [{"n": 3, "ok": True, "f": 1.0}, {"n": 4, "ok": False, "f": 2.0}])
    t.set(rows(2), [{}])  # a row without the tags
    assert t.kinds["n"] == "int" and math.isnan(t.get("n", rows(2))[0])
    assert t.kinds["ok"] == "bool" and t.get("ok", rows(2))[0] is None
    assert math.isnan(t.get("f", rows(2))[0])
    assert t.rows_as_dicts(rows(2)) == [{}]
    assert t.get("n", rows(0)).tolist() == [3] and t.get("n", rows(0)).dtype == np.int64
    assert t.rows_as_dicts(rows(0)) == [{"n": 3, "ok": True, "f": 1.0}]  # ints stay ints


def test_large_int_tags_stay_exact_when_other_rows_lack_them():
    t = TagTable(4)
    t.set(rows(0), [{"n": 2**53 + 1}])
    t.set(rows(1), [{}])
    assert t.rows_as_dicts(rows(0, 1)) == [{"n": 2**53 + 1}, {}]
    assert type(t.rows_as_dicts(rows(0))[0]["n"]) is int


def test_clear_and_grow():
    t = TagTable(2)
    t.set(rows(0, 1), [{"s": "a"}, {"s": "b"}])
    t.clear(rows(0))
    assert t.rows_as_dicts(rows(0, 1)) == [{}, {"s": "b"}]
    t.grow(8)
    t.set(rows(7), [{"s": "z"}])
    assert t.capacity == 8 and t.rows_as_dicts(rows(5, 7)) == [{}, {"s": "z"}]


def test_merge_keeps_other_tags():
    t = TagTable(2)
    t.set(rows(0), [{"a": 1, "b": "x"}])
    t.set(rows(0), [{"b": "y"}])
    assert t.rows_as_dicts(rows(0)) == [{"a": 1, "b": "y"}]


def test_check_tags():
    assert check_tags(None, 3) is None
    assert check_tags({"a": 1}, 1) == [{"a": 1}]
    out = check_tags([{"a": 1}, {"b": None}], 2)
    assert out == [{"a": 1}, {"b": None}]
    with pytest.raises(ConfigError, match=r"tags\[0\]\['a'\].*got \(1,\)"):
        check_tags([{"a": (1,)}], 1)


def test_load_state_is_strict():
    with pytest.raises(ConfigError, match="tag state 'v'"):
        TagTable(2).load_state_dict({"v": {"kind": "complex", "rows": [], "values": []}})


def test_ints_stay_ints_when_other_rows_lack_the_tag():
    t = TagTable(4)
    t.set(rows(0), [{"n": 3, "x": 0.5}])
    t.set(rows(1), [{"s": "p"}])  # n is promoted to float64: samplers read NaN here
    t.set(rows(2), [{"n": 2.0, "x": 7}])
    assert t.kinds["n"] == "float" and math.isnan(t.get("n", rows(1))[0])
    got = t.rows_as_dicts(rows(0, 1, 2))
    assert got == [{"n": 3, "x": 0.5}, {"s": "p"}, {"n": 2.0, "x": 7}]
    assert [type(d.get("n")) for d in got] == [int, type(None), float]
    assert type(got[2]["x"]) is int
    back = TagTable(4)
    back.load_state_dict(t.state_dict())
    assert [type(v) for v in back.rows_as_dicts(rows(0, 2))[0].values()] == [int, float]
    t.set(rows(3), [{"n": "high"}])  # to object: ints stay ints
    assert [type(d["n"]) for d in t.rows_as_dicts(rows(0, 2, 3))] == [int, float, str]
    t.clear(rows(0))
    t.set(rows(0), [{"n": 1.5}])
    assert t.rows_as_dicts(rows(0)) == [{"n": 1.5}]
