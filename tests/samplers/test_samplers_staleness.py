"""StalenessSampler and admission_limit: no row older than the bound is ever handed out."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.samplers.test_samplers_common import (
    check_selection,
    columns_candidates,
    grouped_columns,
    simulate,
)
from tq_stream.errors import ConfigError
from tq_stream.samplers import (
    Candidates,
    GroupSampler,
    PrioritySampler,
    SequentialSampler,
    StalenessSampler,
    admission_limit,
)

SETTINGS = settings(max_examples=60, deadline=None, database=None)


@SETTINGS
@given(
    seed=st.integers(0, 2**31),
    n=st.integers(0, 60),
    bound=st.integers(0, 3),
    version=st.integers(0, 8),
    dp=st.integers(1, 3),
    start=st.booleans(),
)
def test_stale_rows_discarded_rest_goes_to_inner(seed, n, bound, version, dp, start):
    rng = np.random.default_rng(seed)
    end = rng.integers(0, 10, n)
    begin = end - rng.integers(0, 3, n)
    tags = {"version": end, "start": begin}
    cands = Candidates.from_arrays(np.arange(100, 100 + n), tags, dp_size=dp, version=version)
    s = StalenessSampler(max_staleness=bound, start_version_tag="start" if start else None)
    sel = s.sample(cands, 2)
    check_selection(sel, cands)
    oldest = np.minimum(end, begin) if start else end
    stale = version - oldest > bound
    assert (
        sorted(sel.discard.get("stale", np.empty(0)).tolist())
        == (np.flatnonzero(stale) + 100).tolist()
    )
    fresh = np.flatnonzero(~stale) + 100
    if len(fresh) >= 2 * dp:
        assert sel.rows.tolist() == fresh[: 2 * dp].tolist()  # sequential over fresh rows
    else:
        assert not sel.ready


@settings(max_examples=30, deadline=None, database=None)  # a whole stream each
@given(
    seed=st.integers(0, 2**31),
    bound=st.integers(0, 2),
    dp=st.integers(1, 3),
    chunk=st.integers(1, 40),
    lag=st.integers(0, 4),
)
def test_stream_never_exceeds_bound(seed, bound, dp, chunk, lag):
    # Rows are tagged with a version up to `lag` behind the consumer when they arrive.
    cols = grouped_columns(seed, 40, 4, p_incomplete=0.1)
    n = cols["uid"].shape[0]
    rng = np.random.default_rng(seed)
    arrival_tick = np.arange(n) // chunk
    cols["version"] = np.maximum(0, arrival_tick // 2 - rng.integers(0, lag + 1, n))
    trace = simulate(
        StalenessSampler(GroupSampler(group_size=4), max_staleness=bound),
        cols,
        4,
        dp,
        arrivals=[chunk] * (n // chunk + 1),
        on_step=lambda v: v + 1,
    )
    for version, shares in trace.steps:
        for share in shares:
            assert (version - cols["version"][share] <= bound).all()
            assert (np.unique(cols["uid"][share], return_counts=True)[1] == 4).all()
    stale_rows = trace.discarded.get("stale", [])
    assert len(stale_rows) == len(set(stale_rows))


def test_no_consumer_version_means_no_filter():
    cands = Candidates.from_arrays(np.arange(4), {"version": np.zeros(4, int)}, version=None)
    sel = StalenessSampler(max_staleness=0).sample(cands, 4)
    assert sel.rows.tolist() == [0, 1, 2, 3] and not sel.discard


def test_missing_version_is_discarded_not_stale():
    cands = Candidates.from_arrays(
        np.arange(3), {"version": np.array([5.0, np.nan, 1.0])}, version=5
    )
    sel = StalenessSampler(max_staleness=1).sample(cands, 1)
    assert sel.rows.tolist() == [0]
    assert sel.discard["missing_tag"].tolist() == [1]
    assert sel.discard["stale"].tolist() == [2]


def test_tail_filters_too_and_merges_inner_discards():
    tags = {"version": np.array([0, 3, 3, 3]), "priority": np.array([1.0, 1.0, np.nan, 1.0])}
    cands = Candidates.from_arrays(np.arange(4), tags, version=3, closed=True, dp_size=2)
    s = StalenessSampler(PrioritySampler(), max_staleness=1)
    assert not s.sample(cands, 2).ready
    tail = s.tail(cands, 2)
    assert sorted(tail.rows.tolist()) == [1, 3]
    assert tail.discard["stale"].tolist() == [0]
    assert tail.discard["missing_tag"].tolist() == [2]


def test_required_tags_include_inner():
    s = StalenessSampler(GroupSampler(group_size=2), start_version_tag="v0")
    assert s.required_tags() == ("version", "v0", "uid")


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"max_staleness": -1}, ["max_staleness", ">= 0", "-1"]),
        ({"max_staleness": 1.5}, ["max_staleness", "1.5"]),
        ({"version_tag": ""}, ["version_tag", "''"]),
        ({"start_version_tag": 3}, ["start_version_tag", "3"]),
    ],
)
def test_bad_arguments_name_argument_and_value(kwargs, words):
    with pytest.raises(ConfigError) as e:
        StalenessSampler(**kwargs)
    assert all(w in str(e.value) for w in words), str(e.value)


# ---------------------------------------------------------------- admission control


def test_admission_limit_examples():
    assert admission_limit(held=0, rows_per_version=64, max_staleness=0) == 64
    assert admission_limit(held=100, rows_per_version=64, max_staleness=1) == 28
    assert admission_limit(held=500, rows_per_version=64, max_staleness=1) == 0
    assert admission_limit(held=0, rows_per_version=64, max_staleness=1, lag=1) == 64
    assert StalenessSampler(max_staleness=2).admission_limit(10, 8) == 14


@settings(max_examples=100, deadline=None, database=None)
@given(
    held=st.integers(0, 300),
    per_version=st.integers(1, 50),
    bound=st.integers(0, 4),
    lag=st.integers(0, 5),
)
def test_admission_limit_is_the_tight_bound_under_fifo(held, per_version, bound, lag):
    def staleness(position: int) -> int:  # consumed (position // R) versions from now
        return lag + position // per_version

    n = admission_limit(held, per_version, bound, lag)
    assert all(staleness(held + i) <= bound for i in range(n))
    if lag <= bound:  # one more row would be too stale
        assert staleness(held + n) > bound


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"held": -1}, "held"),
        ({"rows_per_version": 0}, "rows_per_version"),
        ({"max_staleness": -2}, "max_staleness"),
        ({"lag": -1}, "lag"),
    ],
)
def test_admission_limit_bad_arguments(kwargs, name):
    args = {"held": 0, "rows_per_version": 8, "max_staleness": 1, **kwargs}
    with pytest.raises(ConfigError, match=f"{name} must be an int >= "):
        admission_limit(**args)


def test_subset_is_skipped_when_nothing_is_stale():
    cols = {"version": np.full(10, 7)}
    cands = columns_candidates(cols, np.arange(10), version=7)
    seen = []

    class Spy(SequentialSampler):
        def sample(self, candidates, batch_size):
            seen.append(candidates)
            return super().sample(candidates, batch_size)

    StalenessSampler(Spy()).sample(cands, 2)
    assert seen[0] is cands
