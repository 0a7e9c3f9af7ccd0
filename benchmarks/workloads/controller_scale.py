"""Workload 4 (tq_stream only): the controller at 10^4..10^6 rows x 20 fields.

Measures, on the controller alone (metadata, no tensor bytes): the time of a get_meta
handing out 1024 ready rows with each sampler, and the time to mark 1024 rows ready
(one commit). Rows carry GRPO-like tags (uid groups of 8, version, seqlen).
"""

from __future__ import annotations

import time

import numpy as np

from benchmarks.workloads.common import Row, Shapes
from tq_stream.controller import Controller
from tq_stream.samplers import (
    GroupSampler,
    SeqlenBalancedSampler,
    SequentialSampler,
    StalenessSampler,
)

SCHEMA = {"kind": "dense", "dtype": "float32", "shape": [1]}
CHUNK = 100_000


def _fill(ctrl: Controller, n: int, fields: list[str]) -> None:
    rng = np.random.default_rng(0)
    schemas = {f: SCHEMA for f in fields}
    for start in range(0, n, CHUNK):
        keys = [f"r{i}" for i in range(start, min(n, start + CHUNK))]
        place = ctrl.reserve("p", keys, schemas, timeout=60)
        lens = rng.integers(1, 4096, len(keys)).tolist()
        tags = [{"uid": (start + i) // 8, "version": 0, "seqlen": s}
                for i, s in enumerate(lens)]
        ctrl.commit("p", place.index, place.generation, schemas, tags)


SAMPLERS = {
    "Sequential": (lambda: SequentialSampler(), 1),
    "Group(8)": (lambda: GroupSampler(8), 1),
    "Staleness(Group(8))": (lambda: StalenessSampler(GroupSampler(8), max_staleness=1), 1),
    "SeqlenBalanced(Group(8)), dp=8": (lambda: SeqlenBalancedSampler(GroupSampler(8)), 8),
}


def run(shapes: Shapes) -> list[Row]:
    rows: list[Row] = []
    fields = [f"f{i}" for i in range(shapes.scale_fields)]
    for n in shapes.scale_rows:
        ctrl = Controller()
        t = time.perf_counter()
        _fill(ctrl, n, fields)
        fill_s = time.perf_counter() - t
        for i, (name, (make, dp)) in enumerate(SAMPLERS.items()):
            task = f"t{i}"
            ctrl.register_task("p", task, fields, batch_size=1024 // dp, dp_size=dp,
                               sampler=make())
            ctrl.set_version("p", task, 0)
            times = []
            for step in range(max(3, shapes.repeats)):
                t = time.perf_counter()
                for r in range(dp):
                    ctrl.get_meta("p", task, step, dp_rank=r, timeout=10)
                times.append(time.perf_counter() - t)
            rows.append(Row("controller scale", f"get_meta 1024 of {n:,} rows, {name}",
                            "tq_stream controller", float(np.median(times)) * 1e3, "ms"))
        extra = [f"x{i}" for i in range(1024)]
        tags = [{"uid": n + i // 8, "version": 0, "seqlen": 100} for i in range(1024)]
        place = ctrl.reserve("p", extra, {fields[0]: SCHEMA}, timeout=10)
        t = time.perf_counter()
        ctrl.commit("p", place.index, place.generation, {fields[0]: SCHEMA}, tags)
        rows.append(Row("controller scale", f"mark 1024 rows ready, {n:,} rows",
                        "tq_stream controller", (time.perf_counter() - t) * 1e3, "ms",
                        {"fill_s": fill_s}))
    return rows
