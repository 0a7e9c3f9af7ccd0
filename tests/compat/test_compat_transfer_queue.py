"""tq_stream.compat.transfer_queue driven the way verl 0.9.1's v1 trainer, its rollout
workers and its ReplayBuffer drive TransferQueue (embedded mode)."""

from __future__ import annotations

import asyncio
import sys
import threading

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

import tq_stream.compat
from tests.helpers.compat_helpers import (
    EMBEDDED,
    VERL_CONF,
    assert_rows_equal,
    dashboard_metrics,
    list_of_dict_to_tensordict,
    new_uid,
    prompt_tags,
    scrape_metric_names,
    trajectory,
)
from tq_stream.errors import ConfigError, KeyConflictError, StateError


@pytest.fixture
def tq():
    """``import transfer_queue as tq`` after install(), initialised as verl's driver does."""
    tq_stream.compat.install()
    import transfer_queue

    transfer_queue.init(VERL_CONF)
    try:
        yield transfer_queue
    finally:
        transfer_queue.close()
        tq_stream.compat.uninstall()


def run_worker(coro_fn, *args):
    """Run ``coro_fn(*args)`` on an event loop of a thread tq_stream does not own."""
    out: dict = {}

    def main() -> None:
        out["value"] = asyncio.run(coro_fn(*args))

    t = threading.Thread(target=main)
    t.start()
    t.join(timeout=30)
    assert not t.is_alive()
    return out.get("value")


async def rollout(tq, uid: str, partition: str, step: int, n: int, seed: int) -> list[dict]:
    """AgentLoopWorkerTQ._run_prompt: status running, n sessions put, then finished."""
    await tq.async_kv_put(key=uid, partition_id=partition, tag={"status": "running"})
    rows = []
    for session in range(n):
        fields, tag = trajectory(uid, session, step, seed + session)
        await tq.async_kv_batch_put(keys=[f"{uid}_{session}_0"], partition_id=partition,
                                    fields=list_of_dict_to_tensordict([fields]), tags=[tag])
        rows.append(fields)
    await tq.async_kv_put(key=uid, partition_id=partition, tag={"status": "finished"})
    return rows


def test_install_registers_the_module():
    tq_stream.compat.install()
    try:
        import transfer_queue as tq
        from transfer_queue import BatchMeta, KVBatchMeta

        assert tq is sys.modules["transfer_queue"] is tq_stream.compat.transfer_queue
        assert KVBatchMeta is tq.KVBatchMeta and BatchMeta is tq.BatchMeta
    finally:
        tq_stream.compat.uninstall()
    assert "transfer_queue" not in sys.modules or \
        sys.modules["transfer_queue"] is not tq_stream.compat.transfer_queue


def test_init_returns_merged_conf_and_attaches(tq):
    again = tq.init()  # verl's workers and bridge call init() again: attach, no new deployment
    assert again["backend"]["SimpleStorage"]["num_data_storage_units"] == 2
    assert tq.get_metrics_endpoint() is None
    tq.kv_batch_put(keys=["k"], partition_id="train", tags=[{"a": 1}])
    assert tq.kv_list() == {"train": {"k": {"a": 1}}}


def test_prompts_tag_only_then_status_from_an_async_worker(tq):
    uids = [new_uid() for _ in range(3)]
    meta = tq.kv_batch_put(keys=uids, partition_id="train", tags=prompt_tags(3, step=4))
    assert meta.keys == uids and meta.fields == [] and meta.partition_id == "train"
    assert meta.tags == prompt_tags(3, step=4)
    assert tq.kv_list("train") == {"train": dict(zip(uids, prompt_tags(3, 4), strict=True))}
    with pytest.raises(StateError, match="tags only"):
        tq.kv_batch_get(keys=uids, partition_id="train")

    async def worker() -> None:
        await tq.async_kv_put(key=uids[0], partition_id="train", tag={"status": "running"})
        await tq.async_kv_put(key=uids[1], partition_id="train", tag={"status": "failure"})

    run_worker(worker)
    listed = tq.kv_list()["train"]
    assert list(listed) == uids  # oldest first, as registered
    assert listed[uids[0]] == {"is_prompt": True, "status": "running", "global_steps": 4}
    assert listed[uids[1]]["status"] == "failure" and listed[uids[2]]["status"] == "pending"
    assert type(listed[uids[0]]["global_steps"]) is int


def test_trajectories_groups_writebacks_and_clear(tq):
    step, n = 2, 4
    uids = [new_uid() for _ in range(3)]
    tq.kv_batch_put(keys=uids, partition_id="train", tags=prompt_tags(3, step))
    rows = {u: run_worker(rollout, tq, u, "train", step, n, 10 * i) for i, u in enumerate(uids)}

    # ReplayBuffer: one kv_list, finished prompts, their trajectories in kv_list order
    listed = tq.kv_list()["train"]
    finished = [k for k, t in listed.items() if t.get("is_prompt") and t["status"] == "finished"]
    assert finished == uids
    chosen = uids[:2]
    tq.kv_clear(partition_id="train", keys=chosen)  # _materialize_batch clears the prompts
    keys = [k for k in listed if k.split("_")[0] in chosen and not listed[k].get("is_prompt")]
    assert keys == [f"{u}_{s}_0" for u in chosen for s in range(n)]
    batch = tq.KVBatchMeta(partition_id="train", keys=keys, tags=[listed[k] for k in keys])
    assert [t["min_global_steps"] for t in batch.tags] == [step] * len(keys)

    # the trainer reads the rows in batch order, then in a shuffled order
    want = [rows[u][s] for u in chosen for s in range(n)]
    assert_rows_equal(tq.kv_batch_get(keys=batch.keys, partition_id="train"), want)
    order = [5, 0, 7, 2, 1, 6, 3, 4]
    batch.reorder(order)
    assert_rows_equal(tq.kv_batch_get(keys=batch.keys, partition_id="train"),
                      [want[i] for i in order])
    one = tq.kv_batch_get(keys=[batch.keys[0]], partition_id="train")[0]
    assert torch.equal(one["input_ids"], want[order[0]]["input_ids"])
    scores = tq.kv_batch_get(keys=batch.keys, partition_id="train", select_fields=["rm_scores"])
    assert list(scores.keys()) == ["rm_scores"]
    assert [float(v.sum()) for v in list(scores["rm_scores"])] == \
        [float(want[i]["rm_scores"].sum()) for i in order]

    # write-backs: jagged per-row results; the returned meta is reused as the batch
    lengths = [want[i]["responses"].shape[0] for i in order]
    old = [torch.randn(L) for L in lengths]
    adv = [torch.randn(L) for L in lengths]
    for name, values in (("old_log_probs", old), ("ref_log_prob", old), ("advantages", adv)):
        td = TensorDict({name: torch.nested.as_nested_tensor(values, layout=torch.jagged)},
                        batch_size=[len(values)])
        batch = tq.kv_batch_put(keys=batch.keys, partition_id="train", fields=td)
    assert {"old_log_probs", "ref_log_prob", "advantages", "input_ids"} <= set(batch.fields)
    assert batch.tags[0]["min_global_steps"] == step  # the merged tags come back
    back = tq.kv_batch_get(keys=batch.keys, partition_id="train",
                           select_fields=["advantages", "old_log_probs"])
    assert list(back.keys()) == ["advantages", "old_log_probs"]
    for got, exp in zip(back["advantages"].unbind(), adv, strict=True):
        assert torch.equal(got, exp)

    # end of the step: clear the batch (unknown keys are a no-op)
    tq.kv_clear(keys=batch.keys + ["never-put"], partition_id="train")
    left = tq.kv_list("train")["train"]
    assert set(left) == {uids[2]} | {f"{uids[2]}_{s}_0" for s in range(n)}
    tq.kv_clear(keys="x", partition_id="no-such-partition")
    assert tq.kv_list("no-such-partition") == {}


def test_validation_partition_is_separate(tq):
    train, val = new_uid(), new_uid()
    tq.kv_batch_put(keys=[train], partition_id="train", tags=prompt_tags(1, 1))
    tq.kv_batch_put(keys=[val], partition_id="val", tags=prompt_tags(1, 1))
    rows = run_worker(rollout, tq, val, "val", 1, 2, 3)
    listed = tq.kv_list()
    assert set(listed) == {"train", "val"}
    assert list(listed["train"]) == [train]
    assert list(listed["val"]) == [val, f"{val}_0_0", f"{val}_1_0"]
    got = tq.kv_batch_get(keys=[f"{val}_0_0", f"{val}_1_0"], partition_id="val")
    assert_rows_equal(got, rows)
    tq.kv_clear(keys=list(listed["val"]), partition_id="val")
    assert tq.kv_list() == {"train": {train: prompt_tags(1, 1)[0]}, "val": {}}


def test_checkpoint_then_reissue_in_flight_prompts(tq, tmp_path):
    step = 7
    done, running, pending = new_uid(), new_uid(), new_uid()
    uids = [done, running, pending]
    prompt_fields = TensorDict({
        "input_ids": torch.nested.as_nested_tensor([torch.arange(3), torch.arange(5),
                                                    torch.arange(2)], layout=torch.jagged),
        "raw_prompt": NonTensorStack(*[[{"role": "user", "content": u}] for u in uids]),
    }, batch_size=[3])
    tq.kv_batch_put(keys=uids, partition_id="train", tags=prompt_tags(3, step),
                    fields=prompt_fields)
    rows = run_worker(rollout, tq, done, "train", step, 2, 1)
    tq.kv_batch_put(keys=[running], partition_id="train", tags=[{"status": "running"}])
    half, half_tag = trajectory(running, 0, step, 5)
    tq.kv_batch_put(keys=[f"{running}_0_0"], partition_id="train",
                    fields=list_of_dict_to_tensordict([half]), tags=[half_tag])
    before = tq.kv_list()
    ckpt = tmp_path / "global_step_7" / "transfer_queue"
    tq.save_checkpoint(ckpt, metadata={"global_steps": step})
    tq.save_checkpoint(ckpt, metadata={"global_steps": step})  # replaces the previous one
    assert not (tmp_path / "global_step_7" / "transfer_queue.old").exists()
    tq.close()

    tq.init(VERL_CONF)  # a fresh deployment after a restart
    tq.load_checkpoint(ckpt)
    assert tq.kv_list() == before
    assert [type(v) for v in tq.kv_list()["train"][done].values()] == [bool, str, int]
    assert_rows_equal(tq.kv_batch_get(keys=[f"{done}_0_0", f"{done}_1_0"], partition_id="train"),
                      rows)

    # trainer_base._reissue_inflight_prompts
    items = tq.kv_list("train")["train"]
    inflight = [k for k, t in items.items() if t.get("is_prompt") and
                t["status"] in ("pending", "running")]
    assert inflight == [running, pending]
    batch = tq.kv_batch_get(keys=inflight, partition_id="train")
    assert batch["input_ids"].offsets().diff().tolist() == [5, 2]
    assert batch["raw_prompt"].tolist() == [[{"role": "user", "content": u}] for u in inflight]
    old = [k for k, t in items.items() if not t.get("is_prompt") and k.split("_")[0] in inflight]
    assert old == [f"{running}_0_0"]
    tq.kv_clear(keys=old, partition_id="train")
    tq.kv_batch_put(keys=inflight, partition_id="train", tags=prompt_tags(2, step + 1))
    items = tq.kv_list("train")["train"]
    assert [items[k]["status"] for k in inflight] == ["pending", "pending"]
    assert [items[k]["global_steps"] for k in inflight] == [step + 1, step + 1]
    assert f"{running}_0_0" not in items


def test_load_checkpoint_needs_a_fresh_deployment(tq, tmp_path):
    tq.kv_batch_put(keys=["a"], partition_id="train", tags=[{"s": 1}])
    tq.save_checkpoint(tmp_path / "c")
    with pytest.raises(StateError, match="fresh deployment"):
        tq.load_checkpoint(tmp_path / "c")
    with pytest.raises(FileNotFoundError, match="missing"):
        tq.load_checkpoint(tmp_path / "nothing")
    assert tq.kv_list() == {"train": {"a": {"s": 1}}}


def test_bad_input_changes_nothing(tq):
    tq.kv_batch_put(keys=["a"], partition_id="train", tags=[{"s": 1}])
    with pytest.raises(ConfigError, match="fields or tags"):
        tq.kv_batch_put(keys=["b"], partition_id="train")
    with pytest.raises(ConfigError, match="one dict per key"):
        tq.kv_batch_put(keys=["b", "c"], partition_id="train", tags=[{}])
    with pytest.raises(ConfigError, match="one row per key"):
        tq.kv_batch_put(keys=["b", "c"], partition_id="train",
                        fields=TensorDict({"x": torch.ones(3)}, [3]))
    with pytest.raises(ConfigError, match=r"tags\[0\]\['bad'\]"):
        tq.kv_batch_put(keys=["a", "b"], partition_id="train", tags=[{"bad": [1]}, {}])
    with pytest.raises(KeyConflictError, match="missing"):
        tq.kv_batch_get(keys=["a", "zz"], partition_id="train")
    assert tq.kv_list() == {"train": {"a": {"s": 1}}}


def test_config_is_checked():
    from tq_stream.compat import transfer_queue as tq

    with pytest.raises(ConfigError, match="storage_backend"):
        tq.init({"backend": {"storage_backend": "MooncakeStore"}, **EMBEDDED})
    with pytest.raises(ConfigError, match="num_data_storage_units"):
        tq.init({"backend": {"SimpleStorage": {"num_data_storage_units": 0}}, **EMBEDDED})
    with pytest.raises(StateError, match="init"):
        tq.get_client()


def test_total_storage_size_bounds_each_partition():
    from tq_stream.compat import transfer_queue as tq
    from tq_stream.errors import WaitTimeout

    tq.init({"backend": {"SimpleStorage": {"total_storage_size": 2}},
             "tq_stream": {"timeout": 0.2, "mode": "embedded"}})
    try:
        tq.kv_batch_put(keys=["a", "b"], partition_id="train", tags=[{}, {}])
        with pytest.raises(WaitTimeout):
            tq.kv_batch_put(keys=["c"], partition_id="train", tags=[{}])
        tq.kv_clear(keys=["a"], partition_id="train")
        tq.kv_batch_put(keys=["c"], partition_id="train", tags=[{"x": 1}])
        assert list(tq.kv_list("train")["train"]) == ["b", "c"]
    finally:
        tq.close()


def test_client_methods_from_a_foreign_loop(tq):
    """verl's tqbridge: KVBatchMeta -> BatchMeta -> data -> put -> back to keys."""
    uid = new_uid()
    rows = [trajectory(uid, s, 1, s)[0] for s in range(3)]
    keys = [f"{uid}_{s}_0" for s in range(3)]
    kv = tq.kv_batch_put(keys=keys, partition_id="train",
                         fields=list_of_dict_to_tensordict(rows), tags=[{"i": i} for i in range(3)])

    async def bridge():
        c = tq.get_client()
        meta = await c.async_kv_retrieve_meta(keys=kv.keys[::-1], partition_id="train")
        meta = meta.select_fields(["responses", "uid"])
        meta.extra_info = {"temperature": 1.0}
        data = await c.async_get_data(meta)
        parts = meta.chunk(2)
        joined = tq.BatchMeta.concat(parts)
        logp = [torch.randn(r.shape[0]) for r in data["responses"].unbind()]
        out = TensorDict({"old_log_probs": torch.nested.as_nested_tensor(
            logp, layout=torch.jagged)}, batch_size=[3])
        updated = await c.async_put(data=out, metadata=joined)
        keys_back = await c.async_kv_retrieve_keys(global_indexes=updated.global_indexes,
                                                   partition_id="train")
        missing = await c.async_kv_retrieve_meta(keys=["nope"], partition_id="train")
        return meta, data, updated, keys_back, logp, missing

    meta, data, updated, keys_back, logp, missing = run_worker(bridge)
    assert meta.size == 3 and meta.field_names == ["responses", "uid"]
    assert [c["i"] for c in meta.custom_meta] == [2, 1, 0]
    assert data["uid"].tolist() == [uid] * 3
    assert_rows_equal(data.select("responses"), [{"responses": r["responses"]}
                                                 for r in rows[::-1]])
    assert keys_back == keys[::-1]
    assert "old_log_probs" in updated.field_names and missing.size == 0
    got = tq.kv_batch_get(keys=keys[::-1], partition_id="train", select_fields="old_log_probs")
    for a, b in zip(got["old_log_probs"].unbind(), logp, strict=True):
        assert torch.equal(a, b)


def test_kv_put_single_row_and_by_meta(tq):
    meta = tq.kv_put(key="s", partition_id="p", fields={"x": torch.tensor([1, 2, 3]),
                                                          "name": "row"}, tag={"v": 1})
    assert meta.keys == ["s"] and sorted(meta.fields) == ["name", "x"]
    td = tq.kv_batch_get_by_meta(meta)
    assert td["x"].offsets().tolist() == [0, 3] and td["name"].tolist() == ["row"]
    assert list(tq.kv_batch_get_by_meta(meta, select_fields="x").keys()) == ["x"]
    with pytest.raises(ValueError, match="select_fields"):
        tq.kv_batch_get_by_meta(meta, select_fields=["nope"])
    assert asyncio.run(tq.async_kv_list("p")) == {"p": {"s": {"v": 1}}}
    asyncio.run(tq.async_kv_clear(keys="s", partition_id="p"))
    assert tq.kv_list() == {"p": {}}


def test_metrics_endpoint_serves_what_the_dashboard_plots():
    """metrics.enabled serves the native endpoint's metrics (docs/grafana), not a subset."""
    pytest.importorskip("prometheus_client")
    from tq_stream.compat import transfer_queue as tq

    conf = tq.init({"metrics": {"enabled": True, "port": 0}, **EMBEDDED})
    try:
        endpoint = tq.get_metrics_endpoint()
        assert endpoint.startswith("127.0.0.1:") and conf["metrics"]["endpoint"] == endpoint
        tq.kv_batch_put(keys=["a", "b"], partition_id="train",
                        fields=TensorDict({"x": torch.ones(2, 3)}, batch_size=[2]))
        tq.get_client().get_meta(data_fields=["x"], batch_size=1, partition_id="train",
                                 task_name="t")
        names = scrape_metric_names(endpoint)
    finally:
        tq.close()
    rpc = {"tq_stream_rpc_calls_total", "tq_stream_rpc_errors_total"}  # no servers here
    assert dashboard_metrics() - rpc <= names, sorted(dashboard_metrics() - rpc - names)
    assert tq.get_metrics_endpoint() is None


def test_kvbatchmeta_semantics():
    from tq_stream.compat.meta import BatchMeta, KVBatchMeta

    m = KVBatchMeta(keys=["a", "b", "c"], tags=[{"i": 0}, {"i": 1}, {"i": 2}],
                    partition_id="train")
    assert len(m) == m.size == 3 and m.extra_info == {} and m.fields is None
    m.extra_info["temperature"] = 0.7
    m.extra_info.update({"global_steps": 3})
    m.reorder([2, 0, 1])
    assert m.keys == ["c", "a", "b"] and [t["i"] for t in m.tags] == [2, 0, 1]
    parts = m.chunk(2)
    assert [p.keys for p in parts] == [["c", "a"], ["b"]]
    assert KVBatchMeta.concat(parts).keys == m.keys
    assert m.select_keys(["b"]).tags == [{"i": 1}]
    tags = [{"i": 0}]
    copied = KVBatchMeta(keys=["x"], tags=tags)
    tags[0]["i"] = 9
    assert copied.tags == [{"i": 0}]  # deep-copied
    with pytest.raises(ValueError, match="same length"):
        KVBatchMeta(keys=["a"], tags=[])
    with pytest.raises(ValueError, match="distinct"):
        KVBatchMeta(keys=["a", "a"], tags=[{}, {}])
    with pytest.raises(ValueError, match="permutation"):
        m.reorder([0, 0, 1])
    empty = BatchMeta()
    assert empty.size == 0 and empty.field_names == [] and BatchMeta.concat([empty]).size == 0
    b = BatchMeta([4, 5, 6], ["t"] * 3, {"y": {}, "x": {}}, custom_meta=[{"k": i}
                                                                     for i in range(3)])
    assert b.field_names == ["x", "y"] and b.select_fields(["y", "z"]).field_names == ["y"]
    assert [c.global_indexes for c in b.chunk(2)] == [[4, 5], [6]]
    assert BatchMeta.concat(b.chunk(3)).global_indexes == [4, 5, 6]
    b.reorder([1, 2, 0])
    assert b.global_indexes == [5, 6, 4] and b.custom_meta[0] == {"k": 1}


def test_calls_without_init_never_start_a_private_store(monkeypatch):
    """A worker that forgot tq.init() must not write into a store nobody else sees."""
    from tq_stream.compat import runtime
    from tq_stream.compat import transfer_queue as tq

    monkeypatch.delenv(runtime.ADDRESS_ENV, raising=False)
    with pytest.raises(StateError, match="tq.init"):
        tq.kv_batch_put(keys=["a"], partition_id="train", tags=[{}])
    with pytest.raises(StateError, match="tq.init"):
        asyncio.run(tq.async_kv_put(key="a", partition_id="train", tag={"s": 1}))
    assert runtime.RUNTIME.stream is None
