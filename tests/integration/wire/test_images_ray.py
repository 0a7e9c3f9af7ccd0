"""Images in Ray mode: a Ray task writes multi-ragged rows through a handed-on Stream,
the driver reads them back byte-exact (one job on a one-node local Ray, in its own
process so that it shares nothing with other Ray tests)."""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.helpers.ray_job import run_ray_job

pytestmark = [pytest.mark.integration, pytest.mark.ray, pytest.mark.timeout(240)]


RAY_JOB = textwrap.dedent("""
    import json, sys
    import ray, torch
    sys.path.insert(0, {root!r})
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False,
             runtime_env={{"env_vars": {{"PYTHONPATH": {path!r}}}}})
    import tq_stream as tq
    from tests.wire.test_images import images, keys, same

    @ray.remote(num_cpus=0)
    def produce(stream, n):
        import sys
        sys.path.insert(0, {root!r})
        import tq_stream as tq
        from tests.wire.test_images import images, keys
        stream.writer("vlm").put(keys(n), {{"image": tq.MultiRagged.from_list(
            images(n, seed=20), fixed_dims=(0,))}})
        return n

    stream = tq.init(mode="ray", storage_units=1, config=tq.StreamConfig(timeout=60))
    try:
        n = ray.get(produce.remote(stream, 6), timeout=120)
        want = images(n, seed=20)
        got = stream.kv.get_batch(keys(n), partition="vlm", ragged="list")
        nested = stream.kv.get_batch(keys(n), partition="vlm")["image"]
        print(json.dumps({{"rows": n, "exact": same(got.get("image").tolist(), want),
                          "nested": same(list(nested.unbind()), want),
                          "schema": stream.stats()["vlm"]["fields"]["image"]}}))
    finally:
        stream.close()
        ray.shutdown()
""")


def test_images_written_by_a_ray_task_read_back_exact(tmp_path):
    lines = run_ray_job(RAY_JOB, tmp_path)
    assert json.loads(lines[-1]) == {
        "rows": 6, "exact": True, "nested": True, "schema": "multiragged uint8[3, *, *]"}
