"""Consuming: the consumer's calls — get_meta, ack, release, renew, resume, cancel.

Leases are held by consumer *sessions* (a random id per loader iteration or per
client) and kept alive by their heartbeat (``renew(session=...)``); see
``task.py`` for what a claim is and ``delivery.py`` for how a step is found.
A waiting ``get_meta`` is one wait on the controller's condition, woken by
acks, clears, version changes and closes (and by row changes as below), and ended
early by ``cancel(session)`` when its loader stops. A call that makes rows ready (a commit,
a release, a tag change) forms the waiters' steps itself and gives each reply to
the ``reply`` handle the waiting request's server handed its ``get_meta``
(``waiters.py``, ``tq_stream.handling``); it wakes only the waiters it could not
answer that way (a waiter it found no step for is not woken: it would only repeat
that try). On a server's IO thread it forms steps only
for the default sampler on an open partition, and small steps (``_forms_inline``).

The Controller hands ``Consuming`` the book (partitions, tasks, the condition),
the delivery rules, the waiters and the timings; its public methods hand over here.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from tq_stream.controller.book import Book
from tq_stream.controller.delivery import Delivery
from tq_stream.controller.partition import PartitionMeta
from tq_stream.controller.reservations import WRITER_TASK
from tq_stream.controller.task import TaskState
from tq_stream.controller.task_config import MAX_REPLICAS
from tq_stream.controller.timings import Timings
from tq_stream.controller.wait_errors import wait_error, waiting_for
from tq_stream.controller.waiters import Waiter, Waiters
from tq_stream.errors import (
    ConfigError,
    LeaseError,
    TurnNotReached,
    check_positive,
    check_replica,
    check_timeout,
    format_seconds,
)
from tq_stream.handling import ANSWERED, Reply, WouldBlock, may_block
from tq_stream.messages.reads import Resume, StepMeta
from tq_stream.samplers.sequential import SequentialSampler

MAX_CANCELLED = 1024  # cancelled sessions remembered (their late waits return None)


def _check_ids(state: TaskState, dp_rank: Any, replica: Any) -> None:
    cfg = state.config
    if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or \
            not 0 <= dp_rank < cfg.dp_size:
        raise ConfigError(f"dp_rank must be an int in [0, {cfg.dp_size}), got {dp_rank!r}")
    if isinstance(replica, bool) or not isinstance(replica, int) or \
            not 0 <= replica < cfg.replicas:
        raise ConfigError(f"replica must be an int in [0, {cfg.replicas}) (replicas="
                          f"{cfg.replicas} of task {state.name!r}), got {replica!r}")


MAX_INLINE_STEP = 64  # rows of a step a commit on a server's IO thread may form


def _forms_inline(part: PartitionMeta, state: TaskState) -> bool:
    """A commit running on a server's IO thread (``may_block()`` False) may form this
    waiter's step: the default sampler on an open partition never discards rows, so
    forming it frees no storage (a call to the units) and runs no user sampler code;
    and a small step is formed and encoded in well under a millisecond (8192 rows with
    tags take ~14 ms, which would hold every other caller of the server)."""
    cfg = state.config
    return type(state.sampler) is SequentialSampler and not part.closed and \
        cfg.batch_size * cfg.dp_size <= MAX_INLINE_STEP


def check_session(name: str, value: Any) -> str:
    if not isinstance(value, str) or len(value) > 256:
        raise ConfigError(f"{name} must be a str of at most 256 characters, got {value!r:.80}")
    return value


class Consuming:
    """The consumer's calls (see the module docstring)."""

    def __init__(self, book: Book, delivery: Delivery, waiters: Waiters,
                 timings: Timings) -> None:
        self._book = book
        self._delivery = delivery
        self._waiters = waiters  # the get_meta calls waiting (waiters.py)
        self._timings = timings  # waits measured, slow ones logged
        self._cancelled: dict[str, float] = {}  # consumer sessions told to stop waiting

    def get_meta(self, partition: str, task: str, step: int | None = None, dp_rank: int = 0,
                 timeout: float = 60.0, replica: int | None = None, session: str = "",
                 consumer: str = "", reply: Reply[StepMeta] | None = None) -> StepMeta | None:
        """The rows of ``step`` for ``dp_rank`` (``step=None``: the next batch for this
        consumer, see ``delivery.py``); waits for enough ready rows.

        Args:
            replica: which TP/PP peer of ``dp_rank`` reads (each acks for itself);
                required when the task has ``replicas > 1``. A (step, rank, replica)
                claimed by another live session is waited for, and refused at the
                timeout (ConfigError naming ``replica``).
            session: the reading session; its heartbeat keeps the lease alive, and
                ``cancel(session)`` ends this wait (and its claims: a new session may
                take them over).
            consumer: a stable name of a stage worker (``step=None``): a restarted
                worker of that name first gets back what its dead earlier session held
                (once that lease expired); a live session's share never goes to another.
            reply: the reply handle of the request this call serves, from its server
                (its table's ``replies``; never a caller's): a commit that forms this call's
                step while it waits gives the reply there, and this call returns
                ``ANSWERED``. None (a direct call): the call returns the step itself.
        Returns:
            a BatchMeta as a dict (``end=True`` once a closed partition is drained),
            ``ANSWERED`` once a commit gave its reply to ``reply``, or None if
            ``session`` was cancelled while waiting.
        Raises:
            WaitTimeout: not enough ready rows within ``timeout`` seconds.
        """
        if step is not None:
            check_positive("step", step, allow_zero=True)
        check_timeout("timeout", timeout)
        check_session("session", session)
        check_session("consumer", consumer)
        deadline = time.monotonic() + timeout
        with self._book.cond:
            part, state = self._book.task(partition, task)
            replica = check_replica(replica, state.config.replicas)
            _check_ids(state, dp_rank, replica)
            waiter = Waiter(state, (step, dp_rank, replica, session, consumer),
                            deadline - timeout, deadline, reply)
            return self._wait_step(part, state, waiter, timeout)

    def _wait_step(self, part: PartitionMeta, state: TaskState, waiter: Waiter,
                   timeout: float) -> StepMeta | None:
        """``get_meta``'s tries and waits (lock held): the reply, ``ANSWERED`` once a
        commit answered it, or None if the session was cancelled. While it waits it is
        registered as a waiter: a commit that makes rows ready forms the step in its own
        thread and answers (waiters.py)."""
        step, dp_rank, replica, session, consumer = waiter.args
        registered = False
        try:
            while True:
                if session and session in self._cancelled:
                    return None
                self._book.abort_reservations()  # a dead producer's rows must not hold the end
                meta = self._delivery.try_step(part, state, step, dp_rank, replica, session,
                                               consumer)
                if meta is not None:
                    self._timings.waited(part.name, state.name, waiter.since)
                    return meta
                left = waiter.deadline - time.monotonic()
                if left <= 0 and state.awaits_turn(step, session, self._book.clock(), timeout):
                    what = waiting_for(part, state, step, dp_rank, self._book.clock())
                    raise TurnNotReached(
                        f"get_meta waited timeout={format_seconds(timeout)} on partition "
                        f"{part.name!r} for {what}; the trainer is alive on an earlier "
                        f"step and moved on within the timeout: ask again")
                if left <= 0:
                    raise wait_error(self._delivery, self._book.parts, part, state, waiter.args,
                                     timeout, self._book.clock())
                if not registered:
                    self._waiters.add(part.name, waiter)
                    registered = True
                    if step is None and state.ended:
                        self._book.cond.notify_all()  # others at the end need not wait for us
                self._timings.wait(self._book.cond, min(left, self._next_wake(state)),
                                   waiter.since, "get_meta", part.name,
                                   lambda: waiting_for(part, state, step, dp_rank,
                                                       self._book.clock()))
                if waiter.meta is not None:  # formed by a commit: sent, or ours to send
                    return ANSWERED if waiter.given else waiter.meta
                self._book.check_open()
        finally:
            if registered:
                self._waiters.remove(part.name, waiter)

    def _answer_waiters(self, part: PartitionMeta) -> bool:
        """Rows of ``part`` became ready: form the step of each waiter that now has one,
        here, and give it to its server (waiters.py). Lock held. True when the waiters
        must be woken now: a step formed here could not be given (its waiter returns
        it), a waiter's try raised (it raises it itself), or a waiter was left to its
        own worker. Waiters answered here are woken once their replies were sent
        (``Waiters.wake``); a waiter this call found nothing for is not woken at all
        (it would only repeat the same try)."""
        waiting = self._waiters.of(part.name)
        now = time.monotonic()
        wake_now = False
        inline = not may_block()
        for waiter in waiting:
            step, dp_rank, replica, session, consumer = waiter.args
            if waiter.meta is not None or waiter.deadline <= now or \
                    (session and session in self._cancelled):
                continue
            if inline and not _forms_inline(part, waiter.state):
                wake_now = True  # its own worker forms the step (and frees what it drops)
                continue
            try:
                meta = self._delivery.try_step(part, waiter.state, step, dp_rank, replica,
                                               session, consumer)
            except Exception:  # noqa: BLE001 — the waiter tries again and raises it itself
                wake_now = True
                continue
            if meta is not None:
                self._timings.waited(part.name, waiter.state.name, waiter.since)
                waiter.meta = meta
                waiter.given = waiter.reply is not None and \
                    waiter.reply.give(meta, self._waiters.wake)
                wake_now = wake_now or not waiter.given
        return wake_now

    def rows_ready(self, part: PartitionMeta) -> None:
        """Rows of ``part`` may have become ready: answer the waiters that can take
        them, and wake the waiters that must look themselves (``_answer_waiters``);
        the others are woken once the replies given were sent (a thread woken earlier
        would compete with the send). Lock held."""
        if self._answer_waiters(part):
            self._book.cond.notify_all()

    def _next_wake(self, state: TaskState) -> float:
        soonest = min(state.soonest_expiry(), self._book.reservations.soonest())
        return max(0.01, min(60.0, soonest - self._book.clock()))

    def ack(self, partition: str, task: str, step: int, dp_rank: int, index: np.ndarray,
            generation: np.ndarray, replica: int = 0, session: str = "") -> int:
        """Replica ``replica`` of ``dp_rank`` is done with rows; returns how many became
        ACKED (every replica acked them). Acking twice is a no-op. Freeing storage
        happens afterwards and never fails the ack. With ``session`` (the reader the
        rows were handed to), an ack whose lease lapsed and went to another reader since
        is refused with LeaseTakenOver (``takeovers.py``)."""
        check_session("session", session)
        with self._book.cond:
            part, state = self._book.task(partition, task)
            _check_ids(state, dp_rank, replica)
            state.takeovers.check((step, dp_rank, replica), session, task, "acks")
            if step not in state.steps and 0 <= step < state.next_step:
                return 0  # every rank acked the step already: an ack sent again
            rows = self._delivery.held_rows(part, state, step, dp_rank, index, generation, "ack")
            if self._book.journal is not None and len(rows):  # durable before the reply
                self._book.journal.acked(partition, task, step, dp_rank, replica, rows,
                                    part.generation[rows])
            done = self._delivery.ack_rows(state, step, dp_rank, replica, rows)
            freed = self._book.finish_rows(part, done)
            self._book.cond.notify_all()
        self._book.free_slots(partition, freed)
        return len(done)

    def release(self, partition: str, task: str, step: int, dp_rank: int, index: np.ndarray,
                generation: np.ndarray, replica: int = 0, session: str = "") -> None:
        """Give up reading (step, dp_rank) for now: the share is handed, unchanged, to
        the next reader of that step and rank (or of "the next batch"). With
        ``session``, only that session's own claim is dropped: a release by a reader
        whose claim another session took over since is a LeaseError (the share is
        the other reader's now)."""
        with self._book.cond:
            part, state = self._book.task(partition, task)
            _check_ids(state, dp_rank, replica)
            self._delivery.held_rows(part, state, step, dp_rank, index, generation, "release")
            claims = state.steps[step].claims
            claim = claims.get((dp_rank, replica))
            if claim is not None and session and claim.session != session:
                raise LeaseError(
                    f"session must hold the claim it releases: step {step} of task "
                    f"{task!r} (rank {dp_rank}, replica {replica}) is held by session "
                    f"{claim.session[:12]} now, got session={session[:12]!r} (its claim "
                    f"lapsed and another reader took the share over)")
            if claims.pop((dp_rank, replica), None) is not None and session:
                state.takeovers.lapsed((step, dp_rank, replica), session)
            self.rows_ready(part)

    def renew(self, partition: str, task: str, step: int | None = None,
              session: str = "") -> int:
        """Keep leases alive: every claim of ``session`` (the heartbeat), or, with
        ``step``, the claims of ``session`` on that step (another session's claim on it,
        a peer replica's, is its own to renew: a LeaseError if ``session`` has none).
        Returns how many claims were renewed.
        ``task=""`` is a producer's heartbeat: it renews the rows ``session`` reserved
        on ``partition`` and not committed yet (returns how many)."""
        check_session("session", session)
        with self._book.cond:
            if task == WRITER_TASK:
                now = self._book.clock()
                return self._book.reservations.renew(partition, session, now) + \
                    self._book.pins.renew(partition, session, now)
            _, state = self._book.task(partition, task)
            now = self._book.clock()
            if step is None:
                return state.renew(session, now)
            rec = state.steps.get(step)
            if rec is None or rec.end:
                raise self._delivery.no_lease(state, step, "renew")
            mine = [c for c in rec.claims.values() if c.session == session]
            if not mine:
                raise LeaseError(
                    f"renew needs a claim of the calling session on step {step} of task "
                    f"{state.name!r}, got session={session[:12]!r}, which holds none (its "
                    f"claim expired or was released, and another reader may hold the "
                    f"share now)")
            for c in mine:
                c.expiry, c.renewed = now + state.config.lease_timeout, now
            state.renewed += len(mine)
            return len(mine)

    def first_unfinished(self, partition: str, task: str, dp_rank: int = 0,
                         replica: int | None = None) -> Resume:
        """Where a reader of ``dp_rank`` resumes: the first step not acked by every
        replica (or by ``replica``), and later steps already done (``Resume``)."""
        with self._book.cond:
            _, state = self._book.task(partition, task)
            _check_ids(state, dp_rank, 0 if replica is None else replica)
            return state.first_unfinished(dp_rank, replica)

    def cancel(self, session: str) -> None:
        """End every wait of ``session`` now (its get_meta returns None) and every claim
        it holds: its shares go to the next reader of their step and rank (counted in
        the task's ``cancelled``; a restarted worker of its consumer name first). Later
        waits of that session return None at once, for as long as the controller
        remembers it (the last ``MAX_CANCELLED`` cancelled sessions: a call racing the
        cancel). Rows a producer ``session`` reserved and did not commit are aborted
        (``reservations.py``)."""
        check_session("session", session)
        if not session:
            raise ConfigError("session must be a non-empty str to cancel, got ''")
        with self._book.cond:
            if self._book.reservations.held_by(session):
                if not may_block():
                    raise WouldBlock  # frees storage through the units: a worker thread
                self._book.abort_reservations(session)
            for tasks in self._book.tasks.values():
                for state in tasks.values():
                    state.cancel(session)
            self._cancelled[session] = time.monotonic()
            while len(self._cancelled) > MAX_CANCELLED:
                self._cancelled.pop(next(iter(self._cancelled)))
            self._book.cond.notify_all()


__all__ = ["Consuming", "MAX_REPLICAS"]
