"""Prefetch threads stopped before the interpreter finalizes.

A script that ends while it holds a loader iterator leaves its prefetch thread
running; it is a daemon thread, often inside a torch op reading the next batch. When
finalization begins, a daemon thread that takes the GIL back exits at once by a
forced unwind of its stack, and through torch's C++ frames that aborts the process
("terminate called without an active exception", about 1 run in 4). An atexit hook
(registered with the first thread, so it runs before the deployment's own shutdown)
stops every live prefetch thread first: it sets its stop event, cancels its
session's wait, and joins it for up to ``JOIN`` seconds in all.
"""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Callable

JOIN = 10.0  # seconds, for all threads together

_live: dict[int, tuple[threading.Event, threading.Thread, Callable[[], None]]] = {}
_hooked: list[bool] = []


def track(stop: threading.Event, thread: threading.Thread,
          cancel: Callable[[], None]) -> None:
    """Stop ``thread`` (``stop.set()``, ``cancel()``) at exit unless untracked before."""
    _live[id(thread)] = (stop, thread, cancel)
    if not _hooked:
        atexit.register(stop_all)
        _hooked.append(True)


def untrack(thread: threading.Thread) -> None:
    _live.pop(id(thread), None)


def stop_all() -> None:
    """Stop every tracked thread and wait for them (bounded by ``JOIN``)."""
    items = list(_live.values())
    _live.clear()
    for stop, _, cancel in items:
        stop.set()
        try:
            cancel()
        except Exception:  # noqa: BLE001 — a closed stream: nothing waits any more
            pass
    deadline = time.monotonic() + JOIN
    for _, thread, _ in items:
        thread.join(max(0.0, deadline - time.monotonic()))
