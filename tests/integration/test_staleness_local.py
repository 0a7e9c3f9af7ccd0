"""Issue 20 item 2 in local mode, with DataLoader worker processes: a row is discarded
only when it is stale against a version the trainer set (see tests/staleness_cases.py
and the embedded twin tests/test_staleness_versions.py)."""

from __future__ import annotations

import time

import pytest
from staleness_cases import (
    async_groups_constant_version,
    closed_constant_version,
    every_n_steps,
    put_versions,
)
from tq_fixtures import local_stream

import tq_stream as tq

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


def test_a_step_held_for_its_turn_outlasts_a_slow_training_step(local_stream):
    local_stream.create_partition("slow", consumers=["actor"])
    put_versions(local_stream, "slow", [(4, 12), (5, 4)])
    local_stream.close_partition("slow")
    ds = tq.StreamingDataset(local_stream, "slow", "actor", ["x"], batch_size=4,
                             prefetch=3, timeout=1.0,
                             sampler=tq.samplers.StalenessSampler(max_staleness=1))
    loader = tq.StreamingDataLoader(ds, num_workers=1, **FORK)
    loader.set_version(5)
    trained = []
    for batch in loader:
        trained += [t["version"] for t in tq.batch_meta(batch).tags]
        time.sleep(2.5)  # longer than the timeout (and its margin)
    assert sorted(trained) == [4] * 12 + [5] * 4
