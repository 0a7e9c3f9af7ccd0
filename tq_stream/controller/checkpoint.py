"""Controller metadata as plain data (dicts, lists, numpy arrays) and back.

The state of a task is restored when the task is registered again (its sampler
object comes from the resumed consumer; the sampler's own state is loaded into
it). Leases are kept: a resumed consumer asking for a step it had not acked
gets the same rows again; nobody asking lets the lease expire as usual.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import numpy as np

from tq_stream.columns import FieldSchema
from tq_stream.controller.partition import PartitionMeta
from tq_stream.controller.task import StepRecord, TaskConfig, TaskState
from tq_stream.errors import ConfigError

FORMAT = 1


def _part_state(part: PartitionMeta) -> dict[str, Any]:
    rows = np.flatnonzero(part.used)
    return {
        "capacity": part.capacity, "closed": part.closed,
        "schemas": {f: s.to_dict() for f, s in part.schemas.items()},
        "size": part.size, "rows": rows, "keys": part.keys[rows].tolist(),
        "unit": part.unit[rows], "slot": part.slot[rows],
        "generation": part.generation, "write_time": part.write_time[rows],
        "ready": {f: r[rows] for f, r in part.ready.items()},
        "tags": part.tags.state_dict(),
        "next_row": part._next_row, "free_rows": list(part._free_rows),
        "pools": [{"next": p.next, "free": list(p.free)} for p in part._pools],
    }


def _task_state(task: TaskState) -> dict[str, Any]:
    c = task.config
    return {
        "config": {"fields": list(c.fields), "batch_size": c.batch_size, "dp_size": c.dp_size,
                   "replicas": c.replicas, "lease_timeout": c.lease_timeout,
                   "drop_last": c.drop_last},
        "sampler": type(task.sampler).__name__, "sampler_state": task.sampler.state_dict(),
        "state": task.state, "acks": task.acks,
        "available": task.queue.ordered(),
        "steps": [{"step": s, "end": r.end, "done": list(r.done),
                   "shares": [None if x is None else x for x in r.shares]}
                  for s, r in task.steps.items()],
        "next_step": task.next_step, "ended": task.ended, "version": task.version,
        "discards": dict(task.discards), "handed_out": task.handed_out, "acked": task.acked,
    }


def controller_state(parts: dict[str, PartitionMeta],
                     tasks: dict[str, dict[str, TaskState]]) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "partitions": {n: _part_state(p) for n, p in parts.items()},
        "tasks": {n: {t: _task_state(s) for t, s in ts.items()} for n, ts in tasks.items()},
    }


def load_controller(state: dict[str, Any], n_units: int) -> tuple[dict, dict]:
    if state.get("format") != FORMAT:
        raise ConfigError(f"checkpoint format must be {FORMAT}, got {state.get('format')!r}")
    parts: dict[str, PartitionMeta] = {}
    for name, s in state["partitions"].items():
        if len(s["pools"]) != n_units:
            raise ConfigError(f"storage_units must be {len(s['pools'])} to restore this "
                              f"checkpoint, got {n_units}")
        part = PartitionMeta(name, s["capacity"], n_units)
        part.closed = s["closed"]
        part._grow_to(int(s["size"]))
        part.fix_schemas({f: FieldSchema.from_dict(d) for f, d in s["schemas"].items()})
        rows = np.asarray(s["rows"], dtype=np.int64)
        part.keys[rows] = s["keys"]
        part.used[rows] = True
        part.unit[rows] = s["unit"]
        part.slot[rows] = s["slot"]
        part.generation[:] = s["generation"]
        part.write_time[rows] = s["write_time"]
        for f, r in s["ready"].items():
            part.ready[f][rows] = r
        part.tags.load_state_dict(s["tags"])
        part.key_index = dict(zip(s["keys"], rows.tolist(), strict=True))
        part.live = len(rows)
        part._next_row, part._free_rows = int(s["next_row"]), list(s["free_rows"])
        for pool, ps in zip(part._pools, s["pools"], strict=True):
            pool.next, pool.free = int(ps["next"]), sorted(ps["free"])
        parts[name] = part
    return parts, {n: dict(ts) for n, ts in state["tasks"].items()}


def load_task(task: TaskState, s: dict[str, Any], part: PartitionMeta) -> None:
    """Fill a freshly registered ``task`` from its checkpointed state ``s``."""
    saved = TaskConfig(tuple(s["config"]["fields"]), **{
        k: v for k, v in s["config"].items() if k != "fields"})
    if saved != task.config:
        raise ConfigError(f"task {task.name!r} must be registered with its checkpointed "
                          f"settings {saved}, got {task.config}")
    if s["sampler"] != type(task.sampler).__name__:
        raise ConfigError(f"sampler of task {task.name!r} must be {s['sampler']} as "
                          f"checkpointed, got {type(task.sampler).__name__}")
    task.sampler.load_state_dict(s["sampler_state"])
    task.grow(part.size)
    task.state[: len(s["state"])] = s["state"]
    task.acks[: len(s["acks"])] = s["acks"]
    task.queue.push(np.asarray(s["available"], dtype=np.int64))
    expiry = time.time() + task.config.lease_timeout
    for st in s["steps"]:
        shares = [None if x is None else np.asarray(x, dtype=np.int64) for x in st["shares"]]
        task.steps[int(st["step"])] = StepRecord(
            shares, float("inf") if st["end"] else expiry, st["end"], list(st["done"]))
    task.next_step, task.ended, task.version = s["next_step"], s["ended"], s["version"]
    task.discards = Counter(s["discards"])
    task.handed_out, task.acked = s["handed_out"], s["acked"]


