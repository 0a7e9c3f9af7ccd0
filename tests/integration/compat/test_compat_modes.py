"""The compat module across processes: a spawned rollout worker in local mode, and a
Ray job whose rollout actor attaches by name (Ray started with fewer CPUs than
storage units + 1, where TransferQueue hangs)."""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import textwrap

import pytest

import tq_stream.compat
from tests.helpers.compat_workers import worker_main
from tests.helpers.ray_job import run_ray_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def check_groups(tq, partition: str, uids: list[str], n: int) -> None:
    listed = tq.kv_list(partition)[partition]
    assert [listed[u]["status"] for u in uids] == ["finished"] * len(uids)
    assert all(listed[u]["is_prompt"] is True for u in uids)
    keys = [f"{u}_{s}_0" for u in uids for s in range(n)]
    assert set(keys) <= set(listed)
    data = tq.kv_batch_get(keys=keys, partition_id=partition)
    assert data["responses"].offsets().diff().tolist() == [3 + s for _ in uids for s in range(n)]
    assert [int(r[0]) for r in data["responses"].unbind()] == [100 * s for _ in uids
                                                              for s in range(n)]
    assert data["uid"].tolist() == [u for u in uids for _ in range(n)]


LOCAL = {"tq_stream": {"mode": "local", "timeout": 30.0}}


def test_status_transitions_from_a_worker_process_local_mode(tmp_path):
    tq_stream.compat.install()
    import transfer_queue as tq

    tq.init(LOCAL)
    try:
        uids = [f"uid{i}" for i in range(4)]
        tq.kv_batch_put(keys=uids, partition_id="train",
                        tags=[{"is_prompt": True, "status": "pending", "global_steps": 1}] * 4)
        recv, send = mp.get_context("spawn").Pipe(duplex=False)
        child = mp.get_context("spawn").Process(target=worker_main,
                                                args=(uids, "train", 3, send))
        child.start()
        assert recv.poll(120), "the worker process did not report"
        status, value = recv.recv()
        child.join(30)
        assert (status, value) == ("ok", 4)
        check_groups(tq, "train", uids, 3)
        # the bridge's calls over the sockets: keys -> indexes -> keys
        client = tq.get_client()
        keys = [f"{u}_1_0" for u in uids[::-1]]
        meta = asyncio.run(client.async_kv_retrieve_meta(keys=keys, partition_id="train"))
        assert asyncio.run(client.async_kv_retrieve_keys(
            global_indexes=meta.global_indexes, partition_id="train")) == keys
        # a checkpoint restored into a fresh local deployment
        before = tq.kv_list()
        tq.save_checkpoint(tmp_path / "ckpt")
        tq.close()
        tq.init(LOCAL)
        tq.load_checkpoint(tmp_path / "ckpt")
        assert tq.kv_list() == before
        check_groups(tq, "train", uids, 3)
    finally:
        tq.close()
        tq_stream.compat.uninstall()
    assert tq_stream.compat.runtime.ADDRESS_ENV not in os.environ


RAY_JOB = textwrap.dedent("""
    import json, sys
    import ray
    sys.path.insert(0, {root!r})
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False,
             runtime_env={{"worker_process_setup_hook": "tq_stream.compat.install",
                           "env_vars": {{"PYTHONPATH": {path!r}}}}})
    import tq_stream.compat
    tq_stream.compat.install()
    import transfer_queue as tq
    from tests.helpers.compat_workers import RolloutActor
    from tests.integration.compat.test_compat_modes import check_groups
    from tq_stream.errors import WaitTimeout
    units = {{"backend": {{"SimpleStorage": {{"num_data_storage_units": 2}}}}}}
    try:  # too short a start bound: a clear error, and nothing left running
        tq.init({{**units, "tq_stream": {{"start_timeout": 0.2}}}})
        raise AssertionError("init must time out")
    except WaitTimeout as exc:
        assert "start_timeout=0.2" in str(exc), exc
    conf = tq.init({{**units, "tq_stream": {{"start_timeout": 150}}}})
    assert tq_stream.compat.runtime.RUNTIME.stream.mode == "ray"
    uids = [f"u{{i}}" for i in range(3)]
    tq.kv_batch_put(keys=uids, partition_id="train",
                    tags=[{{"is_prompt": True, "status": "pending", "global_steps": 1}}] * 3)
    actor = ray.remote(num_cpus=0)(RolloutActor).remote()
    done = ray.get(actor.generate.remote(uids, "train", 2), timeout=120)
    check_groups(tq, "train", uids, 2)
    print(json.dumps({{"done": done, "units": conf["backend"]["SimpleStorage"]
                      ["num_data_storage_units"]}}))
    tq.close()
    ray.shutdown()
""")


@pytest.mark.ray
def test_ray_job_with_fewer_cpus_than_units(tmp_path):
    """num_cpus=1 and 2 storage units (TransferQueue would need 3 CPUs): the deployment
    starts (its actors ask for no CPU); a start bound too short raises WaitTimeout
    naming it instead of hanging."""
    lines = run_ray_job(RAY_JOB, tmp_path)
    assert json.loads(lines[-1]) == {"done": 3, "units": 2}
