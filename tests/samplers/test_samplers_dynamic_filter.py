"""DynamicFilterSampler: zero-variance complete groups are dropped, the step is refilled."""

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
from tq_stream.samplers import Candidates, DynamicFilterSampler, GroupSampler, SequentialSampler

SETTINGS = settings(max_examples=60, deadline=None, database=None)


def group_stats(cols, size):
    uid, reward = cols["uid"], cols["reward"]
    ids, counts = np.unique(uid, return_counts=True)
    flat = {u: bool(np.ptp(reward[uid == u]) == 0) for u in ids.tolist()}
    complete = {u for u, c in zip(ids.tolist(), counts.tolist(), strict=True) if c == size}
    return flat, complete


@SETTINGS
@given(
    seed=st.integers(0, 2**31),
    size=st.integers(1, 4),
    dp=st.integers(1, 3),
    per_rank=st.integers(1, 2),
    p_flat=st.floats(0, 1),
)
def test_only_varied_complete_groups_are_handed_out(seed, size, dp, per_rank, p_flat):
    cols = grouped_columns(seed, 50, size)
    rng = np.random.default_rng(seed + 1)
    flat_groups = rng.random(50) < p_flat  # force some groups to a constant reward
    cols["reward"] = np.where(flat_groups[cols["uid"]], 1.0, cols["reward"])
    cands = columns_candidates(cols, np.arange(cols["uid"].shape[0]), dp_size=dp)
    sel = DynamicFilterSampler(GroupSampler(group_size=size)).sample(cands, per_rank * size)
    check_selection(sel, cands)
    flat, complete = group_stats(cols, size)
    passing = [u for u in dict.fromkeys(cols["uid"].tolist()) if u in complete and not flat[u]]
    if len(passing) >= per_rank * dp:
        handed = list(dict.fromkeys(cols["uid"][sel.rows].tolist()))
        assert handed == passing[: per_rank * dp]  # the oldest passing groups
    else:
        assert not sel.ready
    dropped = set(cols["uid"][sel.discard.get("zero_variance", np.empty(0, int))].tolist())
    assert all(flat[u] and u in complete for u in dropped)  # incomplete groups never judged
    if not sel.ready:  # a full scan: every flat complete group is gone
        assert dropped == {u for u in complete if flat[u]}


@settings(max_examples=30, deadline=None, database=None)  # a whole stream each
@given(
    seed=st.integers(0, 2**31),
    dp=st.integers(1, 3),
    chunk=st.integers(1, 40),
    on_empty=st.sampled_from(["wait", "short"]),
)
def test_stream_drops_flat_groups_and_never_repeats(seed, dp, chunk, on_empty):
    cols = grouped_columns(seed, 40, 4, p_incomplete=0.1)
    n = cols["uid"].shape[0]
    trace = simulate(
        DynamicFilterSampler(GroupSampler(group_size=4), on_empty=on_empty),
        cols,
        8,
        dp,
        arrivals=[chunk] * (n // chunk + 1),
    )
    flat, complete = group_stats(cols, 4)
    for _, shares in trace.steps:
        for share in shares:
            assert not any(flat[u] for u in cols["uid"][share].tolist())
    if on_empty == "wait":
        assert trace.tail == ()
    else:  # what passed is handed out in the tail unless fewer groups than ranks
        left = {u for u in cols["uid"][trace.leftover].tolist() if u in complete}
        assert len(left) < dp
    assert {cols["uid"][r] for r in trace.discarded.get("zero_variance", [])} == {
        u for u in complete if flat[u]
    }


def test_all_flat_waits_with_discards_then_waits_quietly():
    cols = {"uid": np.repeat(np.arange(4), 2), "reward": np.ones(8)}
    s = DynamicFilterSampler(GroupSampler(group_size=2))
    sel = s.sample(Candidates.from_arrays(np.arange(8), cols), 2)
    assert not sel.ready and sel.discard["zero_variance"].tolist() == list(range(8))
    rest = Candidates.from_arrays(np.arange(0), {k: v[:0] for k, v in cols.items()})
    again = s.sample(rest, 2)
    assert not again.ready and not again.discard


def test_refills_from_groups_beyond_the_first_window():
    # 3000 flat groups of 2, then varied ones: found by widening the scanned window.
    n_flat = 3000
    uid = np.repeat(np.arange(n_flat + 8), 2)
    reward = np.where(uid < n_flat, 0.0, np.tile([0.0, 1.0], n_flat + 8))
    cands = columns_candidates({"uid": uid, "reward": reward}, np.arange(uid.shape[0]), dp_size=2)
    sel = DynamicFilterSampler(GroupSampler(group_size=2)).sample(cands, 4)
    assert sel.ready
    assert set(uid[sel.rows].tolist()) == set(range(n_flat, n_flat + 4))
    assert sel.discard["zero_variance"].shape[0] >= 2 * 1024


def test_missing_reward_drops_the_group():
    cols = {"uid": np.array([1, 1, 2, 2]), "reward": np.array([0.0, np.nan, 0.0, 1.0])}
    sel = DynamicFilterSampler(GroupSampler(group_size=2)).sample(
        Candidates.from_arrays(np.arange(4), cols), 2
    )
    assert sel.rows.tolist() == [2, 3]
    assert sel.discard["missing_tag"].tolist() == [0, 1]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ((SequentialSampler(),), ["inner", "GroupSampler", "SequentialSampler"]),
        ((GroupSampler(2),), None),
        ((GroupSampler(2), "reward", "prompt"), ["group_tag", "'uid'", "'prompt'"]),
        ((GroupSampler(2), ""), ["reward_tag", "''"]),
        ((GroupSampler(2), "reward", None, "drop"), ["on_empty", "'drop'", "short", "wait"]),
    ],
)
def test_bad_arguments_name_argument_and_value(args, words):
    if words is None:
        assert DynamicFilterSampler(*args).required_tags() == ("uid", "reward")
        return
    with pytest.raises(ConfigError) as e:
        DynamicFilterSampler(*args)
    assert all(w in str(e.value) for w in words), str(e.value)
