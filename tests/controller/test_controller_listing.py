"""Controller.list_tags (keys and tags as columns), keys_of (row index -> key) and
locate (placement and how many rows hold each field, ``KV.locate``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tq_stream.errors import KeyConflictError


def test_list_tags_is_columnar_oldest_first(stream):
    w = stream.writer("p")
    w.put(["a", "b"], {"x": torch.zeros(2, 1)}, tags=[{"n": 1, "s": "x"}, {"s": "y"}])
    w.put(["c"], {"x": torch.zeros(1, 1)}, tags=[{"n": 2.5}])
    stream.kv.clear(["b"], partition="p")
    got = stream.connection.controller().list_tags(partition="p")
    assert got.keys == ["a", "c"]
    cols = {name: (np.asarray(pos).tolist(), values) for name, (pos, values) in got.tags.items()}
    assert cols == {"n": ([0, 1], [1, 2.5]), "s": ([0], ["x"])}
    assert type(cols["n"][1][0]) is int
    with pytest.raises(KeyConflictError, match="partition must exist"):
        stream.connection.controller().list_tags(partition="nope")


def test_keys_of_maps_indexes_of_live_rows(stream):
    stream.writer("p").put(["a", "b", "c"], {"x": torch.zeros(3, 1)})
    idx = stream.kv.meta(["c", "a"], partition="p").index
    assert stream.connection.controller().keys_of(partition="p", index=idx) == ["c", "a"]
    stream.kv.clear(["a"], partition="p")
    with pytest.raises(KeyConflictError, match="index must name live rows"):
        stream.connection.controller().keys_of(partition="p", index=idx)
    with pytest.raises(KeyConflictError, match="index must name live rows"):
        stream.connection.controller().keys_of(partition="p", index=[10_000])


def test_locate_counts_the_rows_holding_each_field(stream):
    w = stream.writer("p")
    w.put(["a", "b"], {"x": torch.zeros(2, 1), "s": ["u", "v"]}, tags=[{"n": 1}, {"n": 2}])
    w.put(["c"], {"x": torch.ones(1, 1)})
    meta, held = stream.kv.locate(["c", "a", "b"], partition="p")
    assert meta.keys == ("c", "a", "b") and meta.fields == () and held == {"x": 3, "s": 2}
    assert set(meta.schemas) == {"x", "s"}
    got = stream.kv.read(meta, ["x"])
    assert got["x"][:, 0].tolist() == [1.0, 0.0, 0.0]
    with pytest.raises(KeyConflictError, match=r"in partition 'p', missing \['z'\]"):
        stream.kv.locate(["a", "z"], partition="p")
