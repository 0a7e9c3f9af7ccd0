"""The last bad-input gaps (issue 11, item 7) against a local deployment: the same cases
as the embedded tests, each a TQError that leaves stats() unchanged, and odd dtypes
(float8, uint16-64, zero-width) stored and read back exactly."""

from __future__ import annotations

import pytest

from tests.helpers.bad_input_cases import (
    CASES,
    fill,
    rejected_unchanged,
    restore_of_missing_path_fails,
    round_trip_odd_columns,
)
from tests.helpers.tq_fixtures import CONFIG, local_stream

__all__ = ["local_stream"]  # the module-scoped fixture, imported for pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def filled(local_stream):
    fill(local_stream)
    return local_stream


@pytest.mark.parametrize("call, error, match", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_last_gaps_are_tq_errors_that_change_nothing(filled, call, error, match):
    rejected_unchanged(filled, call, error, match)


def test_float8_uint_and_zero_width_fields_round_trip(local_stream):
    round_trip_odd_columns(local_stream)


def test_restore_of_a_missing_path_is_a_tq_error(tmp_path):
    restore_of_missing_path_fails(str(tmp_path / "missing"), mode="local", config=CONFIG)
