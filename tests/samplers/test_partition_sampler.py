"""PartitionSampler: one loader over several partitions (mixing weights, priority order)."""

from __future__ import annotations

import threading
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tq_stream as tq
from tq_stream.errors import ConfigError
from tq_stream.samplers import GroupSampler, PartitionSampler


def _fill(stream: tq.Stream, partition: str, n: int, close: bool = True) -> None:
    stream.writer(partition).put([f"{partition}{i}" for i in range(n)],
                                 {"x": torch.arange(n, dtype=torch.float32)},
                                 tags=[{"uid": f"{partition}{i // 2}"} for i in range(n)])
    if close:
        stream.close_partition(partition)


def _read(stream: tq.Stream, sampler: PartitionSampler, task: str, rank: int = 0,
          dp_size: int = 1, out: dict | None = None) -> list[tq.BatchMeta]:
    ds = tq.StreamingDataset(stream, None, task, ["x"], batch_size=2, dp_rank=rank,
                             dp_size=dp_size, sampler=sampler, timeout=5)
    loader = tq.StreamingDataLoader(ds)
    metas = [tq.batch_meta(b) for b in loader]
    if out is not None:
        out[rank] = (metas, loader.stats())
    return metas


def test_order_drains_the_first_partition_first(stream):
    _fill(stream, "val", 6)
    _fill(stream, "train", 10)
    metas = _read(stream, PartitionSampler(order=["val", "train"]), "t")
    parts = [m.partition for m in metas]
    assert parts == ["val"] * 3 + ["train"] * 5
    keys = [k for m in metas for k in m.keys]
    assert sorted(keys) == sorted([f"val{i}" for i in range(6)] + [f"train{i}" for i in range(10)])


def test_weights_mix_partitions_and_every_row_arrives_once(stream):
    _fill(stream, "a", 300)
    _fill(stream, "b", 300)
    metas = _read(stream, PartitionSampler(weights={"a": 3, "b": 1}, seed=7), "mix")
    first = Counter(m.partition for m in metas[:80])
    assert first["a"] > 2 * first["b"]  # 3:1 mixing while both last (binomial, n=80)
    keys = [k for m in metas for k in m.keys]
    assert len(keys) == len(set(keys)) == 600


def test_two_ranks_agree_on_the_route_and_get_disjoint_rows(stream):
    _fill(stream, "a", 40)
    _fill(stream, "b", 24)
    out: dict = {}
    threads = [threading.Thread(target=_read, args=(
        stream, PartitionSampler(weights={"a": 1, "b": 1}, seed=3), "dp", r, 2, out))
        for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    (m0, stats0), (m1, stats1) = out[0], out[1]
    assert [m.partition for m in m0] == [m.partition for m in m1]
    keys0 = {k for m in m0 for k in m.keys}
    keys1 = {k for m in m1 for k in m.keys}
    assert not keys0 & keys1 and len(keys0 | keys1) == 64
    assert stats0["rows"]["a"] + stats1["rows"]["a"] == 40
    assert stats0["rows"]["b"] + stats1["rows"]["b"] == 24


def test_inner_samplers_per_partition(stream):
    _fill(stream, "g", 8)
    metas = _read(stream, PartitionSampler(order=["g"], samplers={"g": GroupSampler(2)}), "grp")
    for m in metas:
        assert len({t["uid"] for t in m.tags}) == 1  # batch_size 2 = one whole group


@settings(max_examples=40, deadline=None)
@given(weights=st.lists(st.floats(0.1, 10), min_size=1, max_size=4),
       ends=st.lists(st.integers(0, 20), min_size=4, max_size=4), seed=st.integers(0, 99))
def test_route_is_deterministic_and_respects_ends(weights, ends, seed):
    names = [f"p{i}" for i in range(len(weights))]
    ended = {n: e for n, e in zip(names, ends, strict=False) if e % 2 == 0}
    a = PartitionSampler(weights=dict(zip(names, weights, strict=True)), seed=seed)
    b = PartitionSampler(weights=dict(zip(names, weights, strict=True)), seed=seed)
    seen: Counter[str] = Counter()
    for step in range(60):
        ra, rb = a.route(step, ended), b.route(step, ended)
        assert ra == rb
        if ra is None:
            assert all(n in ended for n in names)
            break
        part, local = ra
        assert local == seen[part]  # local steps of a partition are 0, 1, 2, ...
        assert part not in ended or local < ended[part]
        seen[part] += 1


@pytest.mark.parametrize("kwargs, words", [
    ({}, "exactly one of weights or order"),
    ({"weights": {"a": 0}}, "weights['a'] must be a number > 0, got 0"),
    ({"order": ["a", "a"]}, "distinct partitions"),
    ({"order": ["a"], "samplers": {"b": GroupSampler(2)}}, "extra ['b']"),
])
def test_bad_arguments(kwargs, words):
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        PartitionSampler(**kwargs)


def test_partition_argument_must_match_the_sampler(stream):
    with pytest.raises(ConfigError, match="partition must be None"):
        tq.StreamingDataset(stream, "other", "t", ["x"], batch_size=2,
                            sampler=PartitionSampler(order=["a"]))


def test_state_roundtrip():
    s = PartitionSampler(weights={"a": 1, "b": 2}, seed=5)
    route = [s.route(i, {}) for i in range(10)]
    t = PartitionSampler(weights={"a": 1, "b": 2}, seed=0)
    t.load_state_dict(s.state_dict())
    assert [t.route(i, {}) for i in range(10)] == route
    with pytest.raises(ConfigError, match="must have keys"):
        t.load_state_dict({"seed": 1, "extra": 2})


# ------------------------------------------------------------ the mix over short windows


def _window_shares(route: list[str], names: list[str], window: int = 20) -> np.ndarray:
    """Share of each partition in every window of ``window`` consecutive steps."""
    onehot = np.asarray([[r == n for n in names] for r in route], dtype=np.float64)
    cums = np.vstack([np.zeros(len(names)), np.cumsum(onehot, axis=0)])
    return (cums[window:] - cums[:-window]) / window


def test_issue_replay_every_window_of_20_holds_the_mix():
    # weights 3:1 drawn at random per step gave 45%-95% math over windows of 20
    s = PartitionSampler(weights={"math": 3, "code": 1}, seed=0)
    route = [s.route(i, {})[0] for i in range(400)]
    math_share = _window_shares(route, ["math", "code"])[:, 0]
    assert math_share.min() >= 0.70 and math_share.max() <= 0.80


def test_two_choices_short_of_their_bound_in_one_window_are_both_met():
    """Found by the property below (1 CI run in ~4): looking only at the window that
    closes now, p2 and p3 were both short at step 19 and one window held 25% p2 (30%)."""
    weights = [1, 1, 10, 15, 3.125, 3.125]
    names = [f"p{i}" for i in range(len(weights))]
    s = PartitionSampler(weights=dict(zip(names, weights, strict=True)), seed=0)
    route = [s.route(i, {})[0] for i in range(400)]
    shares = np.asarray(weights) / sum(weights)
    assert np.abs(_window_shares(route, names) - shares).max() <= 0.05 + 1e-9


@settings(max_examples=150, deadline=None, database=None)
@given(weights=st.lists(st.one_of(st.integers(1, 20), st.floats(0.05, 20)), min_size=1,
                        max_size=6),
       seed=st.integers(0, 2**16), steps=st.integers(20, 400))
def test_windows_are_within_5_percent_identical_everywhere_and_resumable(weights, seed, steps):
    names = [f"p{i}" for i in range(len(weights))]
    spec = dict(zip(names, weights, strict=True))
    rank0 = PartitionSampler(weights=spec, seed=seed)
    route = [rank0.route(i, {})[0] for i in range(steps)]
    shares = np.asarray(weights, dtype=np.float64) / sum(weights)
    dev = np.abs(_window_shares(route, names) - shares)
    assert dev.max(initial=0.0) <= 0.05 + 1e-9
    counts = np.asarray([route.count(n) for n in names])
    assert np.abs(counts - steps * shares).max() < 1.5  # the whole run holds the mix too
    worker = PartitionSampler(weights=spec, seed=seed)  # another rank or worker process
    assert [worker.route(i, {})[0] for i in reversed(range(steps))] == route[::-1]
    resumed = PartitionSampler(weights=spec, seed=0)
    resumed.load_state_dict(rank0.state_dict())
    mid = steps // 2
    assert [resumed.route(i, {})[0] for i in range(mid, steps)] == route[mid:]


def test_the_mix_restarts_among_the_rest_when_a_partition_ends():
    s = PartitionSampler(weights={"a": 2, "b": 1, "c": 1}, seed=1)
    ends = {"c": 10}
    route = []
    for i in range(200):
        r = s.route(i, ends)
        route.append(r[0])
    last_c = max(i for i, r in enumerate(route) if r == "c")
    assert route.count("c") == 10
    after = route[last_c + 1:]
    a_share = _window_shares(after, ["a", "b"])[:, 0]
    assert np.abs(a_share - 2 / 3).max() <= 0.05 + 1e-9
