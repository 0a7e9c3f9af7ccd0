"""compat's one-call read plan (``variant_read.single_names``): which fields a
``kv_batch_get`` reads column by column, and when it must look row by row."""

from __future__ import annotations

from tq_stream.compat.variant_read import single_names

HIDDEN = "__hidden__"


def test_fields_every_row_holds_under_one_name_are_read_as_columns():
    held = {"x": 3, HIDDEN: 3, "y@object": 3, "z": 1}
    assert single_names(held, 3, None, HIDDEN) == {"x": "x", "y": "y@object"}
    assert single_names(held, 3, ["y"], HIDDEN) == {"y": "y@object"}


def test_a_field_under_two_names_or_missing_rows_goes_row_by_row():
    assert single_names({"x": 2, "x@object": 1}, 3, None, HIDDEN) is None
    assert single_names({"x": 2}, 3, ["x"], HIDDEN) is None  # the row-by-row read says which
    assert single_names({"x": 3}, 3, ["nope"], HIDDEN) is None  # (a parent path, or an error)
    assert single_names({"z": 1, HIDDEN: 3}, 3, None, HIDDEN) is None  # no common field


def test_nested_fields_are_left_to_the_row_by_row_read():
    assert single_names({"obs.a": 3, "x": 3}, 3, None, HIDDEN) is None
