"""AdmissionLogic: pacing producers so that their work does not go stale.

For every task on a partition whose sampler bounds staleness (it has an
``admission_limit(held, rows_per_version)`` method, like StalenessSampler) and
whose consumer has set a policy version, ``admit`` lets producers start ``n``
more rows only while every such task allows it:

    held = rows admitted so far - rows the task consumed (acked or discarded)
    n <= sampler.admission_limit(held, rows_per_version)

``rows_per_version`` is the task's global batch (batch_size x dp_size) times
its ``steps_per_version`` (1 unless set with ``set_admission``). The wait is
woken by acks, discards and version updates; it is bounded by ``timeout``.
Producers that write without ``reserve`` are not counted.
"""

from __future__ import annotations

import time
from typing import Any

from tq_stream.errors import WaitTimeout, check_positive, check_timeout, format_seconds
from tq_stream.handling import WouldBlock, may_block


class AdmissionLogic:
    """Mixin of Controller; see the module docstring."""

    def _admission_room(self, partition: str) -> tuple[int | None, str]:
        """Rows producers may still start (None: unbounded) and the binding task."""
        room: int | None = None
        who = ""
        part = self._parts.get(partition)  # type: ignore[attr-defined]
        admitted = part.admitted if part is not None else 0
        for name, task in self._tasks.get(partition, {}).items():  # type: ignore[attr-defined]
            limit = getattr(task.sampler, "admission_limit", None)
            if limit is None or task.version is None:
                continue
            consumed = task.acked + sum(task.discards.values())
            rows_per_version = (task.config.batch_size * task.config.dp_size
                                * task.steps_per_version)
            left = limit(max(0, admitted - consumed), rows_per_version)
            if room is None or left < room:
                room, who = left, name
        return room, who

    def admit(self, partition: str, n: int, timeout: float = 60.0) -> int:
        """Block until ``n`` more rows may be started on ``partition``; returns ``n``.

        Raises:
            WaitTimeout: the staleness window stayed full for ``timeout`` seconds.
        """
        check_positive("n", n)
        check_timeout("timeout", timeout)
        deadline = time.monotonic() + timeout
        with self._cond:  # type: ignore[attr-defined]
            part = self._part(partition, create=True)  # type: ignore[attr-defined]
            while True:
                room, who = self._admission_room(partition)
                if room is None or n <= room:
                    part.admitted += n
                    return n
                if not may_block():
                    raise WouldBlock  # nothing admitted yet: a worker thread waits
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WaitTimeout(
                        f"reserve of n={n} rows on partition {partition!r} waited "
                        f"timeout={format_seconds(timeout)}: the staleness window of task "
                        f"{who!r} has room "
                        f"for {room} rows; its consumer must ack rows or advance its version"
                    )
                self._timings.wait(self._cond, left, deadline - timeout, "admission", partition, f"task {who!r} has room for {room} rows")  # type: ignore[attr-defined]  # noqa: E501

    def set_admission(self, partition: str, task: str, steps_per_version: int) -> None:
        """How many steps the task's consumer takes per policy version (default 1)."""
        check_positive("steps_per_version", steps_per_version)
        with self._cond:  # type: ignore[attr-defined]
            self._task(partition, task)[1].steps_per_version = steps_per_version  # type: ignore[attr-defined]
            self._cond.notify_all()  # type: ignore[attr-defined]

    def admission(self, partition: str) -> dict[str, Any]:
        """Rows admitted so far and the room left (None: no staleness-bound task)."""
        with self._cond:  # type: ignore[attr-defined]
            part = self._part(partition)  # type: ignore[attr-defined]
            room, who = self._admission_room(partition)
            return {"admitted": part.admitted, "room": room, "task": who}
