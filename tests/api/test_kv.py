"""The KV facade: put/get/get_batch/list/clear."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import keys_of, put_rows
from tq_stream.errors import ConfigError, KeyConflictError, StateError


def test_put_get_one_row(stream):
    stream.kv.put("t1", {"prompt": "hi", "reward": torch.tensor(1.5), "ids": torch.arange(3)},
                  tag={"v": 3})
    got = stream.kv.get("t1")
    assert got["prompt"] == "hi" and got["reward"].item() == 1.5
    assert got["ids"].tolist() == [0, 1, 2]
    assert stream.kv.get("t1", fields=["reward"]).keys() == {"reward"}
    stream.kv.put("t2", {"ids": torch.arange(5), "prompt": "yo", "reward": torch.tensor(0.0)})
    assert stream.kv.get("t2")["ids"].tolist() == [0, 1, 2, 3, 4]  # another length: ragged


def test_put_batch_get_batch_order_and_ragged(stream):
    keys = keys_of("k", 4)
    stream.kv.put_batch(keys, {"x": torch.arange(8.0).reshape(4, 2),
                               "r": [torch.ones(i + 1) for i in range(4)]},
                        tags=[{"i": i} for i in range(4)])
    td = stream.kv.get_batch(["k3", "k0"])
    assert td.batch_size == (2,) and td["x"].tolist() == [[6, 7], [0, 1]]
    assert [t.shape[0] for t in td["r"].unbind()] == [4, 1]
    padded = stream.kv.get_batch(["k1", "k2"], fields=["r"], ragged="padded")
    assert padded["r"].shape == (2, 3) and padded["r"][0].tolist() == [1, 1, 0]


def test_fields_none_means_every_common_field(stream):
    put_rows(stream, ["a", "b"], partition="default")
    stream.kv.put_batch(["a"], {"extra": torch.ones(1)})
    assert set(stream.kv.get_batch(["a", "b"]).keys()) == {"x"}
    assert set(stream.kv.get_batch(["a"]).keys()) == {"x", "extra"}
    with pytest.raises(StateError, match="'extra' must be written.*'b'"):
        stream.kv.get_batch(["a", "b"], fields=["extra"])


def test_missing_keys(stream):
    put_rows(stream, ["a"], partition="default")
    with pytest.raises(KeyConflictError, match=r"missing \['zz'\]"):
        stream.kv.get_batch(["a", "zz"])
    with pytest.raises(KeyConflictError, match="zz"):
        stream.kv.get("zz")
    with pytest.raises(ConfigError, match="key must be a str"):
        stream.kv.get(["a"])


def test_list_is_oldest_first_and_stable(stream):
    keys = keys_of("k", 3)
    put_rows(stream, keys, partition="default", tags=[{"i": i} for i in range(3)])
    stream.kv.put_batch(["k0"], {"reward": torch.ones(1)})  # a later field: order kept
    listed = stream.kv.list()
    assert [r["key"] for r in listed] == keys
    assert listed[0] == {"key": "k0", "tags": {"i": 0}, "fields": ["x", "reward"]}
    assert listed[1]["fields"] == ["x"]


def test_list_of_keys_gives_their_rows_in_key_order(stream):
    put_rows(stream, keys_of("k", 3), partition="default")
    stream.kv.put_batch(["k2"], {"reward": torch.ones(1)})
    listed = stream.kv.list(keys=["k2", "gone", "k0"])  # a key with no row: left out
    assert [(r["key"], r["fields"]) for r in listed] == [("k2", ["x", "reward"]),
                                                        ("k0", ["x"])]
    with pytest.raises(ConfigError, match="keys"):
        stream.kv.list(keys="k0")


def test_clear(stream):
    put_rows(stream, keys_of("k", 4), partition="default")
    assert stream.kv.clear(["k1", "nope"]) == 1
    assert stream.kv.clear("k2") == 1
    assert [r["key"] for r in stream.kv.list()] == ["k0", "k3"]
    with pytest.raises(KeyConflictError):
        stream.kv.get("k1")
    assert stream.kv.clear() == 2
    assert stream.kv.list() == []
    assert sum(u.nbytes() for u in stream.connection.units()) == 0
    put_rows(stream, ["k1"], partition="default")  # a cleared key can be written again
    assert stream.kv.get("k1")["x"].shape == (4,)


def test_partitions_are_separate(stream):
    stream.kv.put("a", {"v": torch.tensor(1)}, partition="p1")
    stream.kv.put("a", {"v": torch.tensor(2)}, partition="p2")
    assert stream.kv.get("a", partition="p1")["v"].item() == 1
    assert stream.kv.get("a", partition="p2")["v"].item() == 2
    stream.kv.clear(partition="p1")
    assert stream.kv.get("a", partition="p2")["v"].item() == 2


def test_set_tags_merges_into_existing_rows(stream):
    stream.kv.put("a", {"x": torch.ones(2)}, tag={"uid": "g", "version": 1})
    stream.set_tags("default", ["a"], [{"reward": 0.5}])
    (row,) = stream.kv.list()
    assert row["tags"] == {"uid": "g", "version": 1, "reward": 0.5}
    with pytest.raises(KeyConflictError, match="missing"):
        stream.set_tags("default", ["nope"], [{"reward": 1.0}])


def test_a_str_where_a_list_of_keys_or_fields_goes_is_refused_naming_the_argument(stream):
    """A README-only user: ``put_batch("xy", ...)`` made rows 'x' and 'y', and
    ``get(key, fields="reward")`` asked for field 'r' (a str read as its characters)."""
    import torch

    from tq_stream.errors import ConfigError

    stream.kv.put("k", {"reward": torch.tensor(1.0)})
    with pytest.raises(ConfigError, match="keys must be a list of str, got str"):
        stream.kv.put_batch("xy", {"reward": torch.zeros(2)})
    assert [r["key"] for r in stream.kv.list()] == ["k"]  # nothing else was made
    with pytest.raises(ConfigError, match=r"fields must be a list of str \(one name: "
                                          r"\['reward'\]\), got str 'reward'"):
        stream.kv.get("k", fields="reward")
    with pytest.raises(ConfigError, match="fields must be a list of str"):
        stream.kv.get_batch(["k"], fields="reward")
    assert stream.kv.get("k", fields=["reward"])["reward"].item() == 1.0
