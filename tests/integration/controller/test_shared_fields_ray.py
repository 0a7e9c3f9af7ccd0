"""Shared fields in Ray mode: a Ray task puts a group's image once and its response rows
naming it through a handed-on Stream; the driver reads each row's image, then acks and
sees the entry freed (one job on a one-node local Ray, in its own process)."""

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
    from tests.controller.test_shared_fields import images

    @ray.remote(num_cpus=0)
    def produce(stream, groups, n):
        import sys
        sys.path.insert(0, {root!r})
        import torch
        import tq_stream as tq
        from tests.controller.test_shared_fields import images
        w = stream.writer("vlm")
        w.put_shared([f"p{{g}}" for g in range(groups)], {{"image": tq.MultiRagged.from_list(
            images(groups, seed=30), fixed_dims=(0,))}})
        w.put([f"p{{g}}_{{j}}" for g in range(groups) for j in range(n)],
              {{"r": torch.arange(groups * n)}},
              tags=[{{"uid": f"p{{g}}"}} for g in range(groups) for _ in range(n)],
              shared=[f"p{{g}}" for g in range(groups) for _ in range(n)])
        return groups * n

    stream = tq.init(mode="ray", storage_units=1, config=tq.StreamConfig(timeout=60))
    try:
        stream.create_partition("vlm", consumers=["actor"])
        rows = ray.get(produce.remote(stream, 3, 4), timeout=120)
        want = images(3, seed=30)
        before = stream.stats()["vlm"]["shared"]["entries"]
        client = stream.client()
        client.register_task("vlm", "actor", fields=["image", "r"], batch_size=4,
                             sampler=tq.samplers.GroupSampler(group_size=4))
        exact = True
        for step in range(3):
            meta = client.get_meta("vlm", "actor", step=step, timeout=30)
            td = client.get_data(meta, ragged="list")
            for key, img in zip(meta.keys, td["image"]):
                exact &= torch.equal(img, want[int(key[1:].split("_")[0])])
            client.ack(meta)
        print(json.dumps({{"rows": rows, "exact": bool(exact), "before": before,
                          "after": stream.stats()["vlm"]["shared"]["entries"]}}))
    finally:
        stream.close()
        ray.shutdown()
""")


def test_shared_images_put_by_a_ray_task_are_read_and_freed(tmp_path):
    lines = run_ray_job(RAY_JOB, tmp_path)
    assert json.loads(lines[-1]) == {
        "rows": 12, "exact": True, "before": 3, "after": 0}
