"""Workload 5: time from start to the first successful put, and resident memory of the
whole deployment when idle and after a bulk workload was cleared."""

from __future__ import annotations

import gc
import time

import torch
from tensordict import TensorDict

from benchmarks.systems import procs
from benchmarks.workloads import bulk
from benchmarks.workloads.common import Row, Shapes


def resident(system) -> int:
    """Memory of the deployment's processes: PSS where the kernel reports it (shared and
    copy-on-write pages split among the processes mapping them), else RSS."""
    total = 0
    for pid in system.pids():
        total += procs.pss_bytes(pid) or procs.rss_bytes(pid)
    return total


def run(system_cls, shapes: Shapes) -> tuple[list[Row], object]:
    """Starts the system itself; returns the rows and the started system."""
    system = system_cls()
    t = time.perf_counter()
    system.start()
    system.put(["startup-0"], TensorDict({"x": torch.zeros(1, 4)}, [1]))
    started = time.perf_counter() - t
    system.clear(["startup-0"])
    idle = resident(system)
    td, _ = bulk.make_data(shapes, "dense")
    keys = [f"fp-{i}" for i in range(shapes.bulk_rows)]
    system.put(keys, td)
    system.get(keys, None)
    loaded = resident(system)
    system.clear(keys)
    del td
    gc.collect()
    time.sleep(0.5)  # let units process the frees before reading their RSS
    after = resident(system)
    mb = 1 / 2**20
    rows = [
        Row("startup", "start to first put", system.name, started, "s"),
        Row("startup", "resident memory, idle", system.name, idle * mb, "MB"),
        Row("startup", "resident memory, bulk loaded", system.name, loaded * mb, "MB"),
        Row("startup", "resident memory, after clear", system.name, after * mb, "MB"),
    ]
    return rows, system
