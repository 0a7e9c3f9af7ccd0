"""A run broken off, saved, restored and resumed yields the same batches, in the same
order, as the uninterrupted run (issue #10 item 3), for every built-in sampler and a
custom stateful sampler written per the README's guide.

Why it holds: a formed step's shares never change and are checkpointed, so the steps a
loader fetched ahead (whose formation already advanced the sampler's state) are handed
out unchanged after the restore, and later steps are formed by the restored sampler
state exactly as they would have been."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tq_stream as tq
from tq_stream.samplers import Candidates, Sampler, Selection

P = "train"
N = 48


class Curriculum(Sampler):
    """Stateful, per the README's guide: hands out the shortest rows first, and after
    every step raises the length cap (its state), so steps depend on earlier steps."""

    STATE_KEYS = ("cap",)

    def __init__(self, start: int = 4) -> None:
        self.cap = start

    def required_tags(self) -> tuple[str, ...]:
        return ("seqlen",)

    def sample(self, candidates: Candidates, batch_size: int) -> Selection:
        need = batch_size * candidates.dp_size
        lengths = candidates.tag("seqlen")
        fit = candidates.index[lengths <= self.cap]
        if len(fit) < need:
            if not candidates.closed:
                return Selection.wait()
            fit = candidates.index[np.argsort(lengths, kind="stable")]
            if len(fit) < need:
                return Selection.wait()
        self.cap += 3
        return Selection.split(fit[:need], candidates.dp_size)


SAMPLERS = {
    "sequential": lambda: None,
    "group": lambda: tq.samplers.GroupSampler(group_size=4),
    "staleness": lambda: tq.samplers.StalenessSampler(tq.samplers.GroupSampler(4), 100),
    "seqlen": lambda: tq.samplers.SeqlenBalancedSampler(tq.samplers.GroupSampler(4)),
    "dynamic_filter": lambda: tq.samplers.DynamicFilterSampler(
        tq.samplers.GroupSampler(4), reward_tag="reward"),
    "priority": lambda: tq.samplers.PrioritySampler(seed=3),
    "curriculum": lambda: Curriculum(),
}


def fill(stream: tq.Stream, seed: int) -> None:
    rng = np.random.default_rng(seed)
    keys = [f"k{i}" for i in range(N)]
    tags = [{"uid": f"g{i // 4}", "version": 1, "seqlen": int(rng.integers(1, 40)),
             "reward": float(rng.integers(0, 2)), "priority": float(rng.random() + 0.1)}
            for i in range(N)]
    stream.writer(P).put(keys, {"x": torch.arange(N, dtype=torch.float32)}, tags=tags)
    stream.close_partition(P)


def loader(stream: tq.Stream, name: str, dp_size: int, rank: int) -> tq.StreamingDataLoader:
    ds = tq.StreamingDataset(stream, P, "actor", ["x"], batch_size=4, dp_size=dp_size,
                             dp_rank=rank, sampler=SAMPLERS[name](), prefetch=3, timeout=5.0)
    return tq.StreamingDataLoader(ds)


def keys_of(batch) -> tuple[str, ...]:
    return tuple(tq.batch_meta(batch).keys)


def uninterrupted(name: str, seed: int) -> list[tuple[str, ...]]:
    with tq.init() as stream:
        fill(stream, seed)
        stream.set_version(P, "actor", 1)
        return [keys_of(b) for b in loader(stream, name, 1, 0)]


def resumed(name: str, seed: int, stop: int, tmp: str) -> list[tuple[str, ...]]:
    path = f"{tmp}/ckpt-{name}-{seed}-{stop}"
    with tq.init() as stream:
        fill(stream, seed)
        stream.set_version(P, "actor", 1)
        first = loader(stream, name, 1, 0)
        got = []
        for i, batch in enumerate(first):
            got.append(keys_of(batch))
            if i + 1 == stop:
                break
        state = first.state_dict()  # the last batch was trained on, not acked yet
        stream.save(path)
    with tq.init(restore=path) as stream:
        again = loader(stream, name, 1, 0)
        again.load_state_dict(state)
        got += [keys_of(b) for b in again]
    return got


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_resume_yields_the_uninterrupted_batches(name, tmp_path):
    want = uninterrupted(name, seed=1)
    assert len(want) >= 3
    assert resumed(name, 1, 2, str(tmp_path)) == want


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(sorted(SAMPLERS)), seed=st.integers(0, 1000),
       stop=st.integers(1, 5))
def test_resume_property(name, seed, stop, tmp_path):
    want = uninterrupted(name, seed)
    if stop >= len(want):
        stop = max(1, len(want) - 1)
    assert resumed(name, seed, stop, str(tmp_path)) == want
