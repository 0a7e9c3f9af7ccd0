"""``tq.init(conf)``'s settings in local mode, in the driver and in the worker processes
that attach to its deployment (issue 21): ``controller.polling_mode``, the sampler,
``backend.SimpleStorage`` (capacity, units), ``tq_stream.timeout`` and ``metrics``."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import tq_stream.compat
from tests.helpers.compat_helpers import (
    dashboard_metrics,
    in_process,
    installed_module,
    scrape_metric_names,
)
from tests.helpers.compat_workers import default_config, report_settings
from tq_stream.errors import ConfigError, WaitTimeout

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

TIMEOUT = 5.0  # the driver's tq_stream.timeout; a worker's waits must use it too
CAPACITY = 4


def driver_conf(polling: bool = True, **backend) -> dict:
    simple = {"total_storage_size": CAPACITY, "num_data_storage_units": 3, **backend}
    return {"controller": {"polling_mode": polling, "sampler": "SequentialSampler"},
            "backend": {"storage_backend": "SimpleStorage", "SimpleStorage": simple},
            "tq_stream": {"mode": "local", "timeout": TIMEOUT}}


def one(x: int) -> TensorDict:
    return TensorDict({"x": torch.tensor([x])}, batch_size=[1])


def _worker(queue, conf) -> None:
    queue.put(report_settings(conf))


def _run(method: str, conf=None) -> dict:
    return in_process(_worker, conf, method=method)


@pytest.fixture
def tq():
    with installed_module() as module:
        yield module


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_a_worker_gets_the_driver_s_polling_mode_capacity_and_timeout(tq, method):
    tq.init(driver_conf(polling=True))
    got = _run(method)
    assert got == {"timeout": TIMEOUT, "endpoint": None, "polled": 0}, got
    stats = tq_stream.compat.stream().stats()
    assert stats["worker_made"]["capacity"] == CAPACITY
    assert stats["poll"]["capacity"] == CAPACITY


def test_a_worker_of_a_driver_without_polling_waits_its_timeout(tq):
    tq.init(driver_conf(polling=False))
    got = _run("spawn")
    assert got.get("error", "").startswith("WaitTimeout"), got


def test_a_worker_s_init_with_conf_attaches_to_the_driver_s_deployment(tq):
    tq.init(driver_conf(polling=True))
    got = _run("spawn", {"tq_stream": {"mode": "local"}, "metrics": {"enabled": False}})
    assert got == {"timeout": TIMEOUT, "endpoint": None, "polled": 0}, got
    assert list(tq.kv_list("worker_made")["worker_made"]) == ["w0"]  # one deployment


@pytest.mark.parametrize(("polling", "conf", "named"), [
    (True, {"backend": {"SimpleStorage": {"total_storage_size": 8}}},
     "backend.SimpleStorage.total_storage_size must be 4"),
    (False, {"controller": {"polling_mode": True}}, "controller.polling_mode must be False"),
])
def test_a_worker_s_conf_that_contradicts_the_driver_s_is_refused(tq, polling, conf, named):
    tq.init(driver_conf(polling=polling))
    got = _run("spawn", conf)
    assert got.get("error", "").startswith("ConfigError"), got
    assert named in got["error"], got


def test_a_worker_passing_the_full_default_config_follows_the_driver(tq):
    """NeMo-RL's worker may pass the package's config.yaml unmerged: its defaults
    (polling_mode false, total_storage_size null, 2 units, timeout 60) are not the
    worker's choices, so they do not contradict the driver's overlay."""
    tq.init(driver_conf(polling=True))
    got = _run("spawn", default_config())
    assert got == {"timeout": TIMEOUT, "endpoint": None, "polled": 0}, got
    assert tq_stream.compat.stream().stats()["worker_made"]["capacity"] == CAPACITY


def test_simple_storage_settings_and_the_sampler_take_effect(tq):
    tq.init(driver_conf())
    stream = tq_stream.compat.stream()
    assert stream.mode == "local"
    assert len(stream.deployment_stats()["units"]) == 3  # num_data_storage_units
    tq.kv_batch_put(keys=[f"k{i}" for i in range(CAPACITY)], partition_id="p",
                    fields=TensorDict({"x": torch.arange(CAPACITY)}, batch_size=[CAPACITY]))
    assert stream.stats()["p"]["capacity"] == CAPACITY  # total_storage_size
    with pytest.raises(WaitTimeout):  # full: waits tq_stream.timeout for a clear
        tq.kv_batch_put(keys=["over"], partition_id="p", fields=one(9))
    client = tq.get_client()  # SequentialSampler: oldest ready rows first, each once
    metas = [client.get_meta(data_fields=["x"], batch_size=2, partition_id="p", task_name="t")
             for _ in range(2)]
    keys = [client.kv_retrieve_keys(global_indexes=m.global_indexes, partition_id="p")
            for m in metas]
    assert keys == [["k0", "k1"], ["k2", "k3"]]
    assert client.check_consumption_status(task_name="t", partition_id="p")


def test_another_sampler_is_refused_in_local_mode(tq):
    conf = driver_conf()
    conf["controller"]["sampler"] = "GRPOGroupNSampler"
    with pytest.raises(ConfigError, match="controller.sampler"):
        tq.init(conf)
    with pytest.raises(Exception, match="initialized"):  # nothing was started
        tq_stream.compat.stream()


def test_metrics_in_local_mode_serve_what_the_dashboard_plots(tq):
    pytest.importorskip("prometheus_client")
    conf = driver_conf()
    conf["metrics"] = {"enabled": True, "port": 0}
    tq.init(conf)
    tq.kv_batch_put(keys=["a", "b"], partition_id="train",
                    fields=TensorDict({"x": torch.ones(2, 3)}, batch_size=[2]))
    tq.get_client().get_meta(data_fields=["x"], batch_size=1, partition_id="train",
                             task_name="t")
    names = scrape_metric_names(tq.get_metrics_endpoint())
    assert dashboard_metrics() <= names, sorted(dashboard_metrics() - names)
    assert _run("spawn")["endpoint"] == tq.get_metrics_endpoint()  # a worker finds it
