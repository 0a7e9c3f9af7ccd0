"""Timings: what the controller measures for metrics, beside its row counters.

Fixed-bucket histograms (numpy counters, one per partition and task) of

- ``get_meta_wait``: seconds a ``get_meta`` call waited before its rows were ready
  (one call per wait in every mode: a long-poll across processes);
- ``write_to_handout``: seconds from a row's last field write to its hand-out;

counters of the seconds writers spent blocked (per partition and reason:
``capacity`` in ``reserve``, ``admission`` in ``admit``, ``memory_budget`` as the writer
reports its pauses on its next ``reserve``: a unit refused its bytes), and a per-task rate
window. Everything is reported through ``Controller.stats()``; the controller calls
these hooks with its lock held, so nothing here takes a lock of its own.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

# Upper bounds (seconds) of the histogram buckets; the last bucket is +Inf.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
           30.0, 60.0, 300.0)
_BOUNDS = np.asarray(BUCKETS)
RATE_WINDOW = 60.0  # seconds the rates in stats() average over
SLOW_WAIT = 10.0  # a wait longer than this many seconds is logged at WARNING


class Histogram:
    """Counts of observations per bucket of ``BUCKETS`` (not cumulative), and their sum."""

    def __init__(self) -> None:
        self.counts = np.zeros(len(BUCKETS) + 1, dtype=np.int64)
        self.sum = 0.0

    def observe(self, seconds: np.ndarray | float) -> None:
        if isinstance(seconds, float):  # one value (a get_meta wait): no numpy call
            self.counts[bisect_left(BUCKETS, seconds)] += 1
            self.sum += seconds
            return
        values = np.asarray(seconds, dtype=np.float64)
        if len(values):
            where = np.searchsorted(_BOUNDS, values, side="left")
            self.counts += np.bincount(where, minlength=len(self.counts))
            self.sum += float(values.sum())

    def stats(self) -> dict[str, Any]:
        return {"buckets": list(BUCKETS), "counts": self.counts.tolist(), "sum": self.sum,
                "count": int(self.counts.sum())}


class Timings:
    """The controller's measurements (see module docstring)."""

    def __init__(self, slow_wait: float = SLOW_WAIT) -> None:
        self.slow_wait = slow_wait  # a wait this long is logged at WARNING
        self.waits: dict[tuple[str, str], Histogram] = defaultdict(Histogram)
        self.handouts: dict[tuple[str, str], Histogram] = defaultdict(Histogram)
        self.blocked: dict[str, dict[str, float]] = defaultdict(
            lambda: {"capacity": 0.0, "admission": 0.0, "memory_budget": 0.0})
        self._samples: dict[tuple[str, str], deque[tuple[float, int, int]]] = \
            defaultdict(lambda: deque(maxlen=128))

    # -- hooks (each one line in the controller)
    def waited(self, partition: str, task: str, since: float) -> None:
        """A get_meta call that started at monotonic ``since`` returns its rows."""
        self.waits[partition, task].observe(max(0.0, time.monotonic() - since))

    def handed_out(self, partition: str, task: str, write_time: np.ndarray | float,
                   now: float) -> None:
        """Rows last written at ``write_time`` (epoch seconds; one float for one row) are
        handed out at ``now``."""
        late = now - write_time
        # One row (a batch of one): a float observation, no numpy maximum/searchsorted.
        self.handouts[partition, task].observe(
            max(0.0, float(late)) if type(late) is not np.ndarray else np.maximum(0.0, late))
        if (partition, task) not in self._samples:  # rates count from the first hand-out
            self._samples[partition, task].append((now, 0, 0))

    def wait(self, cond: Any, left: float, since: float, reason: str, partition: str,
             what: str | Callable[[], str] = "") -> None:
        """``cond.wait(left)`` for a writer (reason "capacity"/"admission") or a consumer
        (reason "get_meta"), which started waiting at monotonic ``since``: counts a
        writer's blocked seconds and warns once when the wait passes ``slow_wait``."""
        before = time.monotonic()
        warn_at = since + self.slow_wait
        if before < warn_at:
            left = min(left, max(0.001, warn_at - before))  # wake to warn on time
        cond.wait(left)
        after = time.monotonic()
        if reason != "get_meta":
            self.blocked[partition][reason] += after - before
        if before < warn_at <= after:  # ``what`` may be costly: built only to warn
            logger.warning("%s on partition %r has waited %.1f s (%s)", _WHO[reason],
                           partition, after - since, (what() if callable(what) else what)
                           or reason)

    def paused(self, partition: str, reason: str, seconds: float) -> None:
        """A writer reports ``seconds`` it paused itself (reason "memory_budget")."""
        self.blocked[partition][reason] += seconds

    # -- reading
    def rates(self, partition: str, task: str, handed_out: int, acked: int,
              now: float) -> dict[str, float]:
        """Rows per second handed out and acked over about the last ``RATE_WINDOW`` s
        (or since the task's first hand-out, when that is more recent)."""
        samples = self._samples[partition, task]
        if not samples or now - samples[-1][0] >= 1.0:
            samples.append((now, handed_out, acked))
        while len(samples) > 1 and now - samples[0][0] > RATE_WINDOW:
            samples.popleft()
        t0, h0, a0 = samples[0]
        dt = now - t0
        if dt <= 0:
            return {"handed_out": 0.0, "acked": 0.0}
        return {"handed_out": (handed_out - h0) / dt, "acked": (acked - a0) / dt}

    def task_stats(self, partition: str, task: str) -> dict[str, Any]:
        return {"get_meta_wait": self.waits[partition, task].stats(),
                "write_to_handout": self.handouts[partition, task].stats()}

    def blocked_seconds(self, partition: str) -> dict[str, float]:
        return dict(self.blocked[partition])


_WHO = {"capacity": "a writer blocked at capacity", "admission": "a writer's reserve",
        "get_meta": "a consumer's get_meta"}
