"""Time to recover in Ray mode (README "Failures"): a storage unit actor and the
controller actor SIGKILLed on a one-node local Ray cluster.

    python -m benchmarks.ray_recovery [--rows 1000]

Prints, per kill, the seconds from the kill to the first call that needs the new actor
(a put placed on the re-created unit; a controller call) and the deployment's own
figure (``restarts``: from the death being noticed to serving). Starts its own Ray
(``ray.init(address="local")``) and stops it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import tempfile
import time

import torch

import tq_stream as tq

TIMEOUT = 300.0  # seconds one recovery may take before the run gives up


def _until(cond, what: str) -> float:
    started = time.monotonic()
    while not cond():
        if time.monotonic() - started > TIMEOUT:
            raise TimeoutError(f"{what} did not recover within {TIMEOUT} s")
        time.sleep(0.02)
    return time.monotonic() - started


def _put(stream: tq.Stream, prefix: str, n: int) -> list[int]:
    units = []
    for lo in range(0, n, 500):
        keys = [f"{prefix}_{i}" for i in range(lo, min(n, lo + 500))]
        stream.writer("p").put(keys, {"x": torch.zeros(len(keys), 8)})
        units += stream.kv.meta(keys, partition="p").unit.tolist()
    return units


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1000)
    rows = parser.parse_args().rows
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    folder = tempfile.mkdtemp(prefix="tq_bench_")
    stream = tq.init(mode="ray", storage_units=2, unit_timeout=2.0, restart_units=True,
                     checkpoint_interval=0.5, restart_controller=True,
                     checkpoint_path=os.path.join(folder, "ctrl.tqmeta"),
                     config=tq.StreamConfig(timeout=30.0))
    try:
        owner, ctrl = stream._owner, stream.connection.controller()
        stream.create_partition("p")
        _put(stream, "a", rows)
        old = owner.pids[1]
        killed = time.monotonic()
        os.kill(old, signal.SIGKILL)
        _until(lambda: owner.pids[1] != old and ctrl.dead_units() == [], "unit 1")
        n = 0
        while 1 not in _put(stream, f"b{n}", 8):  # a put that lands on the new unit
            n += 1
        print(f"unit actor killed -> a put lands on the re-created unit: "
              f"{time.monotonic() - killed:.2f} s ({rows} rows)")
        time.sleep(1.5)  # a checkpoint after the puts
        old = owner.pids[-1]
        killed = time.monotonic()
        os.kill(old, signal.SIGKILL)
        _until(lambda: bool(owner.restarts), "the controller")
        stream.stats()
        print(f"controller actor killed -> first call answered: "
              f"{time.monotonic() - killed:.2f} s; restart: {owner.restarts[0]}")
    finally:
        stream.close()
        ray.shutdown()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
