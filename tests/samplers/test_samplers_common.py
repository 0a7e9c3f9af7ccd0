"""Shared helpers for the sampler tests, and the tests every sampler must pass."""

from __future__ import annotations

import json
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import pytest

import tq_stream.samplers as samplers
from tq_stream.errors import ConfigError
from tq_stream.samplers import (
    Candidates,
    DynamicFilterSampler,
    GroupSampler,
    PrioritySampler,
    Sampler,
    Selection,
    SeqlenBalancedSampler,
    SequentialSampler,
    StalenessSampler,
)
from tq_stream.samplers.base import merge_discards, missing_mask

# ---------------------------------------------------------------- helpers


def columns_candidates(columns: Mapping[str, np.ndarray], rows: np.ndarray, **kwargs) -> Candidates:
    """Candidates over ``rows`` (row ids indexing ``columns``), as the controller builds them."""
    rows = np.asarray(rows, dtype=np.int64)
    return Candidates(
        index=rows,
        ready_time=rows.astype(np.float64),
        _tags=lambda name, r: columns[name][r],
        _has_tag=columns.__contains__,
        **kwargs,
    )


def grouped_columns(
    seed: int,
    n_groups: int,
    group_size: int,
    p_incomplete: float = 0.2,
    p_overfull: float = 0.0,
    spread: float = 3.0,
) -> dict[str, np.ndarray]:
    """Rows of ``n_groups`` groups, interleaved in ready order; some groups incomplete
    (missing rows) or overfull (extra rows). Row id = position in ready order."""
    rng = np.random.default_rng(seed)
    sizes = np.full(n_groups, group_size)
    roll = rng.random(n_groups)
    short = roll < p_incomplete
    sizes[short] = rng.integers(0, group_size, short.sum()) if group_size > 0 else 0
    over = (roll >= p_incomplete) & (roll < p_incomplete + p_overfull)
    sizes[over] += rng.integers(1, 3, over.sum())
    uid = np.repeat(np.arange(n_groups), sizes)
    order = np.argsort(uid + rng.random(uid.shape[0]) * spread, kind="stable")
    uid = uid[order]
    return {
        "uid": uid,
        "seqlen": rng.integers(1, 512, uid.shape[0]),
        "reward": rng.integers(0, 2, uid.shape[0]).astype(np.float64),
        "version": rng.integers(0, 6, uid.shape[0]),
        "priority": rng.random(uid.shape[0]),
    }


def check_selection(sel: Selection, cands: Candidates) -> None:
    """Invariants of every answer: rows are candidates, unique, shares non-empty, discards
    disjoint from the handed-out rows."""
    cand = set(cands.index.tolist())
    handed = sel.rows.tolist()
    assert len(handed) == len(set(handed)), "a row is handed out twice in one selection"
    assert set(handed) <= cand
    if sel.ready:
        assert len(sel.shares) == cands.dp_size
        assert all(len(s) > 0 for s in sel.shares), [len(s) for s in sel.shares]
        assert all(s.dtype == np.int64 for s in sel.shares)
    dropped: list[int] = []
    for reason, rows in sel.discard.items():
        assert isinstance(reason, str) and len(rows) > 0
        dropped += np.asarray(rows).tolist()
    assert len(dropped) == len(set(dropped)), "a row is discarded twice"
    assert set(dropped) <= cand
    assert not set(dropped) & set(handed)


@dataclass
class Trace:
    """What a simulated stream handed out and dropped."""

    steps: list[tuple[int, tuple[np.ndarray, ...]]] = field(default_factory=list)
    discarded: dict[str, list[int]] = field(default_factory=dict)
    tail: tuple[np.ndarray, ...] = ()
    leftover: list[int] = field(default_factory=list)

    @property
    def handed(self) -> list[int]:
        rows = [r for _, shares in self.steps for s in shares for r in s.tolist()]
        return rows + [r for s in self.tail for r in s.tolist()]


def simulate(
    sampler: Sampler,
    columns: Mapping[str, np.ndarray],
    batch_size: int,
    dp_size: int,
    arrivals: list[int],
    on_step: Callable[[int], int] | None = None,
    version: int | None = 0,
) -> Trace:
    """Feed rows to ``sampler`` as the controller does, ``arrivals[t]`` new ready rows per
    tick; handed-out and discarded rows leave the candidates. The consumer version goes
    up by one per step (or as ``on_step(version)`` says). Checks every answer."""
    n = len(next(iter(columns.values())))
    available = np.ones(n, dtype=bool)
    ready = 0
    trace = Trace()
    ticks = list(arrivals) + [n]
    for arrive in ticks:
        ready = min(n, ready + arrive)
        closed = ready >= n
        for _ in range(n + 1):
            rows = np.flatnonzero(available[:ready])
            cands = columns_candidates(
                columns,
                rows,
                dp_size=dp_size,
                closed=closed,
                version=version,
                step=len(trace.steps),
            )
            sel = sampler.sample(cands, batch_size)
            check_selection(sel, cands)
            for reason, dropped in sel.discard.items():
                assert available[dropped].all()
                available[dropped] = False
                trace.discarded.setdefault(reason, []).extend(dropped.tolist())
            if not sel.ready:
                break
            assert available[sel.rows].all(), "a row is handed out twice across steps"
            available[sel.rows] = False
            trace.steps.append((-1 if version is None else version, sel.shares))
            if version is not None:
                version = on_step(version) if on_step else version + 1
        if closed:
            break
    rows = np.flatnonzero(available)
    cands = columns_candidates(columns, rows, dp_size=dp_size, closed=True, version=version)
    sel = sampler.tail(cands, batch_size)
    check_selection(sel, cands)
    for reason, dropped in sel.discard.items():
        available[dropped] = False
        trace.discarded.setdefault(reason, []).extend(dropped.tolist())
    available[sel.rows] = False
    trace.tail = sel.shares
    trace.leftover = np.flatnonzero(available).tolist()
    handed = trace.handed
    assert len(handed) == len(set(handed)), "a row is handed out twice in the stream"
    every = handed + [r for v in trace.discarded.values() for r in v] + trace.leftover
    assert sorted(every) == list(range(n)), "a row was lost or counted twice"
    return trace


def assert_state_roundtrip(
    make: Callable[[], Sampler],
    columns: Mapping[str, np.ndarray],
    batch_size: int,
    dp_size: int,
    steps: int = 3,
) -> None:
    """A sampler restored mid-stream (through JSON) makes the same selections as the original."""
    a, b = make(), make()
    rows = np.arange(len(next(iter(columns.values()))))

    def step(s: Sampler, rows: np.ndarray) -> Selection:
        return s.sample(columns_candidates(columns, rows, dp_size=dp_size, version=5), batch_size)

    for _ in range(steps):  # advance a, then clone its state into b
        sel = step(a, rows)
        rows = np.setdiff1d(rows, np.concatenate([sel.rows, *sel.discard.values()]))
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for _ in range(steps):
        sa, sb = step(a, rows), step(b, rows)
        assert [s.tolist() for s in sa.shares] == [s.tolist() for s in sb.shares]
        rows = np.setdiff1d(rows, np.concatenate([sa.rows, *sa.discard.values()]))


ALL_SAMPLERS: dict[str, Callable[[], Sampler]] = {
    "sequential": SequentialSampler,
    "group": lambda: GroupSampler(group_size=4),
    "staleness": lambda: StalenessSampler(GroupSampler(group_size=4), max_staleness=2),
    "seqlen": lambda: SeqlenBalancedSampler(GroupSampler(group_size=4)),
    "dynamic": lambda: DynamicFilterSampler(GroupSampler(group_size=4)),
    "priority": lambda: PrioritySampler(seed=3),
    "staleness_priority": lambda: StalenessSampler(PrioritySampler(seed=4), max_staleness=3),
    "seqlen_priority": lambda: SeqlenBalancedSampler(PrioritySampler(seed=5), method="lpt"),
}

# ---------------------------------------------------------------- shared tests


def test_all_is_sorted_and_complete():
    assert samplers.__all__ == sorted(samplers.__all__)
    public = {
        n for n in dir(samplers)
        if not n.startswith("_") and not isinstance(getattr(samplers, n), types.ModuleType)
    }
    assert public == set(samplers.__all__)


@pytest.mark.parametrize("name", sorted(ALL_SAMPLERS))
def test_state_roundtrip(name):
    columns = grouped_columns(seed=1, n_groups=60, group_size=4)
    assert_state_roundtrip(ALL_SAMPLERS[name], columns, batch_size=4, dp_size=2)


@pytest.mark.parametrize("name", sorted(ALL_SAMPLERS))
def test_shared_state_roundtrip_helper(name):
    from tests.helpers.state_roundtrip import assert_state_roundtrip as shared_roundtrip

    columns = grouped_columns(seed=4, n_groups=60, group_size=4)
    cands = columns_candidates(columns, np.arange(len(columns["uid"])), dp_size=2, version=5)
    obj = ALL_SAMPLERS[name]()
    obj.sample(cands, 4)  # move any RNG off its seed

    def probe(s: Sampler) -> list[list[int]]:
        return [share.tolist() for share in s.sample(cands, 4).shares]

    shared_roundtrip(obj, ALL_SAMPLERS[name](), probe=probe)


@pytest.mark.parametrize("name", sorted(ALL_SAMPLERS))
def test_load_state_dict_is_strict(name):
    s = ALL_SAMPLERS[name]()
    with pytest.raises(ConfigError, match="must have keys"):
        s.load_state_dict({**s.state_dict(), "bogus": 1})


@pytest.mark.parametrize("name", sorted(ALL_SAMPLERS))
def test_stream_hands_each_row_at_most_once(name):
    columns = grouped_columns(seed=2, n_groups=50, group_size=4, p_overfull=0.1)
    trace = simulate(ALL_SAMPLERS[name](), columns, 4, 2, arrivals=[17] * 12)
    assert trace.steps


def test_merge_discards_concatenates_by_reason_and_drops_empty():
    merged = merge_discards(
        {"a": np.array([1]), "b": np.array([], dtype=np.int64)}, {"a": np.array([2, 3])}
    )
    assert {k: v.tolist() for k, v in merged.items()} == {"a": [1, 2, 3]}
    sel = Selection.wait({"x": np.array([7])}).with_discard({"x": np.array([8])})
    assert sel.discard["x"].tolist() == [7, 8] and not sel.ready


def test_missing_mask():
    assert missing_mask(np.array([1.0, np.nan])).tolist() == [False, True]
    assert missing_mask(np.array(["a", None, float("nan")], dtype=object)).tolist() == [
        False,
        True,
        True,
    ]
    assert missing_mask(np.array([1, 2])).tolist() == [False, False]
