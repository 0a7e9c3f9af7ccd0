"""Row copies between slabs and batches: runs of consecutive slots, and the fallback."""

from __future__ import annotations

import numpy as np
import torch

from tq_stream.buffers import gather_rows, runs, scatter_rows


def test_runs_split_consecutive_slots_and_give_up_when_scattered():
    assert runs(np.array([], dtype=np.int64)) == []
    assert runs(np.array([7])) == [(0, 7, 1)]
    assert runs(np.arange(5, 9)) == [(0, 5, 4)]
    slots = np.concatenate([np.arange(0, 300), np.arange(320, 1000)])  # a gap of spares
    assert runs(slots) == [(0, 0, 300), (300, 320, 680)]
    assert runs(np.array([3, 1])) is None  # small and not consecutive: one gather
    assert runs(np.random.default_rng(0).permutation(1024)) is None


def test_gather_and_scatter_give_the_same_rows_on_every_path():
    src = torch.arange(2000.0).view(1000, 2)
    cases = [np.arange(10, 20), np.concatenate([np.arange(0, 300), np.arange(320, 1000)]),
             np.random.default_rng(1).permutation(1000)[:700], np.array([999])]
    for slots in cases:
        want = src[torch.from_numpy(slots)]
        assert torch.equal(gather_rows(src, slots), want)
        out = torch.empty_like(want)
        assert gather_rows(src, slots, out).data_ptr() == out.data_ptr()
        assert torch.equal(out, want)
        dst = torch.zeros_like(src)
        scatter_rows(dst, slots, want)
        assert torch.equal(dst[torch.from_numpy(slots)], want)
        untouched = np.setdiff1d(np.arange(1000), slots)
        assert dst[torch.from_numpy(untouched)].eq(0).all()
