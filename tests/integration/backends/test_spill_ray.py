"""Memory budget and spilling in Ray mode: the unit actors get the owner's spill_dir and
each partition's settings; cold fields spill on the actor's node and read back equal; a
put past the budget is refused by the actor (one job on a one-node local Ray, in its own
process so that it shares nothing with other Ray tests)."""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.helpers.ray_job import run_ray_job

pytestmark = [pytest.mark.integration, pytest.mark.ray, pytest.mark.timeout(240)]


RAY_JOB = textwrap.dedent("""
    import glob, json, sys
    import ray, torch
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False,
             runtime_env={{"env_vars": {{"PYTHONPATH": {path!r}}}}})
    import tq_stream as tq
    from tq_stream.errors import MemoryBudgetExceeded

    spill = {spill!r}
    stream = tq.init(mode="ray", storage_units=1, spill_dir=spill,
                     config=tq.StreamConfig(timeout=60))
    try:
        stream.create_partition("p", memory_budget=1 << 20, cold=["image"])
        image = torch.arange(16 * 65536, dtype=torch.float32).reshape(16, 65536)
        keys = [f"k{{i}}" for i in range(16)]
        stream.writer("p").put(keys, {{"image": image, "x": torch.ones(16)}})
        part = stream.deployment_stats()["units"][0]["partitions"]["p"]
        files = len(glob.glob(spill + "/tq_spill_*/*.col"))
        exact = torch.equal(stream.kv.get("k9", partition="p")["image"], image[9])
        try:
            stream.writer("p").put(["big"], {{"big": torch.ones(1, 1 << 20)}}, timeout=0.5)
            refused = False
        except MemoryBudgetExceeded:
            refused = True
        print(json.dumps({{"fields": sorted(part["fields"]), "budget": part["budget"],
                          "spilled": part["spilled"] >= image.numel() * 4, "files": files,
                          "exact": exact, "refused": refused}}))
    finally:
        stream.close()
        ray.shutdown()
    print(json.dumps({{"left": glob.glob(spill + "/tq_spill_*")}}))
""")


def test_a_ray_unit_spills_under_the_owner_s_folder_and_keeps_the_budget(tmp_path):
    spill = tmp_path / "spill"
    lines = run_ray_job(RAY_JOB, tmp_path, spill=str(spill))
    assert json.loads(lines[-2]) == {"fields": ["x"], "budget": 1 << 20, "spilled": True,
                                     "files": 1, "exact": True, "refused": True}
    assert json.loads(lines[-1]) == {"left": []}
