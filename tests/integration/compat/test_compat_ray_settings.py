"""``tq.init(conf)``'s settings in a Ray job (issue 21): a Ray actor's ``tq.init()``, as
verl's and NeMo-RL's workers call it, follows the driver's polling mode, capacity and
timeout, and a worker passing the package's full default config.yaml is not refused."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tq_stream.compat
from tests.helpers.compat_helpers import installed_module
from tests.helpers.compat_workers import SettingsProbe, default_config

pytestmark = [pytest.mark.integration, pytest.mark.ray, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[3]
TIMEOUT = 5.0  # the driver's tq_stream.timeout; an actor's waits must use it too
CAPACITY = 4
DRIVER = {"controller": {"polling_mode": True},
          "backend": {"SimpleStorage": {"total_storage_size": CAPACITY,
                                        "num_data_storage_units": 1}},
          "tq_stream": {"timeout": TIMEOUT, "start_timeout": 150.0}}


@pytest.fixture(scope="module")
def job() -> Iterator[tuple[Any, Any]]:
    """A one-node Ray job whose driver (this process) ran ``tq.init(DRIVER)``; yields
    (the transfer_queue module, a SettingsProbe actor). Ray is stopped at the end."""
    ray = pytest.importorskip("ray")
    path = os.pathsep.join([str(ROOT)] + sys.path[1:])
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False,
             runtime_env={"worker_process_setup_hook": "tq_stream.compat.install",
                          "env_vars": {"PYTHONPATH": path}})
    try:
        with installed_module() as tq:
            tq.init(DRIVER)
            assert tq_stream.compat.stream().mode == "ray"
            yield tq, ray.remote(num_cpus=0)(SettingsProbe).remote()
    finally:
        ray.shutdown()


def report(job: tuple[Any, Any], conf: Any, prefix: str) -> dict:
    import ray

    return ray.get(job[1].report.remote(conf, prefix), timeout=150)


def test_a_ray_actor_s_init_gets_the_driver_s_settings(job):
    got = report(job, None, "none_")
    assert got == {"timeout": TIMEOUT, "endpoint": None, "polled": 0}, got
    assert tq_stream.compat.stream().stats()["none_worker_made"]["capacity"] == CAPACITY


def test_a_ray_actor_passing_the_full_default_config_follows_the_driver(job):
    got = report(job, default_config(), "yaml_")
    assert got == {"timeout": TIMEOUT, "endpoint": None, "polled": 0}, got
    assert tq_stream.compat.stream().stats()["yaml_worker_made"]["capacity"] == CAPACITY


def test_a_ray_actor_s_conf_that_contradicts_the_driver_s_is_refused(job):
    got = report(job, {"backend": {"SimpleStorage": {"total_storage_size": 8}}}, "bad_")
    assert got.get("error", "").startswith("ConfigError"), got
    assert "backend.SimpleStorage.total_storage_size must be 4" in got["error"], got
