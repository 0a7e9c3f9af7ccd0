"""What ``Controller.stats()`` adds to its counters: measurements and derived figures
(lock held). The full shapes are documented in ``tq_stream.stats``."""

from __future__ import annotations

from typing import Any

from tq_stream.controller.partition import PartitionMeta
from tq_stream.controller.task import TaskState
from tq_stream.controller.timings import Timings
from tq_stream.controller.waiting import leases, not_ready


def oldest_ready_age(part: PartitionMeta, state: TaskState, now: float) -> float:
    """Seconds since the oldest row available to ``state`` got its last field (0: none)."""
    n = min(part.size, len(state.queue.avail))
    times = part.write_time[:n][state.queue.avail[:n]]
    return max(0.0, now - float(times.min())) if len(times) else 0.0


def add_measurements(out: dict[str, Any], part: PartitionMeta, tasks: dict[str, TaskState],
                     timings: Timings, now: float) -> None:
    """Add to one partition's ``stats()`` entry (``out``, its counters already in):
    rows created, writers' blocked seconds, and per task the lease counters (0 when the
    task keeps none), rates, the oldest ready row's age, the timing histograms, the
    rows not ready and what they lack, and the claims on its shares."""
    out["rows_created"] = int(part.next_created)
    out["blocked_seconds"] = timings.blocked_seconds(part.name)
    for name, task in out["tasks"].items():
        state = tasks[name]
        for key in ("renewed", "expired", "cancelled", "redelivered"):
            task.setdefault(key, 0)
        task["at"] = now
        task["oldest_ready_age"] = oldest_ready_age(part, state, now)
        task["rates"] = timings.rates(part.name, name, state.handed_out, state.acked, now)
        task.update(timings.task_stats(part.name, name))
        task["not_ready"] = not_ready(part, state)
        task["leases"] = leases(state, now)
