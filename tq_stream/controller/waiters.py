"""Waiters: the get_meta calls waiting on each partition, so a commit can answer them.

A ``get_meta`` that finds no step registers a ``Waiter`` (what it asked for, until
when, and where its reply goes: the ``Reply`` handle its server handed it, see
``tq_stream.handling``) before it waits. A call that makes rows ready (a commit;
``Consuming._answer_waiters``) then tries each waiter of the partition, in the
order they came, and forms the step of each one it can, in its own thread. The formed
reply is given to the waiting request's server (``reply.give``), which sends it as
soon as the committing call returns and then calls ``Waiters.wake``; when it cannot
be given there (embedded mode, a call from outside a server: no handle, or a thread
of another server), the waiter returns it itself when it wakes. Either way the step
is formed once, under the controller's lock, exactly as the waiter would have formed
it.

Invariants: a waiter is registered only while its ``get_meta`` waits (it removes
itself on every way out), so the waiters of a partition are bounded by the
requests the servers let wait (their wait slots); ``meta`` is set at most once.
"""

from __future__ import annotations

import threading
from typing import Any

from tq_stream.handling import Reply
from tq_stream.messages.reads import StepMeta


class Waiter:
    """One waiting ``get_meta``: its arguments, deadline and reply address."""

    __slots__ = ("args", "deadline", "given", "meta", "reply", "since", "state")

    def __init__(self, state: Any, args: tuple[Any, ...], since: float, deadline: float,
                 reply: Reply[StepMeta] | None) -> None:
        self.state = state  # the task's TaskState
        self.args = args  # (step, dp_rank, replica, session, consumer) for ``Delivery.try_step``
        self.since = since  # when the call started (monotonic), for the wait histogram
        self.deadline = deadline  # monotonic; a later answer would come too late
        self.reply = reply  # the request's reply address, None outside a server
        self.meta: StepMeta | None = None  # the reply, once formed by a commit
        self.given = False  # the reply went to the server, the waiter returns ANSWERED


class Waiters:
    """Waiters per partition name (the controller's lock, the lock of ``cond``,
    guards every call but ``wake``)."""

    def __init__(self, cond: threading.Condition) -> None:
        self._cond = cond
        self._by_part: dict[str, list[Waiter]] = {}

    def wake(self) -> None:
        """Wake every waiting thread: the ``then`` of a reply given early, called by
        its server once the replies were sent, without the lock."""
        with self._cond:
            self._cond.notify_all()

    def add(self, partition: str, waiter: Waiter) -> None:
        self._by_part.setdefault(partition, []).append(waiter)

    def remove(self, partition: str, waiter: Waiter) -> None:
        waiting = self._by_part.get(partition)
        if waiting is not None and waiter in waiting:
            waiting.remove(waiter)
            if not waiting:
                del self._by_part[partition]

    def of(self, partition: str) -> list[Waiter]:
        """The partition's waiters, oldest first (a copy: answering removes none)."""
        return list(self._by_part.get(partition, ()))

    def sessions(self, partition: str, now: float) -> set[str]:
        """The sessions with a get_meta waiting on ``partition`` now (monotonic ``now``
        before its deadline): alive, whatever their heartbeat says."""
        return {w.args[3] for w in self._by_part.get(partition, ())
                if w.args[3] and w.deadline > now}

    def __len__(self) -> int:
        return sum(len(w) for w in self._by_part.values())
