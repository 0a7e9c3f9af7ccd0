"""Local mode, DataLoader worker processes: batch conventions survive the worker
pickling (keys are the fields, metadata follows the rows, nested fields come back
nested); the spawn start method is flagged."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import tq_stream as tq
from tests.helpers.tq_fixtures import local_stream
from tq_stream.datasets.workers import SpawnStartWarning

__all__ = ["local_stream"]

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _put_nested(stream: tq.Stream, part: str, n: int) -> None:
    td = TensorDict({"obs": TensorDict({"image": torch.arange(n * 4.0).reshape(n, 2, 2),
                                        "state": torch.arange(n)}, [n]),
                     "r": torch.nested.nested_tensor([torch.ones(i % 3 + 1) * i
                                                      for i in range(n)], layout=torch.jagged),
                     "s": [f"s{i}" for i in range(n)]}, [n])
    stream.writer(part).put([f"k{i}" for i in range(n)], td, tags=[{"i": i} for i in range(n)])
    stream.close_partition(part)


def test_worker_batches_carry_fields_only_and_their_meta(local_stream):
    _put_nested(local_stream, "conv", 24)
    ds = tq.StreamingDataset(local_stream, "conv", "t", ["obs.image", "obs.state", "r", "s"],
                             batch_size=4, timeout=60)
    loader = tq.StreamingDataLoader(ds, num_workers=2, multiprocessing_context="fork")
    seen = []
    for batch in loader:
        assert sorted(batch.keys()) == ["obs", "r", "s"]
        meta = tq.batch_meta(batch)  # crossed the worker -> main process pickling
        idx = batch["obs", "state"].tolist()
        assert list(meta.keys) == [f"k{i}" for i in idx]
        assert [t["i"] for t in meta.tags] == idx
        assert batch.get("s").tolist() == [f"s{i}" for i in idx]
        assert [int(r[0]) for r in batch["r"].unbind()] == idx
        for mb in loader.minibatches(batch, num_minibatches=2, shuffle=True):
            assert list(tq.batch_meta(mb).keys) == [f"k{i}" for i in mb["obs", "state"].tolist()]
        with pytest.raises(tq.errors.ConfigError, match="tq.select_rows"):
            tq.batch_meta(batch[:2])
        seen += idx
    assert sorted(seen) == list(range(24))


def test_spawn_workers_are_flagged(local_stream):
    ds = tq.StreamingDataset(local_stream, "flag", "t", ["x"], batch_size=4)
    with pytest.warns(SpawnStartWarning, match="forkserver"):
        tq.StreamingDataLoader(ds, num_workers=2, multiprocessing_context="spawn")


def test_length_over_rpc_and_declared_epochs_with_workers(local_stream):
    part = "epochs"
    local_stream.writer(part).put([f"e{i}" for i in range(40)], {"x": torch.arange(40)})
    ds = tq.StreamingDataset(local_stream, part, "t", ["x"], batch_size=4, timeout=60,
                             rows_per_epoch=16)
    loader = tq.StreamingDataLoader(ds, num_workers=2, multiprocessing_context="fork")
    assert len(loader) == 4
    epochs = [[k for b in loader for k in tq.batch_meta(b).keys] for _ in range(2)]
    assert [len(e) for e in epochs] == [16, 16]  # each pass ends after its 4 steps
    assert sorted(epochs[0] + epochs[1]) == sorted(f"e{i}" for i in range(32))
    closed = "closed_len"
    local_stream.writer(closed).put([f"c{i}" for i in range(10)], {"x": torch.arange(10)})
    reader = tq.StreamingDataLoader(tq.StreamingDataset(local_stream, closed, "t", ["x"], 4))
    with pytest.raises(TypeError, match="must be closed"):
        len(reader)
    local_stream.close_partition(closed)
    assert len(reader) == 3 and sum(1 for _ in reader) == 3
