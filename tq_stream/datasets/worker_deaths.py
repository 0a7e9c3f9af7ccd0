"""A DataLoader worker's death, told by the loader instead of by the training step.

torch installs a SIGCHLD handler that raises ``RuntimeError: DataLoader worker (pid
...) is killed by signal`` in whatever the main thread runs when a worker dies: most
often the user's own training step, between two batches. ``guard()`` wraps that
handler once (main thread only): while some loader iteration has a batch out in the
training loop (``Deferral.out``), the error is kept for that iteration instead of
raised; the loader raises it, as its ``StateError``, when the next batch is asked
for. With no batch out (the loader is inside its own fetch or ack) the handler
raises as torch's does, and the loader turns that into the same ``StateError``.
While a batch is out, the death of another (plain torch) DataLoader's worker is kept
too: that loader then finds it by its own liveness check (within
``MP_STATUS_CHECK_INTERVAL``, 5 s), and every tq loader with a batch out reports it.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

_deferrals: list[Deferral] = []  # iterations that have a batch out
_previous: list[Callable[..., Any]] = []  # the handler guard() wrapped (torch's)


class Deferral:
    """Worker-death errors signalled while this iteration's batch was out."""

    def __init__(self) -> None:
        self.errors: list[RuntimeError] = []

    def out(self, yes: bool) -> None:
        """The batch is (True) / is no longer (False) in the training loop."""
        if yes and self not in _deferrals:
            _deferrals.append(self)
        elif not yes and self in _deferrals:
            _deferrals.remove(self)

    def check(self) -> None:
        """Raise the first error kept while the batch was out, if any."""
        if self.errors:
            exc, self.errors = self.errors[0], []
            raise exc


def _handler(signum: int, frame: FrameType | None) -> None:
    try:
        _previous[0](signum, frame)
    except RuntimeError as exc:
        if not _deferrals:
            raise
        for d in _deferrals:
            d.errors.append(exc)


def guard() -> None:
    """Wrap the current SIGCHLD handler (torch's, set when workers start), once."""
    sigchld = signal.Signals.__members__.get("SIGCHLD")  # not on Windows
    if sigchld is None or threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(sigchld)
    if current is _handler or not callable(current):
        return
    _previous[:] = [current]
    signal.signal(sigchld, _handler)
