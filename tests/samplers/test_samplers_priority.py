"""PrioritySampler: weighted, seeded, resumable, without replacement."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.samplers.test_samplers_common import check_selection, columns_candidates, simulate
from tq_stream.errors import ConfigError
from tq_stream.samplers import Candidates, PrioritySampler

SETTINGS = settings(max_examples=60, deadline=None, database=None)


def cands_for(prio, dp=1, **kw):
    return columns_candidates(
        {"priority": np.asarray(prio)}, np.arange(len(prio)), dp_size=dp, **kw
    )


@SETTINGS
@given(
    seed=st.integers(0, 2**31),
    n=st.integers(0, 80),
    dp=st.integers(1, 4),
    batch=st.integers(1, 10),
    alpha=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
)
def test_selection_is_valid_and_deterministic(seed, n, dp, batch, alpha):
    prio = np.random.default_rng(seed).random(n) * (np.arange(n) % 3)  # a third are zero
    a, b = PrioritySampler(seed=seed, alpha=alpha), PrioritySampler(seed=seed, alpha=alpha)
    sa, sb = a.sample(cands_for(prio, dp), batch), b.sample(cands_for(prio, dp), batch)
    check_selection(sa, cands_for(prio, dp))
    assert [s.tolist() for s in sa.shares] == [s.tolist() for s in sb.shares]
    assert sa.ready == (n >= batch * dp)
    if sa.ready:
        assert [len(s) for s in sa.shares] == [batch] * dp
        positive = int((prio > 0).sum()) if alpha > 0 else n
        if positive >= batch * dp:  # zero-priority rows only when the others run out
            assert (prio[sa.rows] > 0).all() or alpha == 0


@SETTINGS
@given(seed=st.integers(0, 2**31), chunk=st.integers(1, 30), dp=st.integers(1, 3))
def test_stream_hands_each_row_once(seed, chunk, dp):
    cols = {"priority": np.random.default_rng(seed).random(90)}
    trace = simulate(PrioritySampler(seed=seed), cols, 4, dp, arrivals=[chunk] * 10)
    assert len(trace.handed) == 90 - len(trace.leftover)


def test_draws_follow_the_weights():
    prio = np.array([1.0] * 50 + [10.0] * 50)
    s = PrioritySampler(seed=0)
    heavy = sum(int((s.sample(cands_for(prio), 10).rows >= 50).sum()) for _ in range(200))
    assert heavy / 2000 > 0.85  # E ~ 0.9 for successive weighted draws
    s = PrioritySampler(seed=0, alpha=0.0)
    heavy = sum(int((s.sample(cands_for(prio), 10).rows >= 50).sum()) for _ in range(200))
    assert 0.4 < heavy / 2000 < 0.6


def test_state_roundtrip_through_json_gives_the_same_sequence():
    prio = np.random.default_rng(1).random(500)
    a = PrioritySampler(seed=7)
    a.sample(cands_for(prio), 8)
    state = json.loads(json.dumps(a.state_dict()))
    b = PrioritySampler(seed=99)
    b.load_state_dict(state)
    for _ in range(5):
        assert (
            a.sample(cands_for(prio), 8).rows.tolist() == b.sample(cands_for(prio), 8).rows.tolist()
        )


def test_missing_priority_discarded_and_tail():
    prio = np.array([1.0, np.nan, 2.0, 0.0, 3.0])
    s = PrioritySampler()
    sel = s.sample(cands_for(prio, dp=2), 4)
    assert not sel.ready and sel.discard["missing_tag"].tolist() == [1]
    tail = s.tail(cands_for(prio, dp=2, closed=True), 4)
    assert sorted(tail.rows.tolist()) == [0, 2, 3, 4] and [len(x) for x in tail.shares] == [2, 2]


@pytest.mark.parametrize("bad", [-1.0, np.inf])
def test_bad_priority_is_a_clear_error(bad):
    with pytest.raises(ConfigError) as e:
        PrioritySampler().sample(cands_for([1.0, bad]), 1)
    assert "'priority'" in str(e.value) and str(bad) in str(e.value) and "row 1" in str(e.value)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"replacement": True}, ["replacement", "True", "at most once"]),
        ({"alpha": -0.5}, ["alpha", ">= 0", "-0.5"]),
        ({"alpha": float("inf")}, ["alpha", "inf"]),
        ({"seed": -3}, ["seed", "-3"]),
        ({"priority_tag": ""}, ["priority_tag", "''"]),
    ],
)
def test_bad_arguments_name_argument_and_value(kwargs, words):
    with pytest.raises(ConfigError) as e:
        PrioritySampler(**kwargs)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_load_state_dict_rejects_a_foreign_rng_state():
    s = PrioritySampler()
    with pytest.raises(ConfigError, match="PCG64"):
        s.load_state_dict({"rng": {"bit_generator": "MT19937", "state": {}}})
    with pytest.raises(ConfigError, match="not a valid PCG64"):
        s.load_state_dict({"rng": {"bit_generator": "PCG64", "state": {"bogus": 1}}})


def test_from_arrays_candidates_work_too():
    cands = Candidates.from_arrays([5, 6, 7], {"priority": np.array([0.0, 1.0, 0.0])})
    assert PrioritySampler().sample(cands, 1).rows.tolist() == [6]


def test_state_survives_msgpack_which_has_no_128_bit_ints():
    import msgspec

    a = PrioritySampler(seed=11)
    b = PrioritySampler(seed=0)
    b.load_state_dict(msgspec.msgpack.decode(msgspec.msgpack.encode(a.state_dict())))
    prio = np.random.default_rng(2).random(100)
    assert a.sample(cands_for(prio), 8).rows.tolist() == b.sample(cands_for(prio), 8).rows.tolist()
