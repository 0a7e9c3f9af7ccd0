"""Issue 20 item 10: Ray with ``curve=True``. Inside a Ray task, ``tq.connect()`` by name
works (the deployment tells its public key); a key that does not match fails within
seconds with an error naming ``curve_server_key`` instead of a call's whole timeout."""

from __future__ import annotations

import time

import pytest
import torch
from tq_fixtures import ray_cluster

import tq_stream as tq
from tq_stream.errors import ConfigError
from tq_stream.transport.zeromq import generate_keys

pytestmark = [pytest.mark.integration, pytest.mark.ray, pytest.mark.timeout(240)]
__all__ = ["ray_cluster"]  # the session-scoped fixture, imported for pytest


def _task():
    """The Ray task. Made here, not at module level: Ray workers cannot import a test
    module, so the function must be pickled by value."""

    def by_name() -> tuple[list[str], float]:
        """Joins by name (tq.connect()) and reads the one row."""
        started = time.monotonic()
        stream = tq.connect(config=tq.StreamConfig(timeout=60))
        try:
            client = stream.client()
            client.register_task("p", "t", ["x"], batch_size=1)
            meta = client.get_meta("p", "t", timeout=30)
            return list(meta.keys), time.monotonic() - started
        finally:
            stream.close()

    return by_name


def test_connect_by_name_and_key_mismatches_under_curve(ray_cluster):
    import ray

    stream = tq.init(mode="ray", storage_units=1, curve=True)
    try:
        stream.writer("p").put(["a"], {"x": torch.ones(1, 2)})
        keys, took = ray.get(ray.remote(num_cpus=0)(_task()).remote(), timeout=120)
        assert keys == ["a"]
        assert took < 30.0, f"connect by name took {took:.1f} s"
        wrong, _ = generate_keys()
        for key in (wrong, None):  # another key, and none where CURVE is required
            started = time.monotonic()
            with pytest.raises(ConfigError, match="curve_server_key"):
                tq.connect(stream.address, config=tq.StreamConfig(timeout=60),
                           curve_server_key=key)
            assert time.monotonic() - started < 15.0
        with pytest.raises(ConfigError, match="curve_server_key"):
            tq.connect(curve_server_key=wrong)  # by name, with a key not the deployment's
        joined = tq.connect(stream.address, curve_server_key=stream.curve_server_key)
        assert joined.stats()["p"]["rows"] == 1
        joined.close()
    finally:
        stream.close()
