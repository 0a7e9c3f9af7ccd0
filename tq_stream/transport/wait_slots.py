"""WaitSlots: how many requests that may wait long run at once on a server's workers.

A long-poll (a consumer's ``get_meta``, a producer's ``reserve`` at capacity) holds
one worker thread until its condition holds. A server whose every worker sat in a
consumer's long-poll could not run the producer's put or the ack that would end
those waits: with more waiting consumers than workers (140 consumers, 128 workers)
the stream stopped until the waits timed out, and most consumers got WaitTimeout
although their rows had arrived.

So a handler names the methods that may wait and their class
(its ``RPC_TABLE``'s ``waits = {"get_meta": "consume", "reserve": "produce", ...}``), and a server
caps how many of each class run at once (``caps``); the workers left over always
serve the calls that never wait. A request over its class's cap is *parked*: it
holds no thread, and it runs, in arrival order, as soon as a request of its class
finishes. Its wait is shortened by the time it was parked (``resumed``), so the
caller's timeout still counts from its arrival.

Invariants: at most ``caps[c]`` requests of class ``c`` run at once; a parked
request is either in its class's queue or handed to exactly one worker (with its
slot); parked requests are bounded by the server's own bounds (one per connection,
or its backlog).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Mapping
from typing import Any

from tq_stream.errors import ConfigError, check_positive

MIN_WAIT = 0.001  # seconds a resumed wait still gets when its parking used up its timeout


class WaitSlots:
    """Caps per wait class; thread-safe.

    Args:
        classes: method name -> wait class (the ``waits`` of the handler's ``RPC_TABLE``).
        caps: wait class -> requests of that class that may run at once; a class
            without a cap is not limited.
    """

    def __init__(self, classes: Mapping[str, str], caps: Mapping[str, int] | None) -> None:
        caps = dict(caps or {})
        unknown = sorted(set(caps) - set(classes.values()))
        if unknown:
            raise ConfigError(f"wait_caps must name wait classes of the handler "
                              f"{sorted(set(classes.values()))}, got {unknown}")
        for name, cap in caps.items():
            check_positive(f"wait_caps[{name!r}]", cap)
        self._class = {m: c for m, c in classes.items() if c in caps}  # capped methods only
        self._caps = caps
        self._running = dict.fromkeys(caps, 0)
        self._parked: dict[str, collections.deque[Any]] = {c: collections.deque() for c in caps}
        self._lock = threading.Lock()

    def take(self, method: str, item: Any) -> bool:
        """True: run ``method`` now (a slot was taken, give it back with ``release``);
        False: ``item`` is parked, and ``release`` hands it out later."""
        cls = self._class.get(method)
        if cls is None:
            return True
        with self._lock:
            if self._running[cls] < self._caps[cls]:
                self._running[cls] += 1
                return True
            self._parked[cls].append(item)
            return False

    def release(self, method: str) -> Any | None:
        """A request of ``method`` finished: its slot goes to the oldest parked item of
        its class, which is returned (the caller runs it), or is freed (None)."""
        cls = self._class.get(method)
        if cls is None:
            return None
        with self._lock:
            if self._parked[cls]:
                return self._parked[cls].popleft()  # the slot passes to it
            self._running[cls] -= 1
            return None

    def parked(self) -> int:
        """Requests parked now (a snapshot)."""
        with self._lock:
            return sum(len(q) for q in self._parked.values())

    def drain(self) -> list[Any]:
        """Every parked item, no longer parked (the server is closing)."""
        with self._lock:
            items = [i for q in self._parked.values() for i in q]
            for q in self._parked.values():
                q.clear()
            return items


def resumed(request: tuple[int, str, dict[str, Any], float],
            received: float) -> tuple[int, str, dict[str, Any], float]:
    """``request`` (``(id, method, args, timeout)``) with its ``timeout`` argument, if it
    has one, shortened by the time since ``received`` (it was parked meanwhile)."""
    req_id, method, args, timeout = request
    wait = args.get("timeout")
    if isinstance(wait, int | float) and not isinstance(wait, bool):
        left = max(MIN_WAIT, wait - (time.monotonic() - received))
        args = {**args, "timeout": left}
    return req_id, method, args, timeout
