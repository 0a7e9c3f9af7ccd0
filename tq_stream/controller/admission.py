"""Admission: pacing producers so that their work does not go stale.

For every task on a partition whose sampler bounds staleness (its
``admission_limit(held, rows_per_version)`` gives a number, like StalenessSampler's;
the base Sampler's gives None) and whose consumer has set a policy version, ``admit``
lets producers start ``n`` more rows only while every such task allows it:

    held = rows admitted so far - rows the task consumed (acked or discarded)
    n <= sampler.admission_limit(held, rows_per_version)

``rows_per_version`` is the task's global batch (batch_size x dp_size) times
its steps per version change (``TaskState.every``: set with ``set_admission``, else
the pace of the consumer's ``set_version`` calls, else 1). The wait is
woken by acks, discards and version updates; it is bounded by ``timeout``.
Producers that write without ``reserve`` are not counted.

The controller hands ``Admission`` what it works on: the book (partitions, tasks and
the condition whose lock guards them, ``book.py``) and the timings that measure
waits.
"""

from __future__ import annotations

import time

from tq_stream.controller.book import Book
from tq_stream.controller.timings import Timings
from tq_stream.errors import WaitTimeout, check_positive, check_timeout, format_seconds
from tq_stream.handling import WouldBlock, may_block
from tq_stream.messages.reads import AdmissionStatus


class Admission:
    """The staleness window of producers; see the module docstring."""

    def __init__(self, book: Book, timings: Timings) -> None:
        self._book = book
        self._cond = book.cond
        self._timings = timings

    def room(self, partition: str, admitted: int) -> tuple[int | None, str]:
        """Rows producers may still start (None: unbounded) and the binding task."""
        room: int | None = None
        who = ""
        for name, task in self._book.tasks.get(partition, {}).items():
            if task.version is None:
                continue
            consumed = task.acked + sum(task.discards.values())
            rows_per_version = (task.config.batch_size * task.config.dp_size
                                * (task.every() or 1))
            left = task.sampler.admission_limit(max(0, admitted - consumed), rows_per_version)
            if left is not None and (room is None or left < room):
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
        with self._cond:
            part = self._book.part(partition, create=True)
            while True:
                room, who = self.room(partition, part.admitted)
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
                self._timings.wait(self._cond, left, deadline - timeout, "admission",
                                   partition, f"task {who!r} has room for {room} rows")

    def set_steps_per_version(self, partition: str, task: str, steps_per_version: int) -> None:
        """How many steps the task's consumer takes per policy version (default 1)."""
        check_positive("steps_per_version", steps_per_version)
        with self._cond:
            self._book.task(partition, task)[1].steps_per_version = steps_per_version
            self._cond.notify_all()

    def status(self, partition: str) -> AdmissionStatus:
        """Rows admitted so far and the room left (None: no staleness-bound task)."""
        with self._cond:
            part = self._book.part(partition)
            room, who = self.room(partition, part.admitted)
            return AdmissionStatus(admitted=part.admitted, room=room, task=who)


__all__ = ["Admission"]
