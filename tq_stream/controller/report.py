"""The figures ``Controller.stats()`` returns, built from the controller's state
(lock held). Their shapes are documented in ``tq_stream.stats``."""

from __future__ import annotations

from typing import Any

from tq_stream.controller.partition import PartitionMeta
from tq_stream.controller.task import TaskState
from tq_stream.controller.timings import Timings
from tq_stream.stats import PartitionStats, TaskStats


def oldest_ready_age(part: PartitionMeta, state: TaskState, now: float) -> float:
    """Seconds since the oldest row available to ``state`` got its last field (0: none)."""
    n = min(part.size, len(state.queue.avail))
    times = part.write_time[:n][state.queue.avail[:n]]
    return max(0.0, now - float(times.min())) if len(times) else 0.0


def task_stats(part: PartitionMeta, state: TaskState, timings: Timings,
               now: float) -> TaskStats:
    out: dict[str, Any] = dict(state.stats())
    for key in ("renewed", "expired", "redelivered"):
        out.setdefault(key, 0)
    out["at"] = now
    out["oldest_ready_age"] = oldest_ready_age(part, state, now)
    out["rates"] = timings.rates(part.name, state.name, state.handed_out, state.acked, now)
    out.update(timings.task_stats(part.name, state.name))
    return out  # type: ignore[return-value]


def partition_stats(part: PartitionMeta, tasks: dict[str, TaskState], timings: Timings,
                    now: float) -> PartitionStats:
    return {
        "rows": part.live, "capacity": part.capacity, "closed": part.closed,
        "rows_created": int(part.next_created),
        "fields": {f: s.describe() for f, s in part.schemas.items()},
        "blocked_seconds": timings.blocked_seconds(part.name),  # type: ignore[typeddict-item]
        "tasks": {t: task_stats(part, s, timings, now) for t, s in tasks.items()},
    }
