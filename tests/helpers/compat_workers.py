"""Code the compat integration tests run in other processes (spawned, or Ray actors):
a verl-style rollout worker that attaches with ``tq.init()`` and reports by status tags."""

from __future__ import annotations

import asyncio

import torch
from tensordict import NonTensorStack, TensorDict


def session_fields(uid: str, session: int) -> TensorDict:
    """One session's output, batch of one (as verl's list_of_dict_to_tensordict makes it)."""
    n = 3 + session
    return TensorDict({
        "responses": torch.arange(n, dtype=torch.int64).unsqueeze(0) + 100 * session,
        "rm_scores": torch.full((1, n), float(session), dtype=torch.float32),
        "extra_fields": NonTensorStack({"reward_extra_info": {"acc": float(session)}}),
        "uid": NonTensorStack(uid),
    }, batch_size=[1])


async def run_prompts(uids: list[str], partition: str, n: int) -> int:
    """AgentLoopWorkerTQ: per prompt, running -> n sessions put -> finished."""
    import transfer_queue as tq

    async def one(uid: str) -> None:
        await tq.async_kv_put(key=uid, partition_id=partition, tag={"status": "running"})
        await asyncio.gather(*[
            tq.async_kv_batch_put(keys=[f"{uid}_{s}_0"], partition_id=partition,
                                  fields=session_fields(uid, s),
                                  tags=[{"status": "success", "response_len": 3 + s,
                                         "global_steps": 1}])
            for s in range(n)])
        await tq.async_kv_put(key=uid, partition_id=partition, tag={"status": "finished"})

    await asyncio.gather(*[one(u) for u in uids])
    return len(uids)


def worker_main(uids: list[str], partition: str, n: int, send) -> None:
    """A spawned process: install, attach with init() (no conf), run the prompts."""
    try:
        import tq_stream.compat

        tq_stream.compat.install()
        import transfer_queue as tq

        assert tq.init() is None  # attached, nothing started
        send.send(("ok", asyncio.run(run_prompts(uids, partition, n))))
        tq.close()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        send.send(("error", repr(exc)))


class RolloutActor:
    """A Ray actor body like AgentLoopWorkerTQ: ``tq.init()`` in __init__, async methods."""

    def __init__(self) -> None:
        import transfer_queue as tq  # importable through the worker_process_setup_hook

        tq.init()

    async def generate(self, uids: list[str], partition: str, n: int) -> int:
        return await run_prompts(uids, partition, n)


def report_settings(conf, prefix: str = "") -> dict:
    """In a worker (spawned, forked or a Ray actor): attach with ``tq.init(conf)``, then
    report what the driver's settings look like from here (errors as values): this
    handle's ``timeout``, the driver's metrics ``endpoint``, and ``polled``, the size of
    a get_meta asking for two rows when one is ready (0 under polling_mode). It writes
    ``<prefix>w0`` to partition ``<prefix>worker_made`` (whose capacity the driver can
    then read) and ``<prefix>a`` to ``<prefix>poll``."""
    import tq_stream.compat

    tq_stream.compat.install()
    import transfer_queue as tq

    def one(x: int) -> TensorDict:
        return TensorDict({"x": torch.tensor([x])}, batch_size=[1])

    out: dict = {}
    try:
        tq.init(conf)
        out["timeout"] = tq_stream.compat.stream().config.timeout
        out["endpoint"] = tq.get_metrics_endpoint()  # the driver's, if it serves one
        # a partition this worker creates: bounded by total_storage_size too
        tq.kv_batch_put(keys=[f"{prefix}w0"], partition_id=f"{prefix}worker_made",
                        fields=one(0))
        # one row ready, two asked: polling_mode returns an empty BatchMeta at once
        tq.kv_batch_put(keys=[f"{prefix}a"], partition_id=f"{prefix}poll", fields=one(1))
        meta = tq.get_client().get_meta(data_fields=["x"], batch_size=2,
                                        partition_id=f"{prefix}poll", task_name="t",
                                        mode="fetch", sampling_config={"dp_rank": 0})
        out["polled"] = meta.size
    except Exception as exc:  # the error travels back as a value
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        tq.close()
    return out


def default_config():
    """The package's full default config, unmerged, as NeMo-RL loads it (a DictConfig)."""
    import importlib.resources

    from omegaconf import OmegaConf

    import tq_stream.compat

    tq_stream.compat.install()
    return OmegaConf.load(importlib.resources.files("transfer_queue") / "config.yaml")


class SettingsProbe:
    """A Ray actor body: ``report_settings`` from a Ray worker process."""

    def report(self, conf, prefix: str) -> dict:
        return report_settings(conf, prefix)
