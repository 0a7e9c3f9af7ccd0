"""Issue 20 item 2 in local mode, with DataLoader worker processes: a row is discarded
only when it is stale against a version the trainer set (see tests/helpers/staleness_cases.py
and the embedded twin tests/controller/test_staleness_versions.py)."""

from __future__ import annotations

import pytest

from tests.helpers.staleness_cases import (
    async_groups_constant_version,
    backlog_every_3_steps,
    closed_constant_version,
    every_n_steps,
    held_for_turn,
)
from tests.helpers.tq_fixtures import local_stream
from tq_stream.errors import TurnNotReached, WaitTimeout

__all__ = ["local_stream"]

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
FORK = {"multiprocessing_context": "fork"}


def test_constant_version_discards_only_rows_out_of_the_bound(local_stream):
    trained, st = closed_constant_version(local_stream, "const", num_workers=1, **FORK)
    assert st["discarded"] == {"stale": 24}
    assert sorted(trained) == [4] * 16 + [5] * 16 + [6] * 8


@pytest.mark.parametrize(("n", "workers"), [(0, 1), (2, 2)])
def test_a_trainer_setting_its_version_every_n_steps(local_stream, n, workers):
    lags, versions, st = every_n_steps(local_stream, f"every{n}", n, num_workers=workers,
                                       **FORK)
    assert lags and max(lags) <= 1, sorted(set(lags))
    stale = st["discarded"].get("stale", 0)
    assert len(lags) + stale == len(versions)
    assert stale <= sum(v < st["final_version"] - 1 for v in versions)


def test_async_groups_with_a_constant_version_do_not_stall(local_stream):
    lags = async_groups_constant_version(local_stream, "groups", num_workers=1, **FORK)
    assert len(lags) == 12 * 8 and max(lags) <= 1


def test_a_step_held_for_its_turn_outlasts_the_timeout_while_the_trainer_moves_on(
        local_stream):
    trained = held_for_turn(local_stream, "moving", step_seconds=0.6, timeout=1.5,
                            num_workers=1, **FORK)
    assert trained == [5] * 4 + [6] * 4 + [7] * 4 + [4] * 4


def test_a_step_held_for_a_turn_that_does_not_come_times_out_naming_it(local_stream):
    with pytest.raises(WaitTimeout) as err:
        held_for_turn(local_stream, "stalled", step_seconds=2.5, timeout=1.0,
                      num_workers=1, **FORK)
    text = str(err.value)
    assert not isinstance(err.value, TurnNotReached), text
    assert "is formed ahead of its turn for version" in text, text
    assert "acked or read" in text, text


def test_a_step_formed_by_a_reader_ahead_is_reformed_at_yield(local_stream):
    from tests.helpers.staleness_cases import formed_by_a_reader_ahead

    batches, st = formed_by_a_reader_ahead(local_stream, "ahead", num_workers=1, **FORK)
    assert batches == [[0, 0], [1, 1], [1, 1]], batches
    assert st["discarded"] == {"stale": 2}, st["discarded"]


def test_a_trainer_jumping_versions_gets_no_stale_prefetched_batch(local_stream):
    lags, versions, st = every_n_steps(local_stream, "jump", 1, num_workers=2, jump=2,
                                       blocks=[(v, 8) for v in range(12)], **FORK)
    assert lags and max(lags) <= 1, sorted(set(lags))
    stale = st["discarded"].get("stale", 0)
    assert len(lags) + stale == len(versions)


def test_a_trainer_changing_its_version_every_3_steps_loses_no_row_in_the_bound(local_stream):
    """The embedded replay (tests/controller/test_staleness_versions.py) with 2 DataLoader workers:
    a README-only user saw 36 rows trained and 24 discarded."""
    trained, keys, lags, discarded = backlog_every_3_steps(
        local_stream, "every3", 2, num_workers=2, multiprocessing_context="fork")
    assert max(lags) <= 1, sorted(set(lags))
    assert sorted(trained) == sorted(keys)
    assert discarded == {}
