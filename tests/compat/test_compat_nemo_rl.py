"""NeMo-RL's data-plane calls (tests/helpers/nemo_rl_calls.py) on tq_stream.compat, embedded
mode, plus the mixed-type fields verl's async trainer modes write (issue 21)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import NonTensorStack, TensorDict

import tq_stream.compat
from tests.helpers.compat_helpers import installed_module
from tests.helpers.nemo_rl_calls import DataPlane, densify, driver_conf, patch_actor_options
from tq_stream.errors import ConfigError, SchemaError, StateError, WaitTimeout

pytest.importorskip("omegaconf")

EMBEDDED = {"tq_stream": {"mode": "embedded"}}


@pytest.fixture
def tq():
    with installed_module() as module:
        yield module


@pytest.fixture
def dp(tq):
    plane = DataPlane(tq, driver_conf(extra=EMBEDDED))
    return plane


def objects(n: int) -> np.ndarray:
    arr = np.empty(n, dtype=object)
    for i in range(n):
        arr[i] = {"id": i, "text": f"sample {i} " * (i % 3 + 1), "tags": [f"t{i}", f"t{i + 1}"]}
    return arr


# ------------------------------------------------------------------ bootstrap
def test_default_config_is_a_package_resource_and_init_takes_the_merged_conf(tq):
    conf = driver_conf(capacity=3, units=2, extra=EMBEDDED)
    assert conf.controller.polling_mode is True
    merged = tq.init(conf=conf)
    assert merged["controller"]["polling_mode"] is True
    stream = tq_stream.compat.stream()
    tq.kv_batch_put(keys=["a", "b", "c"], partition_id="p",
                    fields=TensorDict({"x": torch.arange(3)}, batch_size=[3]))
    assert stream.stats()["p"]["capacity"] == 3  # total_storage_size honoured
    assert len(stream.deployment_stats()["units"]) == 2  # num_data_storage_units


def test_actor_classes_are_importable_and_their_options_patchable(tq):
    assert patch_actor_options({"pip": ["transferqueue==0.1.11"]}) == []
    from transfer_queue.controller import TransferQueueController
    from transfer_queue.storage.simple_storage import SimpleStorageUnit

    opts = SimpleStorageUnit.options(num_cpus=1)
    assert opts.kwargs["runtime_env"] == {"pip": ["transferqueue==0.1.11"]}
    with pytest.raises(StateError, match="transfer_queue.init"):
        TransferQueueController.options().remote()


def test_an_unknown_sampler_is_refused_loudly(tq):
    with pytest.raises(ConfigError, match="controller.sampler"):
        tq.init(conf=driver_conf(extra={**EMBEDDED, "controller": {"sampler": "GRPOGroupN"}}))


# --------------------------------------------------------- NeMo-RL's lifecycle
def test_smoke_round_trip_after_the_warm_up_row(dp):
    dp.register_partition("smoke", ["x"])
    keys = ["a", "b", "c", "d"]
    dp.put_samples(keys, "smoke", TensorDict({"x": torch.arange(4)}, batch_size=[4]))
    got, tags = dp.claim_meta("smoke", "read", ["x"], batch_size=4)
    assert sorted(got) == keys and tags == [{}] * 4
    data = dp.get_samples(got, "smoke", ["x"])
    assert data["x"].dtype == torch.int64
    assert torch.equal(data["x"], torch.tensor([keys.index(k) for k in got]))
    assert dp.consumed("smoke", ["read"])
    dp.clear_all("smoke")
    assert dp.tq.kv_list(partition_id="smoke") == {"smoke": {}}


def test_two_d_rows_and_one_d_rows_after_the_warm_up(dp):
    dp.register_partition("smoke-2d", ["x", "total_reward"])
    keys = ["a", "b", "c", "d"]
    values = torch.arange(12).reshape(4, 3)
    reward = torch.arange(4, dtype=torch.float32)
    dp.put_samples(keys, "smoke-2d",
                   TensorDict({"x": values, "total_reward": reward}, batch_size=[4]))
    got, _ = dp.claim_meta("smoke-2d", "read", ["x", "total_reward"], batch_size=4)
    data = dp.get_samples(got, "smoke-2d", ["x", "total_reward"])
    x = densify(data["x"])
    assert not x.is_nested and torch.equal(x, torch.stack([values[keys.index(k)] for k in got]))
    assert data["total_reward"].shape == (4,)


def test_object_arrays_of_dicts_round_trip(dp):
    dp.register_partition("obj", ["msg_log"])
    keys = [f"obj_{i}" for i in range(8)]
    dp.put_samples(keys, "obj", TensorDict({"msg_log": objects(8)}, batch_size=[8]))
    data = dp.get_samples(keys, "obj", ["msg_log"])
    assert isinstance(data.get("msg_log"), NonTensorStack)
    assert data["msg_log"].tolist() == list(objects(8))


def test_tensor_and_object_fields_mixed_with_ragged_rows(dp):
    fields = ["input_ids", "input_lengths", "generation_logprobs", "token_mask", "sample_mask"]
    dp.register_partition("mix", fields)
    n, lengths = 6, [4, 2, 3, 4, 1, 2]
    ids = [torch.arange(k, dtype=torch.long) + 10 * i for i, k in enumerate(lengths)]
    batch = TensorDict({
        "input_ids": torch.nested.as_nested_tensor(ids, layout=torch.jagged),
        "input_lengths": torch.tensor(lengths),
        "generation_logprobs": torch.zeros(n, 4),
        "token_mask": torch.ones(n, 4),
        "sample_mask": torch.ones(n),
        "content": objects(n),
    }, batch_size=[n])
    keys = [f"s{i}" for i in range(n)]
    dp.put_samples(keys, "mix", batch, tags=[{"input_lengths": k} for k in lengths])
    got, tags = dp.claim_meta("mix", "train", ["input_ids", "sample_mask"], batch_size=n)
    assert got == keys and [t["input_lengths"] for t in tags] == lengths
    data = dp.get_samples(keys, "mix", ["input_ids", "input_lengths", "content"])
    assert [r.tolist() for r in data["input_ids"].unbind()] == [r.tolist() for r in ids]
    assert data["input_ids"].dtype == torch.int64
    assert torch.equal(data["input_lengths"], torch.tensor(lengths))
    assert data["content"].tolist() == list(objects(n))
    only = dp.get_samples(keys, "mix", ["content"])
    assert list(only.keys()) == ["content"]


def test_shards_put_and_read_back_byte_exact(dp):
    names = ["input_ids", "input_lengths", "advantages", "sample_mask"]
    dp.register_partition("seqpack", names)
    g = torch.Generator().manual_seed(0)
    for r in range(4):
        n, width = 5, 16 + 8 * r
        shard = {"input_ids": torch.randint(1, 500, (n, width), generator=g),
                 "input_lengths": torch.randint(1, width, (n,), generator=g),
                 "advantages": torch.randn(n, width, generator=g),
                 "sample_mask": torch.ones(n)}
        keys = [f"r{r}_s{i}" for i in range(n)]
        dp.put_samples(keys, "seqpack", TensorDict(shard, batch_size=[n]))
        back = dp.get_samples(keys, "seqpack", names)
        for f in names:
            v = densify(back[f])
            assert v.dtype == shard[f].dtype and torch.equal(v, shard[f]), (r, f)


# ------------------------------------------------------------------ get_meta
def test_get_meta_polls_empty_then_hands_each_row_once(dp):
    client = dp.tq.get_client()
    dp.register_partition("poll", ["x"])
    empty = client.get_meta(data_fields=["x"], batch_size=2, partition_id="poll",
                            task_name="t", mode="fetch", sampling_config={"dp_rank": 0})
    assert empty.size == 0
    assert not client.check_consumption_status(task_name="t", partition_id="poll")
    dp.put_samples(["a"], "poll", TensorDict({"x": torch.tensor([7])}, batch_size=[1]))
    assert dp.claim_meta("poll", "t", ["x"], 2, blocking=False) == ([], [])
    dp.put_samples(["b", "c"], "poll", TensorDict({"x": torch.tensor([8, 9])}, batch_size=[2]))
    assert dp.claim_meta("poll", "t", ["x"], 2, dp_rank=0)[0] == ["a", "b"]
    assert not dp.consumed("poll", ["t"])
    assert dp.claim_meta("poll", "t", ["x"], 2, blocking=False) == ([], [])
    dp.put_samples(["d"], "poll", TensorDict({"x": torch.tensor([1])}, batch_size=[1]))
    assert dp.claim_meta("poll", "t", ["x"], 2)[0] == ["c", "d"]
    assert dp.consumed("poll", ["t"])
    assert not dp.consumed("poll", ["other"])  # another task consumed nothing
    assert dp.claim_meta("poll", "other", ["x"], 4)[0] == ["a", "b", "c", "d"]


def test_get_meta_without_polling_waits_and_times_out(tq):
    tq.init(conf=driver_conf(extra={"controller": {"polling_mode": False},
                                    "tq_stream": {"mode": "embedded", "timeout": 0.5}}))
    tq.kv_batch_put(keys=["a"], partition_id="w",
                    fields=TensorDict({"x": torch.tensor([1])}, batch_size=[1]))
    client = tq.get_client()
    with pytest.raises(WaitTimeout):
        client.get_meta(data_fields=["x"], batch_size=2, partition_id="w", task_name="t")
    meta = client.get_meta(data_fields=["x"], batch_size=1, partition_id="w", task_name="u")
    assert client.kv_retrieve_keys(global_indexes=meta.global_indexes, partition_id="w") == ["a"]


def test_get_meta_refuses_other_fields_for_the_same_task(dp):
    client = dp.tq.get_client()
    dp.put_samples(["a"], "f", TensorDict({"x": torch.tensor([1]), "y": torch.tensor([2])},
                                          batch_size=[1]))
    client.get_meta(data_fields=["x"], batch_size=1, partition_id="f", task_name="t")
    with pytest.raises(ConfigError, match="data_fields"):
        client.get_meta(data_fields=["x", "y"], batch_size=1, partition_id="f", task_name="t")


def test_get_meta_refuses_a_mode_it_does_not_implement(dp):
    with pytest.raises(ConfigError, match="mode"):
        dp.tq.get_client().get_meta(data_fields=["x"], batch_size=1, partition_id="f",
                                    task_name="t", mode="insert")


# ------------------------------------------------ TransferQueue's data model
def test_a_field_written_as_tensor_and_as_python_values_reads_back_as_written(tq):
    """verl's async modes: the trainer puts ``index`` as int64, the agent loop as ints."""
    tq.init(EMBEDDED)
    tq.kv_batch_put(keys=["p0", "p1"], partition_id="train",
                    fields=TensorDict({"index": torch.tensor([5, 6])}, batch_size=[2]))
    tq.kv_batch_put(keys=["t0", "t1"], partition_id="train",
                    fields=TensorDict({"index": NonTensorStack(7, 8)}, batch_size=[2]))
    prompts = tq.kv_batch_get(keys=["p0", "p1"], partition_id="train", select_fields="index")
    assert prompts["index"].dtype == torch.int64 and prompts["index"].tolist() == [5, 6]
    trajs = tq.kv_batch_get(keys=["t0", "t1"], partition_id="train")
    assert trajs["index"].tolist() == [7, 8]
    assert [type(v) for v in trajs["index"].tolist()] == [int, int]
    mixed = tq.kv_batch_get(keys=["t1", "p0"], partition_id="train", select_fields=["index"])
    values = mixed["index"].tolist()
    assert values[0] == 8 and type(values[0]) is int
    assert isinstance(values[1], torch.Tensor) and values[1].item() == 5
    assert list(tq.kv_batch_get(keys=["t1", "p0"], partition_id="train").keys()) == ["index"]
    meta = tq.kv_batch_put(keys=["t0"], partition_id="train", tags=[{"status": "x"}])
    assert meta.fields == ["index"]
    assert tq.kv_list("train")["train"]["t0"] == {"status": "x"}


def test_a_row_rewritten_with_another_type_is_refused_at_the_put(tq):
    """No stored name would say which write is the last: refused, the row unchanged."""
    tq.init(EMBEDDED)
    tq.kv_batch_put(keys=["a", "b"], partition_id="p",
                    fields=TensorDict({"x": torch.tensor([1, 2])}, batch_size=[2]))
    with pytest.raises(SchemaError, match=r"field 'x' of key 'b'.*kv_clear"):
        tq.kv_batch_put(keys=["c", "b"], partition_id="p",
                        fields=TensorDict({"x": NonTensorStack("s", "t")}, batch_size=[2]))
    assert tq.kv_batch_get(keys=["b"], partition_id="p")["x"].tolist() == [2]
    assert list(tq.kv_list("p")["p"]) == ["a", "b"]  # nothing of the refused put stored


def test_multi_modal_inputs_dicts_of_tensors_round_trip(tq):
    tq.init(EMBEDDED)
    rows = [{"pixel_values": torch.randn(4, 3), "image_grid_thw": torch.tensor([[1, 2, 2]])},
            {}, {"pixel_values": torch.randn(2, 3, dtype=torch.bfloat16)}]
    tq.kv_batch_put(keys=["a", "b", "c"], partition_id="vlm",
                    fields=TensorDict({"multi_modal_inputs": NonTensorStack(*rows),
                                       "input_ids": torch.ones(3, 2, dtype=torch.long)},
                                      batch_size=[3]))
    back = tq.kv_batch_get(keys=["c", "a", "b"], partition_id="vlm")
    got = back["multi_modal_inputs"].tolist()
    assert got[2] == {}
    assert torch.equal(got[0]["pixel_values"], rows[2]["pixel_values"])
    assert got[0]["pixel_values"].dtype == torch.bfloat16
    assert torch.equal(got[1]["image_grid_thw"], rows[0]["image_grid_thw"])


def test_a_field_with_no_live_rows_takes_a_new_type(tq):
    tq.init(EMBEDDED)
    td = TensorDict({"x": torch.zeros(1)}, batch_size=[1])
    tq.kv_batch_put(keys=["w"], partition_id="p", fields=td)
    tq.kv_clear(keys=["w"], partition_id="p")
    tq.kv_batch_put(keys=["a", "b"], partition_id="p",
                    fields=TensorDict({"x": torch.tensor([[1, 2], [3, 4]])}, batch_size=[2]))
    x = tq.kv_batch_get(keys=["a", "b"], partition_id="p")["x"]
    assert x.dtype == torch.int64 and [r.tolist() for r in x.unbind()] == [[1, 2], [3, 4]]
