"""Every DP rank runs the same number of optimizer steps: SeqlenBalanced + minibatches.

Ranks are threads, each with its own StreamingDataLoader; a barrier per optimizer step
stands in for the FSDP/DDP collective, so a rank with one more minibatch than the
others breaks the barrier (the hang a real job would have) instead of passing.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tq_stream as tq
from tq_stream.datasets.minibatch import minibatch_bounds
from tq_stream.errors import ConfigError
from tq_stream.samplers import GroupSampler, SeqlenBalancedSampler

P = "train"


def _run_ranks(stream, dp, batch_size, sampler_fn, mb_kwargs) -> dict[int, list]:
    barrier = threading.Barrier(dp, timeout=10)
    out: dict[int, list] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            # a short last step may hold fewer rows than num_minibatches: drop it
            drop = mb_kwargs.get("num_minibatches", 1) > 1
            ds = tq.StreamingDataset(stream, P, "actor", ["x"], batch_size, dp_rank=r,
                                     dp_size=dp, sampler=sampler_fn(), timeout=10,
                                     drop_last=drop)
            loader = tq.StreamingDataLoader(ds)
            steps = []
            for batch in loader:
                for mb in loader.minibatches(batch, **mb_kwargs):
                    barrier.wait()  # the collective of one optimizer step
                    steps.append(len(mb))
            out[r] = steps
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(dp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    return out


@settings(max_examples=15, deadline=None, database=None)
@given(seed=st.integers(0, 2**31), dp=st.integers(2, 4), group=st.sampled_from([1, 2, 4]),
       n_groups=st.integers(4, 40), mb=st.sampled_from([
           {"minibatch_size": 2}, {"minibatch_size": 3, "drop_last": True},
           {"num_minibatches": 2}, {"num_minibatches": 2, "epochs": 2, "shuffle": True}]))
def test_ranks_run_the_same_number_of_steps(seed, dp, group, n_groups, mb):
    rng = np.random.default_rng(seed)
    n = n_groups * group
    # skewed lengths: a few very long rows, as RL responses are
    seqlen = np.where(rng.random(n) < 0.2, rng.integers(2000, 8000, n), rng.integers(1, 300, n))
    stream = tq.init(config=tq.StreamConfig(timeout=10.0))
    try:
        stream.writer(P).put([f"k{i}" for i in range(n)], {"x": torch.arange(n)},
                             tags=[{"seqlen": int(s), "uid": i // group}
                                   for i, s in enumerate(seqlen.tolist())])
        stream.close_partition(P)

        def sampler():
            return SeqlenBalancedSampler(GroupSampler(group_size=group) if group > 1 else None)

        out = _run_ranks(stream, dp, 2 * group, sampler, mb)
        counts = {r: len(s) for r, s in out.items()}
        assert len(set(counts.values())) == 1, counts
        sizes = {r: tuple(s) for r, s in out.items()}
        assert len(set(sizes.values())) == 1, sizes  # the same minibatch sizes too
    finally:
        stream.close()


def test_opt_out_may_give_unequal_rows(stream):
    # equal_rows=False: the rank with the long rows gets fewer of them
    seqlen = [1000, 1, 1, 1, 1, 1, 1, 1]
    stream.writer(P).put([f"k{i}" for i in range(8)], {"x": torch.arange(8)},
                         tags=[{"seqlen": s} for s in seqlen])
    stream.close_partition(P)
    out = _run_ranks(stream, 2, 4, lambda: SeqlenBalancedSampler(equal_rows=False),
                     {"minibatch_size": 8})
    rows = {r: steps for r, steps in out.items()}  # one minibatch per batch: its rows
    assert sorted(rows.values()) == [[1], [7]]


@pytest.mark.parametrize("n, kwargs, sizes", [
    (10, {"minibatch_size": 4}, [4, 4, 2]),
    (10, {"minibatch_size": 4, "drop_last": True}, [4, 4]),
    (10, {"num_minibatches": 3}, [4, 3, 3]),
    (10, {"num_minibatches": 3, "drop_last": True}, [3, 3, 3]),
    (3, {"num_minibatches": 3}, [1, 1, 1]),
])
def test_minibatch_bounds(n, kwargs, sizes):
    kwargs = {"minibatch_size": None, "num_minibatches": None, "drop_last": False, **kwargs}
    bounds = minibatch_bounds(n, **kwargs)
    assert [b - a for a, b in bounds] == sizes
    assert all(b == c for (_, b), (c, _) in zip(bounds, bounds[1:], strict=False))


@pytest.mark.parametrize("kwargs, words", [
    ({}, "exactly one of minibatch_size or num_minibatches"),
    ({"minibatch_size": 2, "num_minibatches": 2}, "exactly one of"),
    ({"num_minibatches": 5}, "num_minibatches must be <= the batch's 4 rows, got 5"),
    ({"minibatch_size": 0}, "minibatch_size"),
])
def test_minibatch_arguments_are_checked(stream, kwargs, words):
    stream.writer(P).put([f"k{i}" for i in range(4)], {"x": torch.arange(4)})
    loader = tq.StreamingDataLoader(tq.StreamingDataset(stream, P, "a", ["x"], 4))
    batch = next(iter(loader))
    with pytest.raises(ConfigError, match=words):
        list(loader.minibatches(batch, **kwargs))


def test_shuffle_differs_per_step_and_matches_across_replicas(stream):
    n = 64
    stream.writer(P).put([f"k{i}" for i in range(n)], {"x": torch.arange(n)})
    stream.close_partition(P)

    def orders(replica, replica_seed):
        ds = tq.StreamingDataset(stream, P, "t", ["x"], 16, replicas=2, replica=replica)
        loader = tq.StreamingDataLoader(ds)
        got = []
        for batch in loader:
            mbs = loader.minibatches(batch, num_minibatches=1, shuffle=True, seed=replica_seed)
            first = torch.cat([mb["x"] for mb in mbs])
            got.append((first - batch["x"].min()).tolist())  # the permutation itself
        return got

    got: dict[int, list] = {}
    # the two replicas of rank 0, each with its id (both used to read as replica 0, so
    # one could take a step the other then skipped: a flaky test)
    threads = [threading.Thread(target=lambda i=i: got.setdefault(i, orders(i, 7)))
               for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    a, b = got[0], got[1]
    assert len(a) == 4 and len({tuple(p) for p in a}) == 4  # a new shuffle every step
    assert a == b  # replicas: same steps, same shuffles
