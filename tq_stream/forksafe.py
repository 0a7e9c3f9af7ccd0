"""ForkSafeLock: a lock a forked child can take although a thread of its parent held it.

``fork()`` copies a process's memory but only the thread that called it. A lock that
another thread held at that moment (a producer thread's put, a prefetch thread, the
lease heartbeat) stays held in the child by a thread that does not exist there, and
the child's first use of it waits forever. A DataLoader worker is such a child: torch
forks it while the trainer's own threads run. So every lock of the client side that a
forked child can reach is a ``ForkSafeLock``, which starts released in every child.

What these locks guard is either rebuilt per process (connection pools, spare rows,
the lease heartbeat: each checks the pid) or a cache whose worst state after a fork
is one entry too many or too few, so a child never needs the rest of the work a
parent's thread was doing when it forked.
"""

from __future__ import annotations

import os
import threading
import weakref


class ForkSafeLock:
    """A ``threading.Lock`` that is released again in a forked child (see module doc).

    Example:
        >>> lock = ForkSafeLock()
        >>> with lock:
        ...     cache[key] = value
    """

    __slots__ = ("__weakref__", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        _LOCKS.add(self)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def renew(self) -> None:
        """Replace the lock by a released one (in a forked child, where no other thread
        runs: whoever held the old one is gone)."""
        self._lock = threading.Lock()


_LOCKS: weakref.WeakSet[ForkSafeLock] = weakref.WeakSet()


def _renew_all() -> None:
    for lock in list(_LOCKS):
        lock.renew()


os.register_at_fork(after_in_child=_renew_all)
