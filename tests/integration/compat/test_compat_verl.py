"""verl 0.9.1's own ReplayBuffer (sync and async) and worker-group bridge, unmodified, on
tq_stream.compat.transfer_queue (embedded mode).

Needs verl installed without its dependencies plus the few its import chain uses:
``pip install -e '.[verl-compat]' && pip install --no-deps verl==0.9.1``; skipped otherwise.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch

import tq_stream.compat

pytestmark = [pytest.mark.integration, pytest.mark.verl, pytest.mark.timeout(300)]

tq_stream.compat.install()  # before verl imports transfer_queue
verl = pytest.importorskip("verl")
pytest.importorskip("omegaconf")
replay = pytest.importorskip("verl.trainer.ppo.v1.replay_buffer")
import transfer_queue as tq  # noqa: E402  (the compat module, through install())
from omegaconf import OmegaConf  # noqa: E402
from verl.utils import transferqueue_utils as bridge  # noqa: E402
from verl.utils.tensordict_utils import list_of_dict_to_tensordict  # noqa: E402

N = 3  # sessions per prompt (rollout.n)


def verl_tq_conf():
    """verl's own ``transfer_queue`` config node (its yaml), as main_ppo passes it."""
    path = Path(verl.__file__).parent / "trainer/config/transfer_queue/transfer_queue.yaml"
    conf = OmegaConf.load(path)
    conf.enable = True
    conf.tq_stream = {"mode": "embedded"}  # even when the session has Ray up
    return conf


@pytest.fixture
def store():
    tq_stream.compat.install()  # again: another test module's teardown may have removed it
    assert tq.__name__ == "tq_stream.compat.transfer_queue"
    conf = tq.init(verl_tq_conf())
    assert conf["backend"]["SimpleStorage"]["num_data_storage_units"] == 8
    try:
        yield tq
    finally:
        tq.close()


def submit(partition: str, step: int, n_prompts: int) -> list[str]:
    """trainer_base._submit_batch_to_rollout (sync mode): tag-only prompt registration."""
    import uuid

    uids = [uuid.uuid4().hex for _ in range(n_prompts)]
    tags = [{"is_prompt": True, "status": "pending", "global_steps": step} for _ in uids]
    tq.kv_batch_put(keys=uids, partition_id=partition, tags=tags)
    return uids


def rollout(uids: list[str], partition: str, step: int, reward=lambda uid, s: float(s % 2)):
    """AgentLoopWorkerTQ on its own event loop (another thread): status tags, one put per
    session built with verl's list_of_dict_to_tensordict."""

    async def one(uid: str) -> None:
        await tq.async_kv_put(key=uid, partition_id=partition, tag={"status": "running"})
        for s in range(N):
            r_len = 2 + s
            score = torch.zeros(r_len)
            score[-1] = reward(uid, s)
            field = {
                "prompts": torch.arange(4, dtype=torch.int64),
                "responses": torch.arange(r_len, dtype=torch.int64) + 10 * s,
                "response_mask": torch.ones(r_len, dtype=torch.int64),
                "rm_scores": score,
                "extra_fields": {"reward_extra_info": {"acc": reward(uid, s)},
                                 "min_global_steps": step, "max_global_steps": step},
                "uid": uid, "session_id": s, "num_turns": 2,
            }
            tag = {"status": "success", "prompt_len": 4, "response_len": r_len,
                   "seq_len": 4 + r_len, "global_steps": step, "min_global_steps": step,
                   "max_global_steps": step}
            await tq.async_kv_batch_put(keys=[f"{uid}_{s}_0"], fields=list_of_dict_to_tensordict(
                [field]), tags=[tag], partition_id=partition)
        await tq.async_kv_put(key=uid, partition_id=partition, tag={"status": "finished"})

    async def main() -> None:
        await asyncio.gather(*[one(u) for u in uids])

    t = threading.Thread(target=asyncio.run, args=(main(),))
    t.start()
    t.join(60)
    assert not t.is_alive()


def buffer(cls, **kw):
    kw.setdefault("max_off_policy_threshold", None)
    kw.setdefault("max_off_policy_strategy", "drop")
    return cls(trainer_mode="sync" if cls is replay.ReplayBuffer else "async",
               trainer_config=OmegaConf.create({}), sampler_kwargs=OmegaConf.create({}),
               poll_interval=0.05, **kw)


def test_sync_replay_buffer_samples_groups_and_clears_prompts(store):
    uids = submit("train", 1, 4)
    rollout(uids, "train", 1)
    rb = buffer(replay.ReplayBuffer)
    batch, metrics = rb.sample(global_steps=1, partition_id="train", batch_size=2)
    assert isinstance(batch, tq.KVBatchMeta) and metrics == {}
    chosen = sorted({k.split("_")[0] for k in batch.keys})
    assert len(chosen) == 2 and len(batch) == 2 * N
    assert [t["min_global_steps"] for t in batch.tags] == [1] * (2 * N)
    left = tq.kv_list("train")["train"]
    assert not set(chosen) & set(left)  # the sampled prompts were cleared
    data = tq.kv_batch_get(keys=batch.keys, partition_id="train")
    assert data["responses"].offsets().diff().tolist() == [t["response_len"] for t in batch.tags]
    assert data["uid"].tolist() == [k.split("_")[0] for k in batch.keys]
    tq.kv_clear(keys=batch.keys, partition_id="train")  # end of the step
    rest = tq.kv_list("train")["train"]
    assert sum(1 for t in rest.values() if t.get("is_prompt")) == 2


def test_async_replay_buffer_drops_stale_and_dapo_groups(store):
    refills: list[int] = []
    old = submit("train", 1, 2)
    rollout(old, "train", 1)
    flat, mixed = submit("train", 3, 2), submit("train", 3, 2)
    rollout(flat, "train", 3, reward=lambda uid, s: 1.0)  # no signal: DAPO drops them
    rollout(mixed, "train", 3)
    rb = buffer(replay.ReplayBufferAsync, max_off_policy_threshold=2,
                filter_groups_metric="reward", refill_fn=refills.append)
    batch, metrics = rb.sample(global_steps=3, partition_id="train", batch_size=2)
    assert sorted({k.split("_")[0] for k in batch.keys}) == sorted(mixed)
    assert metrics["training/off_policy/evicted_samples"] == 2
    assert metrics["training/filter_groups/evicted_samples"] == 2
    assert refills == [4]
    assert tq.kv_list("train") == {"train": {k: t for k, t in zip(batch.keys, batch.tags,
                                                                    strict=True)}}


def test_validation_partition_and_bridge(store):
    val = submit("val", 0, 2)
    rollout(val, "val", 0)
    rb = buffer(replay.ReplayBuffer)
    batch, _ = rb.sample(global_steps=0, partition_id="val", batch_size=2)
    assert len(batch) == 2 * N
    # the worker-group bridge: KVBatchMeta -> BatchMeta -> data, output -> KVBatchMeta
    batch.fields = ["responses", "uid"]
    meta = bridge.kv_batch_meta2batch_meta(batch)
    assert meta.size == 2 * N and meta.field_names == ["responses", "uid"]
    data = bridge._meta_to_realdata(meta)
    assert data["uid"].tolist() == [k.split("_")[0] for k in batch.keys]
    logp = [torch.randn(len(r)) for r in data["responses"].unbind()]
    out = bridge._update_meta_with_output(
        __import__("tensordict").TensorDict({"old_log_probs": torch.nested.as_nested_tensor(
            logp, layout=torch.jagged)}, batch_size=[2 * N]), meta)
    back = bridge.batch_meta2kv_batch_meta(out)
    assert back.keys == batch.keys and "old_log_probs" in back.fields
    got = tq.kv_batch_get(keys=batch.keys, partition_id="val", select_fields="old_log_probs")
    for a, b in zip(got["old_log_probs"].unbind(), logp, strict=True):
        assert torch.equal(a, b)
    assert bridge._postprocess_common(None, True, False).size == 0  # BatchMeta()


def submit_with_fields(partition: str, step: int, n_prompts: int) -> list[str]:
    """The async trainer modes' prompt put: tags and the prompt's fields, ``index`` as
    an int64 tensor (the agent loop later writes ``index`` as a Python int)."""
    import uuid

    from tensordict import NonTensorStack, TensorDict

    uids = [uuid.uuid4().hex for _ in range(n_prompts)]
    tags = [{"is_prompt": True, "status": "pending", "global_steps": step} for _ in uids]
    fields = TensorDict({
        "index": torch.arange(n_prompts, dtype=torch.int64) + 100,
        "raw_prompt": NonTensorStack(*[[{"role": "user", "content": u}] for u in uids]),
        "multi_modal_inputs": NonTensorStack(*[{"pixel_values": torch.ones(i + 1, 2)}
                                               for i in range(n_prompts)]),
    }, batch_size=[n_prompts])
    tq.kv_batch_put(keys=uids, partition_id=partition, tags=tags, fields=fields)
    return uids


def rollout_with_index(uids: list[str], partition: str, step: int) -> None:
    """``rollout`` whose sessions also carry ``index`` as a Python int."""
    rollout(uids, partition, step)
    for i, uid in enumerate(uids):
        keys = [f"{uid}_{s}_0" for s in range(N)]
        td = list_of_dict_to_tensordict([{"index": i} for _ in keys])
        tq.kv_batch_put(keys=keys, partition_id=partition, fields=td)


def test_colocate_async_prompts_with_fields_and_a_checkpoint_round_trip(store, tmp_path):
    uids = submit_with_fields("train", 2, 3)
    rollout_with_index(uids[:2], "train", 2)
    rb = buffer(replay.ReplayBufferAsync, max_off_policy_threshold=2)
    batch, _ = rb.sample(global_steps=2, partition_id="train", batch_size=2)
    assert sorted({k.split("_")[0] for k in batch.keys}) == sorted(uids[:2])
    data = tq.kv_batch_get(keys=batch.keys, partition_id="train",
                           select_fields=["index", "responses"])
    assert [type(v) for v in data["index"].tolist()] == [int] * len(batch)
    tq.save_checkpoint(tmp_path / "ckpt", metadata={"global_steps": 2})
    tq.close()
    tq.init(verl_tq_conf())
    tq.load_checkpoint(tmp_path / "ckpt")
    pending = uids[2]
    assert tq.kv_list("train")["train"][pending]["status"] == "pending"
    prompt = tq.kv_batch_get(keys=[pending], partition_id="train")  # _reissue_inflight_prompts
    assert prompt["index"].dtype == torch.int64 and prompt["index"].tolist() == [102]
    assert prompt["raw_prompt"].tolist() == [[{"role": "user", "content": pending}]]
    assert torch.equal(prompt["multi_modal_inputs"].tolist()[0]["pixel_values"], torch.ones(3, 2))
