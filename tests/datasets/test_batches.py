"""Batch conventions: keys are the requested fields only; metadata follows rows through
tq.select_rows / tq.split_rows and is refused when it cannot describe the rows."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
from tensordict import TensorDict

import tq_stream as tq
from tests.conftest import nested, ragged_rows
from tq_stream.datasets.batch import attach_meta
from tq_stream.datasets.workers import SpawnStartWarning, check_start_method, start_method
from tq_stream.errors import ConfigError

P = "train"


def one_batch(stream, fields=("x", "r", "s"), n=6) -> TensorDict:
    keys = [f"k{i}" for i in range(n)]
    stream.writer(P).put(keys, {"x": torch.arange(float(n)), "r": nested(ragged_rows(n)),
                                "s": [f"s{i}" for i in range(n)]},
                         tags=[{"i": i} for i in range(n)])
    ds = tq.StreamingDataset(stream, P, "t", list(fields), batch_size=n)
    return next(iter(tq.StreamingDataLoader(ds)))


def test_keys_are_the_requested_fields_only(stream):
    batch = one_batch(stream)
    assert sorted(batch.keys()) == ["r", "s", "x"]  # no _meta / _step entries

    def model(x, r, s):
        return x.sum() + r.values().sum() + len(s)

    assert model(**batch) > 0
    assert tq.batch_meta(batch).keys == tuple(f"k{i}" for i in range(6))


def test_select_rows_and_split_rows_keep_meta_with_the_rows(stream):
    batch = one_batch(stream)
    rows = ragged_rows(6)
    for part in [tq.select_rows(batch, [4, 1]), tq.select_rows(batch, torch.tensor([-1])),
                 tq.select_rows(batch, torch.arange(6) % 2 == 0), *tq.split_rows(batch, 4),
                 *tq.split_rows(batch, [1, 0, 5])]:
        meta = tq.batch_meta(part)
        assert len(meta) == len(part)
        for pos, key in enumerate(meta.keys):
            i = int(key[1:])
            assert part["x"][pos].item() == i and meta.tags[pos] == {"i": i}
            assert torch.equal(part["r"].unbind()[pos], rows[i])
            assert part.get("s").tolist()[pos] == f"s{i}"
    assert [len(p) for p in tq.split_rows(batch, 4)] == [4, 2]


@pytest.mark.parametrize("op", [lambda b: b[:2], lambda b: b.split(2)[0], lambda b: b.clone(),
                                lambda b: b.to("cpu")])
def test_tensordict_ops_that_drop_meta_point_at_select_rows(stream, op):
    batch = one_batch(stream, fields=("x",))
    derived = op(batch)
    if derived is batch:  # .to() of a batch already there returns itself: meta still valid
        assert len(tq.batch_meta(derived)) == 6
        return
    with pytest.raises(ConfigError, match="tq.select_rows"):
        tq.batch_meta(derived)


def test_meta_for_other_rows_is_detected(stream):
    batch = one_batch(stream, fields=("x",))
    smaller = batch[:2]
    smaller.__dict__.update(batch.__dict__)  # what a copy of the attributes would do
    smaller.__dict__["_batch_size"] = torch.Size([2])
    with pytest.raises(ConfigError, match="describes 6 rows but the batch holds 2"):
        tq.batch_meta(smaller)
    with pytest.raises(ConfigError, match="must describe the batch's 2 rows, got 6"):
        attach_meta(TensorDict({}, [2]), tq.batch_meta(batch))


@pytest.mark.parametrize("args, words", [
    ([[6]], r"positions must be in \[0, 6\)"),
    ([torch.ones(3, dtype=torch.bool)], "a mask must have 6 entries"),
])
def test_select_rows_bad_positions(stream, args, words):
    with pytest.raises(ConfigError, match=words):
        tq.select_rows(one_batch(stream, fields=("x",)), *args)


@pytest.mark.parametrize("size", [0, [2, 2], [7, -1]])
def test_split_rows_bad_sizes(stream, size):
    with pytest.raises(ConfigError, match="split_size"):
        tq.split_rows(one_batch(stream, fields=("x",)), size)


def test_meta_survives_pickling(stream):
    batch = one_batch(stream)
    back = pickle.loads(pickle.dumps(batch))
    assert tq.batch_meta(back).keys == tq.batch_meta(batch).keys
    assert sorted(back.keys()) == ["r", "s", "x"]


def test_nested_fields_through_the_loader_and_minibatches(stream):
    n = 4
    td = TensorDict({"obs": TensorDict({"image": torch.arange(n * 4.0).reshape(n, 2, 2),
                                        "state": torch.arange(n)}, [n]),
                     "a": torch.zeros(n)}, [n])
    stream.writer(P).put([f"k{i}" for i in range(n)], td)
    ds = tq.StreamingDataset(stream, P, "t", ["obs.image", "obs.state", "a"], batch_size=n)
    loader = tq.StreamingDataLoader(ds)
    batch = next(iter(loader))
    assert sorted(batch.keys()) == ["a", "obs"]
    assert sorted(batch["obs"].keys()) == ["image", "state"]
    for mb in loader.minibatches(batch, minibatch_size=3, shuffle=True):
        meta = tq.batch_meta(mb)
        assert [f"k{i}" for i in mb["obs", "state"].tolist()] == list(meta.keys)
        assert torch.equal(mb["obs", "image"], td["obs", "image"][mb["obs", "state"]])


def test_nested_field_colliding_with_a_stored_field_is_refused(stream):
    w = stream.writer(P)
    w.put(["a"], {"obs": torch.ones(1, 2)})
    with pytest.raises(tq.errors.SchemaError, match="'obs.image' collides with field 'obs'"):
        w.put(["b"], {"obs": {"image": torch.ones(1, 2)}})
    assert [r["key"] for r in stream.kv.list(partition=P)] == ["a"]  # nothing stored


def test_start_method_is_read_without_fixing_it():
    import multiprocessing as mp

    assert start_method("fork") == "fork"
    assert start_method(mp.get_context("spawn")) == "spawn"
    with pytest.warns(SpawnStartWarning, match="multiprocessing_context='fork'"):
        check_start_method("spawn")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_start_method("fork")
    with pytest.raises(ConfigError, match="multiprocessing_context must be one of"):
        start_method("thread")
