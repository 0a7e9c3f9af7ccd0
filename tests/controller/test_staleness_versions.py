"""Issue 20 item 2 (embedded): a row is discarded only when it is stale against a
version the trainer actually set; prefetch holds a step back instead of discarding on
a predicted version. The local-mode twin is tests/integration/controller/test_staleness_local.py."""

from __future__ import annotations

import pytest

from tests.helpers.staleness_cases import (
    async_groups_constant_version,
    backlog_every_3_steps,
    closed_constant_version,
    every_n_steps,
    held_for_turn,
)
from tq_stream.errors import TurnNotReached, WaitTimeout

P = "train"
pytestmark = pytest.mark.timeout(60)


def test_constant_version_discards_only_rows_out_of_the_bound(stream):
    trained, st = closed_constant_version(stream, "train")
    assert st["version"] == 5
    assert st["discarded"] == {"stale": 24}  # versions 2 and 3: 8 + 16 rows
    assert sorted(trained) == [4] * 16 + [5] * 16 + [6] * 8


@pytest.mark.parametrize(("n", "admission"), [(0, None), (1, None), (3, None), (3, 3),
                                              (0, 3)])
def test_a_trainer_setting_its_version_every_n_steps(stream, n, admission):
    """Version bumped every n steps (0: never); with or without telling the controller
    (set_admission, an upper bound on how often): the bound holds at yield, every row is trained or
    discarded, and a row is discarded only if stale against the final version."""
    lags, versions, st = every_n_steps(stream, "train", n, admission=admission)
    assert lags and max(lags) <= 1, sorted(set(lags))
    stale = st["discarded"].get("stale", 0)
    assert len(lags) + stale == len(versions)  # nothing lost, nothing twice
    assert stale <= sum(v < st["final_version"] - 1 for v in versions)
    if n == 0:
        assert stale == 0


def test_async_groups_with_a_constant_version_do_not_stall(stream):
    lags = async_groups_constant_version(stream, "train")
    assert len(lags) == 12 * 8 and max(lags) <= 1


def test_the_predicted_turn_version_follows_the_consumer():
    """TaskState.version_at: the next change comes after the step being read and
    steps_per_version steps after the last change; repeating a version is no change."""
    from tq_stream.controller.task import TaskConfig, TaskState
    from tq_stream.samplers.sequential import SequentialSampler

    state = TaskState("t", TaskConfig(("x",), 1, 1, 1, 60.0, False), SequentialSampler(), 8)
    state.steps_per_version = 3
    state.set_version(5, at_step=10)
    assert [state.version_at(s) for s in (10, 12, 13, 15, 16)] == [5, 5, 6, 6, 7]
    state.set_version(5, at_step=14)  # the same version again: only the position moves
    assert (state.version_step, state.position) == (10, 14)
    assert [state.version_at(s) for s in (14, 15, 17, 18)] == [5, 6, 6, 7]
    state.reading(12)  # a rank that lags behind does not move the position back
    assert state.position == 14
    state.set_version(6, at_step=15)
    assert [state.version_at(s) for s in (15, 17, 18)] == [6, 6, 7]


def test_a_step_held_for_its_turn_outlasts_the_timeout_while_the_trainer_moves_on(stream):
    """A prefetched step held back for its turn waits for the trainer longer than the
    timeout (three training steps here), as long as the trainer acks a batch at least
    once per timeout."""
    trained = held_for_turn(stream, "moving", step_seconds=0.4, timeout=1.0)
    assert trained == [5] * 4 + [6] * 4 + [7] * 4 + [4] * 4


def test_a_step_held_for_a_turn_that_does_not_come_times_out_naming_it(stream):
    """Review: the held step's wait was asked again without limit while the trainer's
    session lived. Now a trainer that acks nothing for the timeout (a stalled loop, or
    a training step longer than the timeout) gets a WaitTimeout that says which turn
    and version the step waited for."""
    with pytest.raises(WaitTimeout) as err:
        held_for_turn(stream, "stalled", step_seconds=1.5, timeout=0.5)
    text = str(err.value)
    assert not isinstance(err.value, TurnNotReached), text
    assert "step 3 is formed ahead of its turn for version 8" in text, text
    assert "timeout=0.5 s" in text and "acked or read" in text, text


def test_versions_are_kept_per_step_for_ranks_behind_and_a_restart_rolls_back():
    """TaskState.version_for: the version set for each step (a DP rank or peer behind
    reads its steps at their own versions, and setting them again changes nothing);
    a different version for an earlier step (a trainer restarted from an older
    checkpoint) takes effect from there, as before."""
    from tq_stream.controller.task import TaskConfig, TaskState
    from tq_stream.samplers.sequential import SequentialSampler

    state = TaskState("t", TaskConfig(("x",), 1, 2, 1, 60.0, False), SequentialSampler(), 8)
    assert state.version_for(0) is None
    for v in range(3):
        state.set_version(v, at_step=v)
    assert [state.version_for(s) for s in range(5)] == [0, 1, 2, 2, 2]
    state.set_version(1, at_step=1)  # the rank behind, at its step 1
    assert (state.version, state.version_step) == (2, 2)
    assert [state.version_for(s) for s in range(4)] == [0, 1, 2, 2]
    state.set_version(0, at_step=1)  # a restart with older weights at step 1
    assert (state.version, state.version_step) == (0, 1)
    assert [state.version_for(s) for s in range(4)] == [0, 0, 0, 0]
    state.set_version(7, at_step=None)  # Stream.set_version: for every step from now on
    assert [state.version_for(s) for s in range(3)] == [7, 7, 7]


@pytest.mark.parametrize("prefetch", [1, 2])
def test_a_trainer_changing_its_version_every_3_steps_loses_no_row_in_the_bound(stream,
                                                                               prefetch):
    """Replay (a README-only user): see ``staleness_cases.backlog_every_3_steps``. Steps
    formed ahead were formed for a version predicted to rise every step: they took
    newer rows and left older ones behind until those really went stale (44 trained,
    16 discarded). Now a version change is predicted at the pace the trainer showed
    (none before its first change): every row is trained, none discarded."""
    trained, keys, lags, discarded = backlog_every_3_steps(stream, P, prefetch)
    assert max(lags) <= 1, sorted(set(lags))
    assert sorted(trained) == sorted(keys)
    assert discarded == {}
