"""torchdata's StatefulDataLoader over a StreamingDataset (the Stateful protocol): a run
broken off, with the loader's state_dict taken, resumed by a new StatefulDataLoader from
that state, delivers every row once it acked, never an acked row again, and no row is
lost: batches the old loader had fetched ahead come again (issue #10 item 4)."""

from __future__ import annotations

import pytest
import torch

import tq_stream as tq
from tests.helpers.tq_fixtures import local_stream

torchdata = pytest.importorskip("torchdata.stateful_dataloader")

__all__ = ["local_stream"]

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _identity(batch):
    return batch


def _loader(stream, part, workers):
    ds = tq.StreamingDataset(stream, part, "t", ["x"], batch_size=2, timeout=30)
    kw = {"multiprocessing_context": "fork"} if workers else {}
    return torchdata.StatefulDataLoader(ds, batch_size=None, num_workers=workers,
                                        collate_fn=_identity, **kw)


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_resumes_without_loss_or_repeats(local_stream, workers):
    part = f"stateful{workers}"
    local_stream.create_partition(part, consumers=["t"])
    keys = [f"s{i}" for i in range(24)]
    local_stream.writer(part).put(keys, {"x": torch.arange(24.0)})
    local_stream.close_partition(part)
    first = _loader(local_stream, part, workers)
    trained = []
    for i, batch in enumerate(first):
        trained += tq.batch_meta(batch).keys
        if i == 3:
            break
    state = first.state_dict()  # after training on 4 batches
    del first  # the old loader (and its workers, with what they fetched ahead) is gone
    resumed = _loader(local_stream, part, workers)
    resumed.load_state_dict(state)
    rest = [k for batch in resumed for k in tq.batch_meta(batch).keys]
    assert not set(rest) & set(trained), "a trained batch came again"
    assert sorted(trained + rest) == sorted(keys), "rows were lost"
    assert local_stream.stats()[part]["rows"] == 0  # every row acked and freed
