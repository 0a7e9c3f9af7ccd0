"""Issue 21 item 4: outside Ray, a worker process's ``tq.init()`` must find the
driver's deployment or fail loudly, never write to a private copy."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import tq_stream.compat
from tests.helpers.compat_helpers import in_process, installed_module

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _worker(queue, conf=None) -> None:
    """A rollout worker: attach with ``init()``, put one row, report what happened."""
    tq_stream.compat.install()
    import transfer_queue as tq

    try:
        tq.init(conf)
        tq.kv_batch_put(keys=["w0"], partition_id="train",
                        fields=TensorDict({"x": torch.ones(1, 2)}, batch_size=[1]))
        queue.put("put")
    except Exception as exc:  # the error travels back as a value
        queue.put(f"{type(exc).__name__}: {exc}")


def _run(method: str, conf=None) -> str:
    return in_process(_worker, conf, method=method, timeout=60)


@pytest.fixture
def tq():
    with installed_module() as module:
        yield module


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_worker_of_an_embedded_driver_fails_loudly(tq, method):
    tq.init({"tq_stream": {"mode": "embedded"}})
    out = _run(method)
    assert out.startswith("StateError") and "embedded" in out and "local" in out, out
    assert tq.kv_list("train") == {}


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_worker_of_a_local_driver_writes_to_the_driver_s_deployment(tq, method):
    tq.init({"tq_stream": {"mode": "local", "timeout": 30.0}})
    assert _run(method) == "put"
    assert list(tq.kv_list("train")["train"]) == ["w0"]


def test_a_worker_s_init_with_conf_of_an_embedded_driver_fails_loudly(tq):
    """With a conf of its own the worker would start a second, private deployment."""
    tq.init({"tq_stream": {"mode": "embedded"}})
    out = _run("spawn", {"backend": {"SimpleStorage": {"num_data_storage_units": 1}}})
    assert out.startswith("StateError") and "embedded" in out, out
    assert tq.kv_list("train") == {}
