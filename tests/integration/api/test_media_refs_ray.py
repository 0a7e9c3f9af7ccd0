"""Media by reference in Ray mode: the driver (the agent loop) puts an image and hands
its MediaRef to an inference-server actor, which joins the deployment by name and
resolves it (views of the unit's shared memory on this node, the first read too) and
pins it; the rows naming it are acked, the actor releases its pin, and the media is
freed (one job on a one-node local Ray, in its own process)."""

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
    from tq_stream.errors import StateError
    from tests.controller.test_shared_fields import images

    @ray.remote(num_cpus=0)
    class InferenceServer:
        def __init__(self):
            import tq_stream as tq
            self.stream = tq.connect(config=tq.StreamConfig(timeout=60))  # by name
            self.pins = {{}}

        def generate(self, ref):
            self.pins[ref.key] = self.stream.media.pin(ref)  # held while it works
            reads = [self.stream.resolve(ref)["image"] for _ in range(3)]
            return {{"sum": int(reads[-1].sum()), "shape": list(reads[-1].shape),
                    "view": len({{r.data_ptr() for r in reads}}) == 1}}

        def done(self, key):
            self.stream.release(self.pins.pop(key))
            return True

    stream = tq.init(mode="ray", storage_units=1, config=tq.StreamConfig(timeout=60))
    try:
        p = "agent"
        stream.create_partition(p, consumers=["actor"])
        img = images(1, seed=40)[0]
        ref = stream.media.put(p, "g0", {{"image": tq.MultiRagged.from_list(
            [img], fixed_dims=(0,))}})
        server = InferenceServer.remote()
        out = ray.get(server.generate.remote(ref), timeout=120)
        pins = sum(stream.stats()[p]["media"]["pins"].values())
        stream.writer(p).put([f"g0_{{j}}" for j in range(4)], {{"r": torch.arange(4)}},
                             tags=[{{"uid": "g0"}}] * 4, shared=["g0"] * 4)
        client = stream.client()
        client.register_task(p, "actor", fields=["image", "r"], batch_size=4)
        meta = client.get_meta(p, "actor", timeout=30)
        exact = all(torch.equal(i, img) for i in client.get_data(meta, ragged="list")["image"])
        client.ack(meta)
        held = stream.stats()[p]["shared"]["entries"]  # the server's pin keeps it
        ray.get(server.done.remote("g0"), timeout=60)
        after = stream.stats()[p]["shared"]["entries"]
        try:
            stream.resolve(ref)
            refused = ""
        except StateError as exc:
            refused = str(exc)
        print(json.dumps({{"exact_server": out["sum"] == int(img.sum())
                          and out["shape"] == list(img.shape), "view": out["view"],
                          "pins": pins, "exact": bool(exact), "held": held,
                          "after": after, "refused": refused}}))
    finally:
        stream.close()
        ray.shutdown()
""")


def test_an_actor_resolves_media_by_reference_and_it_is_freed(tmp_path):
    lines = run_ray_job(RAY_JOB, tmp_path)
    got = json.loads(lines[-1])
    assert "was freed: its last pin was released by" in got.pop("refused")
    assert got == {"exact_server": True, "view": True, "pins": 2, "exact": True,
                   "held": 1, "after": 0}
