"""Issue 20 item 16 (embedded): after writing ``{"obs": {"image": ..., "state": ...}}``,
reading ``fields=["obs"]`` returns the subtree as a nested TensorDict: in the loader,
Client reads and KV reads; a task reading ``obs`` waits until every field under it is
written. Local mode: tests/integration/api/test_nested_parent_local.py."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from tests.helpers.nested_cases import check_obs, loader_reads_the_subtree, put_obs
from tq_stream.errors import StateError, WaitTimeout


def test_the_loader_reads_a_parent_field(stream):
    assert loader_reads_the_subtree(stream, "p") == list(range(16))


def test_client_reads_a_parent_field(stream):
    put_obs(stream, "p", 4)
    client = stream.client()
    client.register_task("p", "t", ["obs", "r"], 4)
    meta = client.get_meta("p", "t", step=0, timeout=5)
    assert sorted(meta.fields) == ["obs.image", "obs.meta.step", "obs.state", "r"]
    whole = client.get_data(meta)
    assert set(whole.keys()) == {"obs", "r"}
    assert check_obs(client.get_data(meta, ["obs"])) == [0, 1, 2, 3]
    sub = client.get_data(meta, ["obs.meta"])
    assert sub["obs", "meta", "step"].tolist() == [0, 10, 20, 30]


def test_kv_reads_a_parent_field(stream):
    keys = put_obs(stream, "default", 3)
    assert check_obs(stream.kv.get_batch(keys, fields=["obs"])) == [0, 1, 2]
    row = stream.kv.get("k1", fields=["obs", "r"])
    assert set(row) == {"obs", "r"} and isinstance(row["obs"], TensorDict)
    assert row["obs"]["state"].item() == 1 and row["obs"]["meta", "step"].item() == 10
    assert sorted(stream.kv.meta(keys, ["obs"]).fields) == \
        ["obs.image", "obs.meta.step", "obs.state"]


def test_a_parent_is_ready_once_every_field_under_it_is_written(stream):
    w = stream.writer("p")
    w.put(["a", "b"], TensorDict({"obs": TensorDict({"image": torch.zeros(2, 2)}, [2])}, [2]))
    w.put(["a", "b"], TensorDict({"obs": TensorDict({"state": torch.arange(2)}, [2])}, [2]))
    client = stream.client()
    client.register_task("p", "t", ["obs"], 2)
    meta = client.get_meta("p", "t", step=0, timeout=5)
    assert client.get_data(meta)["obs", "state"].tolist() == [0, 1]
    # "c" has only one of the two fields under "obs": not ready, not readable
    w.put(["c"], TensorDict({"obs": TensorDict({"image": torch.zeros(1, 2)}, [1])}, [1]))
    client.register_task("p", "u", ["obs"], 3)
    with pytest.raises(WaitTimeout):
        client.get_meta("p", "u", step=0, timeout=0.3)
    with pytest.raises(StateError, match="'obs.state' must be written.*'c'"):
        stream.kv.get_batch(["a", "c"], fields=["obs"], partition="p")


def test_a_name_that_is_no_field_nor_parent_still_fails(stream):
    put_obs(stream, "default", 2)
    with pytest.raises(StateError, match="'ob' must be written"):
        stream.kv.get_batch(["k0"], fields=["ob"])
