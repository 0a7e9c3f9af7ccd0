"""Stopping a loader with DataLoader workers ends their waits (found by the GRPO
example: after a `break`, each worker sat in its long-poll until torch's shutdown
gave up on it after 5 s and killed it)."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch
from tq_fixtures import local_stream

import tq_stream as tq

__all__ = ["local_stream"]

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def test_workers_exit_by_themselves_when_the_loop_stops(local_stream, monkeypatch):
    # torch joins each worker for this long, then kills it: make "then" never come
    # within the test's bound, so only workers that end by themselves pass
    monkeypatch.setattr(torch.utils.data._utils, "MP_STATUS_CHECK_INTERVAL", 600.0)
    keys = [f"s{i}" for i in range(2)]
    local_stream.writer("stop").put(keys, {"x": torch.arange(2.0)})  # one step only
    ds = tq.StreamingDataset(local_stream, "stop", "t", ["x"], batch_size=2, timeout=60)
    loader = tq.StreamingDataLoader(ds, num_workers=2, multiprocessing_context="fork")
    before = set(mp.active_children())
    it = iter(loader)
    assert tq.batch_meta(next(it)).keys == tuple(keys)
    workers = [p for p in mp.active_children() if p not in before]
    assert len(workers) == 2  # both wait for a step that will not come within 60 s
    it.close()  # a `break` out of the training loop
    assert [p.is_alive() for p in workers] == [False, False]
