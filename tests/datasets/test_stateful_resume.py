"""A StatefulDataLoader (torchdata) or a StreamingDataLoader resumed from the state of
one whose iteration never ended its session: a DataLoader worker that torch killed
(SIGTERM after a 5 s join) or that hung, a trainer that crashed. Its claims stay live
until its lease expires (``lease_timeout``, 300 s by default): the resumed loader
waited ``timeout`` for its first step and failed with ConfigError ("held by another
live session"). The local mode case with workers is
tests/integration/datasets/test_stateful_dataloader.py."""

from __future__ import annotations

import pytest

import tq_stream as tq
from tests.conftest import keys_of, put_rows
from tq_stream.errors import ConfigError, LeaseTakenOver

torchdata = pytest.importorskip("torchdata.stateful_dataloader")


def _loader(stream: tq.Stream) -> object:
    ds = tq.StreamingDataset(stream, "train", "t", ["x"], batch_size=2, timeout=2.0)
    return torchdata.StatefulDataLoader(ds, batch_size=None, num_workers=0,
                                        collate_fn=lambda batch: batch)


def _streaming_loader(stream: tq.Stream) -> tq.StreamingDataLoader:
    ds = tq.StreamingDataset(stream, "train", "t", ["x"], batch_size=2, timeout=2.0)
    return tq.StreamingDataLoader(ds, num_workers=0)


@pytest.mark.parametrize("make", [_loader, _streaming_loader], ids=["stateful", "streaming"])
def test_a_resumed_loader_takes_over_from_a_predecessor_that_never_ended(stream, make):
    stream.create_partition("train", consumers=["t"])
    keys = keys_of("k", 12)
    put_rows(stream, keys)
    stream.close_partition("train")
    first = make(stream)
    old = iter(first)  # kept open: its session lives on, as a killed or hung trainer's
    trained = [k for _ in range(2) for k in tq.batch_meta(next(old)).keys]
    state = first.state_dict()
    resumed = make(stream)
    resumed.load_state_dict(state)
    rest = [k for batch in resumed for k in tq.batch_meta(batch).keys]
    assert not set(rest) & set(trained), "a trained batch came again"
    assert sorted(trained + rest) == sorted(keys), "rows were lost"
    assert stream.stats()["train"]["rows"] == 0
    with pytest.raises(LeaseTakenOver):  # the predecessor's late ack is refused
        next(old)


def test_a_streaming_loader_state_without_a_session_still_loads(stream):
    """A state saved before loaders named their session (or after the iteration ended)
    resumes as before; a session that is not a non-empty str is refused by name."""
    stream.create_partition("train", consumers=["t"])
    put_rows(stream, keys_of("k", 4))
    stream.close_partition("train")
    first = _streaming_loader(stream)
    for _ in first:
        break  # the break trains the batch
    state = first.state_dict()
    assert state["session"] is None  # no iteration open
    old_style = {k: v for k, v in state.items() if k != "session"}
    resumed = _streaming_loader(stream)
    resumed.load_state_dict(old_style)
    assert sum(len(tq.batch_meta(b).keys) for b in resumed) == 2
    with pytest.raises(ConfigError, match=r"state\['session'\].*got 7"):
        _streaming_loader(stream).load_state_dict({**state, "session": 7})
