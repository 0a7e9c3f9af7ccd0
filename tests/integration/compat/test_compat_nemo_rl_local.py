"""NeMo-RL's data-plane calls (tests/helpers/nemo_rl_calls.py) in local mode: the driver
bootstraps from the package config, a spawned worker attaches with ``init()``, puts
rows of other types than the warm-up row's and claims a batch of the same task."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import tq_stream.compat
from tests.helpers.nemo_rl_calls import DataPlane, driver_conf

pytest.importorskip("omegaconf")
pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

LOCAL = {"tq_stream": {"mode": "local", "timeout": 30.0}}


def _worker(queue) -> None:
    tq_stream.compat.install()
    import transfer_queue as tq

    try:
        dp = DataPlane(tq, bootstrap=False)
        lengths = [3, 1, 2, 4]
        ids = [torch.arange(k, dtype=torch.long) for k in lengths]
        content = np.empty(4, dtype=object)
        for i in range(4):
            content[i] = {"turn": i, "text": "x" * i}
        dp.put_samples([f"k{i}" for i in range(4)], "step-0", TensorDict({
            "input_ids": torch.nested.as_nested_tensor(ids, layout=torch.jagged),
            "input_lengths": torch.tensor(lengths), "content": content}, batch_size=[4]))
        keys, _ = dp.claim_meta("step-0", "train", ["input_ids"], batch_size=2)
        queue.put(sorted(keys))
    except Exception as exc:
        queue.put(f"{type(exc).__name__}: {exc}")


def test_driver_and_worker_processes_local_mode():
    tq_stream.compat.install()
    import transfer_queue as tq

    dp = DataPlane(tq, driver_conf(extra=LOCAL))
    try:
        dp.register_partition("step-0", ["input_ids", "input_lengths"])
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        proc = ctx.Process(target=_worker, args=(queue,))
        proc.start()
        try:
            worker_keys = queue.get(timeout=120)
        finally:
            proc.join(timeout=30)
        assert isinstance(worker_keys, list), worker_keys
        keys, _ = dp.claim_meta("step-0", "train", ["input_ids"], batch_size=2)
        assert sorted(worker_keys + keys) == [f"k{i}" for i in range(4)]
        assert dp.consumed("step-0", ["train"])
        data = dp.get_samples(["k3", "k0"], "step-0", ["input_ids", "input_lengths", "content"])
        assert [r.tolist() for r in data["input_ids"].unbind()] == [[0, 1, 2, 3], [0, 1, 2]]
        assert data["input_lengths"].tolist() == [4, 3]
        assert data["content"].tolist() == [{"turn": 3, "text": "xxx"}, {"turn": 0, "text": ""}]
        dp.clear_all("step-0")
        assert tq.kv_list(partition_id="step-0") == {"step-0": {}}
    finally:
        dp.close()
        tq_stream.compat.uninstall()
