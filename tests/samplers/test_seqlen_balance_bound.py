"""Issue 20 item 14: SeqlenBalancedSampler with equal_rows at dp 8 keeps every step
within 5 % of the lower bound total/8 when a split reaching it exists, and a step that
cannot reach it is shown to be one (its best split is found)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tests.samplers.test_samplers_common import check_selection, columns_candidates
from tq_stream.samplers import SeqlenBalancedSampler
from tq_stream.samplers.balance import part_loads
from tq_stream.samplers.balance_refine import refine_equal

DP = 8


def _loads(seqlen: np.ndarray, rows_per_rank: int) -> np.ndarray:
    cands = columns_candidates({"seqlen": seqlen}, np.arange(len(seqlen)), dp_size=DP)
    sel = SeqlenBalancedSampler(cost_tag="seqlen").sample(cands, rows_per_rank)
    check_selection(sel, cands)
    assert [len(s) for s in sel.shares] == [rows_per_rank] * DP  # equal rows
    return np.asarray([seqlen[s].sum() for s in sel.shares])


def _planted(rng: np.random.Generator, m: int) -> np.ndarray:
    """8 x m sequence lengths (lognormal, like rollouts) that split into 8 parts of m
    rows with exactly equal totals, shuffled."""
    rows = np.round(rng.lognormal(8, 1, (DP, m - 1)))
    total = np.round(rows.sum(1).max() * 1.1 + 500)
    return rng.permutation(np.concatenate([rows.ravel(), total - rows.sum(1)]))


@pytest.mark.parametrize("m", [3, 4, 5, 8, 16])
def test_steps_that_can_reach_the_bound_come_within_5_percent(m):
    """Before the local search (balance_refine), 4 rows per rank left e.g. loads
    [69461, 63758, ...] against total/8 = 62,967; 1-2 % of such steps were > 5 % off.
    At 3 rows per rank, re-splitting pairs of ranks still left 3 of 300 steps up to 7 %
    off, although an exact split exists (planted): no re-split of the heaviest rank
    with any single other rank helps there; a re-split with two others does."""
    rng = np.random.default_rng(20)
    worst = max(_loads(s, m).max() / (s.sum() / DP)
                for s in (_planted(rng, m) for _ in range(300)))
    assert worst <= 1.05, worst


def test_equal_length_rows_split_exactly():
    assert (_loads(np.full(DP * 4, 1000.0), 4) == 4000).all()
    assert (_loads(np.full(DP * 3, 1000.0), 3) == 3000).all()
    # 35 rows of a closed partition's short last step: 32 split evenly, 3 left out
    cands = columns_candidates({"seqlen": np.full(35, 1000.0)}, np.arange(35), dp_size=DP)
    sel = SeqlenBalancedSampler(cost_tag="seqlen").tail(cands, 8)
    assert {len(s) for s in sel.shares} == {4} and len(sel.rows) == 32


def test_a_step_two_rows_per_rank_cannot_reach_the_bound():
    """16 rows, 2 per rank: pairing the longest with the shortest is the best split (any
    other pairing has a heavier pair). Here it is 12 % above total/8, and the sampler
    finds exactly it: the bound is out of reach, not missed."""
    seqlen = np.asarray([30000, 29000, 28000, 27000, 26000, 25000, 24000, 23000,
                         900, 800, 700, 600, 500, 400, 300, 200], dtype=np.float64)
    s = np.sort(seqlen)
    best = max(s[i] + s[-1 - i] for i in range(DP))
    # brute force over the pairings of the 8 longest rows with the 8 shortest agrees
    brute = min(max(a + b for a, b in zip(s[DP:], perm, strict=True))
                for perm in itertools.permutations(s[:DP]))
    assert brute == best and best / (seqlen.sum() / DP) > 1.05
    assert _loads(seqlen, 2).max() == best


def test_a_split_that_no_pair_of_parts_can_improve_is_improved_over_three():
    """Why 3 rows per rank missed the bound: here the heaviest part (57) cannot get
    lighter by re-splitting it with any one other part, yet the items split exactly
    (54 each) by a cyclic exchange over all three parts."""
    items = np.asarray([26, 5, 13, 8, 26, 11, 23, 33, 17], dtype=np.float64)
    start = [np.asarray(p) for p in ([3, 4, 6], [0, 2, 5], [7, 1, 8])]  # 57, 50, 55
    assert part_loads(items, start).tolist() == [57, 50, 55]
    for other in (1, 2):
        pool = np.concatenate([start[0], start[other]])
        total = items[pool].sum()
        best = min(max(half, total - half) for half in
                   (items[list(c)].sum() for c in itertools.combinations(pool, 3)))
        assert best >= 57  # no re-split of the pair has a lighter heavier half
    assert part_loads(items, refine_equal(items, start)).tolist() == [54, 54, 54]
