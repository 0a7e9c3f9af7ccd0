"""GroupSampler: whole complete groups, oldest first, never split across ranks or steps."""

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
from tq_stream.samplers import Candidates, GroupSampler


def reference_groups(uid: np.ndarray, size: int) -> list[int]:
    """Complete groups (exactly ``size`` rows) ordered by their oldest row: the slow way."""
    first: dict[int, int] = {}
    count: dict[int, int] = {}
    for i, u in enumerate(uid.tolist()):
        first.setdefault(u, i)
        count[u] = count.get(u, 0) + 1
    return sorted((u for u in first if count[u] == size), key=first.__getitem__)


def assert_whole_groups(sel, uid_of, size=None):
    """Every share is made of whole groups and no group spans two shares."""
    owner = {}
    for r, share in enumerate(sel.shares):
        for u in uid_of(share).tolist():
            assert owner.setdefault(u, r) == r, f"group {u} split across ranks"
        if size is not None:
            _, counts = np.unique(uid_of(share), return_counts=True)
            assert (counts == size).all()


@settings(max_examples=60, deadline=None, database=None)
@given(
    seed=st.integers(0, 2**31),
    n_groups=st.integers(0, 40),
    size=st.integers(1, 5),
    per_rank=st.integers(1, 3),
    dp=st.integers(1, 4),
    p_over=st.sampled_from([0.0, 0.2]),
)
def test_fixed_size_hands_oldest_complete_groups(seed, n_groups, size, per_rank, dp, p_over):
    cols = grouped_columns(seed, n_groups, size, p_overfull=p_over)
    uid = cols["uid"]
    cands = columns_candidates(cols, np.arange(uid.shape[0]), dp_size=dp)
    batch = per_rank * size
    sel = GroupSampler(group_size=size).sample(cands, batch)
    check_selection(sel, cands)
    expected = reference_groups(uid, size)
    if len(expected) < per_rank * dp:
        assert not sel.ready
    else:
        assert [len(s) for s in sel.shares] == [batch] * dp
        assert_whole_groups(sel, lambda rows: uid[rows], size)
        handed = list(dict.fromkeys(uid[sel.rows].tolist()))
        assert handed == expected[: per_rank * dp]
    _, counts = np.unique(uid, return_counts=True)
    overfull = set(np.unique(uid)[counts > size].tolist())
    dropped = sel.discard.get("overfull_group", np.empty(0, dtype=np.int64))
    assert set(uid[dropped].tolist()) == overfull
    assert dropped.shape[0] == sum(int(c) for c in counts[counts > size])


@settings(max_examples=40, deadline=None, database=None)
@given(
    seed=st.integers(0, 2**31),
    size=st.integers(1, 4),
    dp=st.integers(1, 3),
    per_rank=st.integers(1, 2),
    chunk=st.integers(1, 30),
)
def test_stream_never_splits_or_repeats_groups(seed, size, dp, per_rank, chunk):
    cols = grouped_columns(seed, 40, size, p_incomplete=0.2, p_overfull=0.1)
    uid = cols["uid"]
    trace = simulate(
        GroupSampler(group_size=size),
        cols,
        per_rank * size,
        dp,
        arrivals=[chunk] * (len(uid) // chunk + 1),
    )
    handed_groups = []
    for _, shares in trace.steps:
        sel_uids = [uid[s] for s in shares]
        assert all(len(s) == per_rank * size for s in shares)
        for u in sel_uids:
            assert (np.unique(u, return_counts=True)[1] == size).all()
        handed_groups += [set(u.tolist()) for u in sel_uids]
    for s in trace.tail:
        assert (np.unique(uid[s], return_counts=True)[1] == size).all()
    # A group is never split; only the extra rows of an overfull group that become
    # ready after its first size rows were handed out can form a later group.
    ids, counts = np.unique(uid, return_counts=True)
    handed = [g for gs in handed_groups for g in gs if counts[ids == g][0] <= size]
    assert len(handed) == len(set(handed)), "a group handed out in two shares"
    # Leftovers are incomplete groups or fewer complete groups than ranks.
    left = uid[trace.leftover]
    complete_left = [
        u for u, c in zip(*np.unique(left, return_counts=True), strict=True) if c == size
    ]
    assert len(complete_left) < dp


@settings(max_examples=60, deadline=None, database=None)
@given(seed=st.integers(0, 2**31), batch=st.integers(1, 12), dp=st.integers(1, 4))
def test_variable_sizes_fill_ranks_with_whole_groups(seed, batch, dp):
    rng = np.random.default_rng(seed)
    n_groups = int(rng.integers(0, 30))
    want = rng.integers(1, 8, n_groups)  # declared sizes
    have = np.where(rng.random(n_groups) < 0.8, want, rng.integers(0, 9, n_groups))
    uid = np.repeat(np.arange(n_groups), have)
    size = np.repeat(want, have)
    order = np.argsort(uid + rng.random(uid.shape[0]) * 3, kind="stable")
    cols = {"uid": uid[order], "n": size[order]}
    cands = columns_candidates(cols, np.arange(uid.shape[0]), dp_size=dp)
    sampler = GroupSampler(size_tag="n")
    sel = sampler.sample(cands, batch)
    check_selection(sel, cands)
    complete = (have == want) & (want <= batch)
    if sel.ready:
        assert all(len(s) <= batch for s in sel.shares)
        assert_whole_groups(sel, lambda rows: cols["uid"][rows])
        for u in np.unique(cols["uid"][sel.rows]).tolist():
            assert complete[u]
    else:
        assert want[complete].sum() < batch * dp or complete.sum() < dp
    oversized = np.flatnonzero((want > batch) & (have <= want) & (have > 0))
    dropped = sel.discard.get("oversized_group", np.empty(0, dtype=np.int64))
    assert set(cols["uid"][dropped].tolist()) == set(oversized.tolist())
    tail = sampler.tail(cands, batch)
    check_selection(tail, cands)
    if complete.sum() >= dp:
        assert tail.ready


def test_window_widens_past_old_incomplete_groups():
    # 5000 old singletons of incomplete groups of 4, then 50 complete groups.
    n_old = 5000
    uid = np.concatenate([np.arange(n_old), n_old + np.repeat(np.arange(50), 4)])
    cols = {"uid": uid}
    cands = columns_candidates(cols, np.arange(uid.shape[0]), dp_size=2)
    sel = GroupSampler(group_size=4).sample(cands, 8)
    assert sel.ready
    assert list(dict.fromkeys(uid[sel.rows].tolist())) == [n_old + g for g in range(4)]


def test_tail_spreads_remaining_groups_over_ranks():
    uid = np.repeat(np.arange(5), 2)
    cands = Candidates.from_arrays(np.arange(10), {"uid": uid}, dp_size=3, closed=True)
    s = GroupSampler(group_size=2)
    assert not s.sample(cands, 4).ready  # 5 groups < 2 per rank x 3 ranks
    tail = s.tail(cands, 4)
    assert [len(x) for x in tail.shares] == [4, 4, 2]
    few = Candidates.from_arrays(np.arange(4), {"uid": uid[:4]}, dp_size=3, closed=True)
    assert not s.tail(few, 4).ready  # 2 groups cannot give 3 ranks one each


def test_str_uids_and_missing_uid_discarded():
    uid = np.array(["a", "a", None, "b", "b", "c"], dtype=object)
    cands = Candidates.from_arrays(np.arange(10, 16), {"uid": uid})
    sel = GroupSampler(group_size=2).sample(cands, 4)
    assert sel.shares[0].tolist() == [10, 11, 13, 14]
    assert sel.discard["missing_tag"].tolist() == [12]


def test_bad_declared_sizes_are_discarded():
    cols = {"uid": np.array([1, 1, 2, 2, 3]), "n": np.array([2, 3, 0, 0, 1.5])}
    cands = Candidates.from_arrays(np.arange(5), cols)
    sel = GroupSampler(size_tag="n").sample(cands, 4)
    assert sorted(sel.discard["bad_group_size"].tolist()) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({}, ["group_size", "size_tag", "None"]),
        ({"group_size": 4, "size_tag": "n"}, ["exactly one", "4", "'n'"]),
        ({"group_size": 0}, ["group_size", ">= 1", "0"]),
        ({"group_size": 2, "group_tag": ""}, ["group_tag", "''"]),
    ],
)
def test_bad_arguments_name_argument_and_value(kwargs, words):
    with pytest.raises(ConfigError) as e:
        GroupSampler(**kwargs)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_batch_size_must_be_multiple_of_group_size():
    cands = Candidates.from_arrays(np.arange(8), {"uid": np.repeat(np.arange(2), 4)})
    with pytest.raises(ConfigError, match=r"batch_size must be a multiple of group_size=4.*6"):
        GroupSampler(group_size=4).sample(cands, 6)


def test_a_tag_no_candidate_has_reads_as_missing():
    """The controller never offers rows without a sampler's required tags; a sampler
    called directly on such rows sees missing values, not an exception."""
    cands = Candidates.from_arrays(np.arange(4), {"other": np.zeros(4)}, partition="train")
    assert np.isnan(cands.tag("uid")).all()
    sel = GroupSampler(group_size=2).sample(cands, 2)
    assert not sel.ready and sel.discard["missing_tag"].tolist() == [0, 1, 2, 3]
