"""ConsumingLogic: the consumer's calls — get_meta, ack, release, renew, resume, cancel.

Leases are held by consumer *sessions* (a random id per loader iteration or per
client) and kept alive by their heartbeat (``renew(session=...)``); see
``task.py`` for what a claim is and ``steps.py`` for how a step is found.
A waiting ``get_meta`` is one wait on the controller's condition, woken by
acks, clears, version changes and closes (and by row changes as below), and ended
early by ``cancel(session)`` when its loader stops. A call that makes rows ready (a commit,
a release, a tag change) forms the waiters' steps itself and gives each reply to
the ``reply`` handle the waiting request's server handed its ``get_meta``
(``waiters.py``, ``tq_stream.handling``); it wakes only the waiters it could not
answer that way (a waiter it found no step for is not woken: it would only repeat
that try). On a server's IO thread it forms steps only
for the default sampler on an open partition, and small steps (``_forms_inline``).

Called by the Controller's public methods; ``self`` is the Controller.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from tq_stream import fieldpath
from tq_stream.controller.capacity import held_hint
from tq_stream.controller.partition import PartitionMeta
from tq_stream.controller.reservations import WRITER_TASK
from tq_stream.controller.task import MAX_REPLICAS, TaskState
from tq_stream.controller.waiters import Waiter
from tq_stream.controller.waiting import holders, not_ready
from tq_stream.errors import (
    ConfigError,
    LeaseError,
    TurnNotReached,
    WaitTimeout,
    check_positive,
    check_replica,
    check_timeout,
    format_seconds,
)
from tq_stream.handling import ANSWERED, Reply, WouldBlock, may_block
from tq_stream.samplers.sequential import SequentialSampler
from tq_stream.stats import describe

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


class ConsumingLogic:
    """Mixin of Controller; see the module docstring."""

    def get_meta(self, partition: str, task: str, step: int | None = None, dp_rank: int = 0,
                 timeout: float = 60.0, replica: int | None = None, session: str = "",
                 consumer: str = "", reply: Reply | None = None) -> dict[str, Any] | None:
        """The rows of ``step`` for ``dp_rank`` (``step=None``: the next batch for this
        consumer, see ``steps.py``); waits for enough ready rows.

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
                (``RPC_REPLIES``; never a caller's): a commit that forms this call's
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
        with self._cond:
            part, state = self._task(partition, task)
            replica = check_replica(replica, state.config.replicas)
            _check_ids(state, dp_rank, replica)
            waiter = Waiter(state, (step, dp_rank, replica, session, consumer),
                            deadline - timeout, deadline, reply)
            return self._wait_step(part, state, waiter, timeout)

    def _wait_step(self, part: PartitionMeta, state: TaskState, waiter: Waiter,
                   timeout: float) -> dict[str, Any] | None:
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
                self._abort_reservations()  # a dead producer's rows must not hold the end
                meta = self._try_step(part, state, step, dp_rank, replica, session, consumer)
                if meta is not None:
                    self._timings.waited(part.name, state.name, waiter.since)
                    return meta
                left = waiter.deadline - time.monotonic()
                if left <= 0 and state.awaits_turn(step, session, time.time(), timeout):
                    what = self._waiting_for(part, state, step, dp_rank)
                    raise TurnNotReached(
                        f"get_meta waited timeout={format_seconds(timeout)} on partition "
                        f"{part.name!r} for {what}; the trainer is alive on an earlier "
                        f"step and moved on within the timeout: ask again")
                if left <= 0:
                    raise self._wait_error(part, state, waiter.args, timeout)
                if not registered:
                    self._waiters.add(part.name, waiter)
                    registered = True
                    if step is None and state.ended:
                        self._cond.notify_all()  # others at the end need not wait for us
                self._timings.wait(self._cond, min(left, self._next_wake(state)),
                                   waiter.since, "get_meta", part.name,
                                   lambda: self._waiting_for(part, state, step, dp_rank))
                if waiter.meta is not None:  # formed by a commit: sent, or ours to send
                    return ANSWERED if waiter.given else waiter.meta
                self._check_open()
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
                meta = self._try_step(part, waiter.state, step, dp_rank, replica, session,
                                      consumer)
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

    def _rows_ready(self, part: PartitionMeta) -> None:
        """Rows of ``part`` may have become ready: answer the waiters that can take
        them, and wake the waiters that must look themselves (``_answer_waiters``);
        the others are woken once the replies given were sent (a thread woken earlier
        would compete with the send). Lock held."""
        if self._answer_waiters(part):
            self._cond.notify_all()

    def _waiting_for(self, part: PartitionMeta, state: TaskState, step: int | None,
                     dp_rank: int) -> str:
        """What a waiting get_meta lacks, e.g. "task 't' step 0 (rank 0): 1 complete
        group of 4 ready (4 rows), 2 needed per step"."""
        cfg = state.config
        cands = self._candidates(part, state, cfg.dp_size, state.next_step)
        try:
            progress = state.sampler.progress(cands, cfg.batch_size)
        except Exception as exc:  # a message must not hide the wait
            progress = f"{cands.count} rows ready ({type(exc).__name__} describing them)"
        which = "the next step" if step is None else f"step {step}"
        missing = [t for t in state.tags if t not in part.tags.present]
        hint = f"; no row has tag(s) {missing} the sampler needs yet" if missing else ""
        hint += self._reform_hint(part, state, step, dp_rank)
        turn = state.version_at(state.next_step)
        if turn != state.version:
            still = format_seconds(max(0.0, time.time() - state.last_move))
            hint += (f"; step {state.next_step} is formed ahead of its turn for version "
                     f"{turn} (the consumer set {state.version} and reads step "
                     f"{state.position}), so rows that may be stale by then wait for it "
                     f"(a loader says which step it reads: Controller.reading); the "
                     f"consumer last acked or read a step {still} ago, and such a step "
                     f"waits for its turn while the trainer acks a batch at least once "
                     f"per timeout (a training step longer than the timeout needs a "
                     f"longer timeout)")
        lacking = describe(not_ready(part, state))
        if lacking:  # what the rows that are there wait for
            hint += f"; {lacking}"
        if held_hint(part):  # the writers block: no new row will come
            hint += f"; {held_hint(part)}"
        return f"task {state.name!r} {which} (rank {dp_rank}): {progress}{hint}"

    def _wait_error(self, part: PartitionMeta, state: TaskState, args: tuple,
                    timeout: float) -> Exception:
        step, dp_rank, replica, session, _consumer = args
        now = time.time()
        if step is None and state.ended:
            held = self._held_elsewhere(part, state, dp_rank, replica, session)
            if held:
                return WaitTimeout(
                    f"get_meta waited timeout={format_seconds(timeout)} on partition "
                    f"{part.name!r} for the next batch of task {state.name!r} (rank "
                    f"{dp_rank}, replica {replica}): the partition is closed and drained, "
                    f"and its end waits for shares other live sessions hold: "
                    f"{holders(held, now)}. The end comes once they are acked; a share "
                    f"comes back here if its holder's lease expires (its heartbeat renews "
                    f"it while it lives)")
        rec = None if step is None else state.steps.get(step)
        claim = None if rec is None else self._held_by_other(rec, (dp_rank, replica), session)
        if rec is not None and claim is not None:
            left = max(0.0, claim.expiry - now)
            who = holders([(step, len(rec.shares[dp_rank]), claim)], now)
            return ConfigError(
                f"replica={replica} of rank {dp_rank} of task {state.name!r} step {step} "
                f"is held by another live session: {who} (its heartbeat renews the "
                f"lease, which expires in {format_seconds(left)} without one); get_meta "
                f"waited timeout={format_seconds(timeout)}. Two consumers "
                f"must not read as one replica: give each TP/PP peer of a rank its own "
                f"replica= (replicas={state.config.replicas}); a consumer restarted after "
                f"its predecessor died takes the share back once that lease expired (a "
                f"shorter lease_timeout makes it sooner)")
        unknown = [f for f in state.config.fields if not fieldpath.under(f, part.schemas)]
        if unknown and part.live:  # a timeout still: a later stage may write the field
            return WaitTimeout(
                f"get_meta waited timeout={format_seconds(timeout)} for task {state.name!r} "
                f"on partition "
                f"{part.name!r}, but fields {unknown} were never written to any of its "
                f"{part.live} rows (known fields: {sorted(part.schemas)}); check the name, "
                f"or start the stage that writes them")
        hint = ""
        if not part.schemas:  # a misspelt partition looks like this: help find the name
            written = sorted(n for n, p in self._parts.items() if p.schemas)  # type: ignore[attr-defined]
            hint = (f"; no row was ever written to partition {part.name!r} (partitions "
                    f"written to: {written[:20]}): check the name, or start its producer")
        return WaitTimeout(
            f"get_meta waited timeout={format_seconds(timeout)} on partition {part.name!r} for "
            f"{self._waiting_for(part, state, step, dp_rank)}{hint}")

    def ack(self, partition: str, task: str, step: int, dp_rank: int, index: np.ndarray,
            generation: np.ndarray, replica: int = 0, session: str = "") -> int:
        """Replica ``replica`` of ``dp_rank`` is done with rows; returns how many became
        ACKED (every replica acked them). Acking twice is a no-op. Freeing storage
        happens afterwards and never fails the ack. With ``session`` (the reader the
        rows were handed to), an ack whose lease lapsed and went to another reader since
        is refused with LeaseTakenOver (``takeovers.py``)."""
        check_session("session", session)
        with self._cond:
            part, state = self._task(partition, task)
            _check_ids(state, dp_rank, replica)
            state.takeovers.check((step, dp_rank, replica), session, task, "acks")
            if step not in state.steps and 0 <= step < state.next_step:
                return 0  # every rank acked the step already: an ack sent again
            rows = self._held_rows(part, state, step, dp_rank, index, generation, "ack")
            if self._journal is not None and len(rows):  # durable before the reply
                self._journal.acked(partition, task, step, dp_rank, replica, rows,
                                    part.generation[rows])
            done = self._ack_rows(state, step, dp_rank, replica, rows)
            freed = self._finish_rows(part, done)
            self._cond.notify_all()
        self._free_slots(partition, freed)
        return len(done)

    def release(self, partition: str, task: str, step: int, dp_rank: int, index: np.ndarray,
                generation: np.ndarray, replica: int = 0, session: str = "") -> None:
        """Give up reading (step, dp_rank) for now: the share is handed, unchanged, to
        the next reader of that step and rank (or of "the next batch"). With
        ``session``, only that session's own claim is dropped: a release by a reader
        whose claim another session took over since is a LeaseError (the share is
        the other reader's now)."""
        with self._cond:
            part, state = self._task(partition, task)
            _check_ids(state, dp_rank, replica)
            self._held_rows(part, state, step, dp_rank, index, generation, "release")
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
            self._rows_ready(part)

    def renew(self, partition: str, task: str, step: int | None = None,
              session: str = "") -> int:
        """Keep leases alive: every claim of ``session`` (the heartbeat), or, with
        ``step``, the claims of ``session`` on that step (another session's claim on it,
        a peer replica's, is its own to renew: a LeaseError if ``session`` has none).
        Returns how many claims were renewed.
        ``task=""`` is a producer's heartbeat: it renews the rows ``session`` reserved
        on ``partition`` and not committed yet (returns how many)."""
        check_session("session", session)
        with self._cond:
            if task == WRITER_TASK:
                return self._reservations.renew(partition, session, time.time())  # type: ignore[attr-defined]
            _, state = self._task(partition, task)
            now = time.time()
            if step is None:
                return state.renew(session, now)
            rec = state.steps.get(step)
            if rec is None or rec.end:
                raise self._no_lease(state, step, "renew")
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
                         replica: int | None = None) -> dict[str, Any]:
        """Where a reader of ``dp_rank`` resumes: ``{"step": first step not acked by every
        replica (or by ``replica``), "skip": later steps already done}``."""
        with self._cond:
            _, state = self._task(partition, task)
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
        with self._cond:
            if self._reservations.held_by(session):
                if not may_block():
                    raise WouldBlock  # frees storage through the units: a worker thread
                self._abort_reservations(session)
            for tasks in self._tasks.values():
                for state in tasks.values():
                    state.cancel(session)
            self._cancelled[session] = time.monotonic()
            while len(self._cancelled) > MAX_CANCELLED:
                self._cancelled.pop(next(iter(self._cancelled)))
            self._cond.notify_all()


__all__ = ["ConsumingLogic", "MAX_REPLICAS"]
