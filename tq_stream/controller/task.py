"""TaskState: one consumer task's view of a partition.

Per row: ``state`` (NEW → LEASED → ACKED, or NEW → DISCARDED) and ``acks``, a
bit per replica (TP/PP peer) of the row's DP rank that acked it; a row is ACKED
once every replica's bit is set, so a second ack by the same replica is a no-op.

Per step: a ``StepRecord`` with one share of rows per DP rank. A share is
fixed when the step is formed: whoever asks for (step, rank) gets the same rows
until every replica acked them, whether the first reader acked, released,
died or was replaced. A share is *claimed* by a consumer session per replica
(``claims``), and a claim lasts ``lease_timeout`` seconds unless its session
renews it (the loader and the client keep their claims alive from a
heartbeat thread). An expired or released claim only drops the claim: the
rows stay in their share, LEASED to the step, for the next reader of that
(step, rank) — a replacement consumer, or the next stage worker asking for
"the next batch for me" (an expired claim's consumer name is kept in ``left``,
so a restarted worker of that name gets it first). A cancelled session's claims
are dropped the same way at its cancel. A claim that is there is live, and is
never handed to another session (delivery.py).

Invariants: a row is LEASED iff it belongs to exactly one share of a formed,
not fully acked step; the ready queue holds exactly the rows that are NEW and
ready for the task (fields written, required tags set); an ACKED or
DISCARDED row never becomes NEW again.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tq_stream.controller.fifo import ReadyQueue
from tq_stream.controller.takeovers import Takeovers
from tq_stream.controller.task_config import TaskConfig
from tq_stream.messages.reads import Resume
from tq_stream.samplers.base import Sampler

NEW, LEASED, ACKED, DISCARDED = 0, 1, 2, 3
@dataclass
class Claim:
    """Who reads a (step, rank, replica) now, and until when without a renewal;
    ``since`` when it was claimed and ``renewed`` its last heartbeat (epoch seconds,
    like ``expiry``; 0: unknown, a claim restored from a checkpoint)."""

    session: str
    consumer: str
    expiry: float
    since: float = 0.0
    renewed: float = 0.0


@dataclass
class StepRecord:
    """The rows of one step: ``shares[r]`` is DP rank r's share (fixed)."""

    shares: list[np.ndarray]
    end: bool = False
    claims: dict[tuple[int, int], Claim] = field(default_factory=dict)
    served: set[tuple[int, int]] = field(default_factory=set)  # (rank, replica) handed out
    lost: set[int] = field(default_factory=set)  # ranks whose share lost rows with a unit
    # (rank, replica) -> the consumer name of a claim that expired or whose session was
    # cancelled: a restarted worker
    # of that name gets the share back first (delivery.py ``_next_for``)
    left: dict[tuple[int, int], str] = field(default_factory=dict)
    # per rank, the consumer version its share is within the sampler's bound for (the
    # version predicted for the step's turn when it was formed, or the one it was
    # checked against since); None for a sampler without a version bound (turns.py)
    turns: list[int | None] | None = None

    def share_done(self, rank: int, full: int, acks: np.ndarray) -> bool:
        """Every replica whose bit is in ``full`` acked every row of rank's share."""
        share = self.shares[rank]
        if len(share) == 1:  # a batch of one: a scalar test, no numpy reduction
            return int(acks[share[0]]) & full == full
        return bool(((acks[share] & full) == full).all())


class TaskState:
    """Consumption of one partition by one task (see module docstring)."""

    def __init__(self, name: str, config: TaskConfig, sampler: Sampler, size: int) -> None:
        self.name = name
        self.config = config
        self.sampler = sampler
        self.tags: tuple[str, ...] = tuple(sampler.required_tags())
        self.state = np.zeros(size, dtype=np.int8)
        self.acks = np.zeros(size, dtype=np.int64)
        self.queue = ReadyQueue(size)
        self.steps: dict[int, StepRecord] = {}
        self.next_step = 0
        self.ended = False
        self.version: int | None = None
        self.version_step: int | None = None  # the first step read under ``version``
        self.position: int | None = None  # the step the consumer reads now (``reading``)
        # steps per version change: set_admission's (None: not set), else the pace seen
        # last in set_version (``cadence``; None before a change was seen)
        self.steps_per_version: int | None = None
        self.cadence: int | None = None
        # versions set for steps before ``version_step`` (step -> version, at its change,
        # also from a DP rank or peer behind): ``version_for`` (pruned to open steps)
        self.history: dict[int, int] = {}
        # when the consumer last moved on (registered, acked rows, or said which step it
        # reads; epoch seconds): a step held for its turn waits for a trainer that moves
        self.last_move = 0.0
        self.discards: Counter[str] = Counter()
        self.handed_out = 0
        self.acked = 0
        self.renewed = 0
        self.expired = 0
        self.cancelled = 0
        self.redelivered = 0
        self.takeovers = Takeovers()  # sessions whose lapsed share another reader took
        # (sampler class name, sampler state) of a task restored from a checkpoint and
        # not yet registered again by its consumer; None once registered.
        self.restored: tuple[str, Any] | None = None

    @property
    def full_acks(self) -> int:
        """The ``acks`` value of a row every replica acked."""
        return (1 << self.config.replicas) - 1

    def grow(self, size: int) -> None:
        extra = size - self.state.shape[0]
        if extra > 0:
            self.state = np.concatenate([self.state, np.zeros(extra, np.int8)])
            self.acks = np.concatenate([self.acks, np.zeros(extra, np.int64)])
            self.queue.grow(size)

    def offer(self, rows: np.ndarray, ready: np.ndarray) -> None:
        """Rows whose fields or tags changed: those now ready and NEW become available."""
        if len(rows) == 1:  # a one-row put: scalar tests, no numpy ufuncs on one element
            row = int(rows[0])
            if ready[0] and self.state[row] == NEW and not self.queue.avail[row]:
                self.queue.push(rows)
            return
        fresh = rows[ready & (self.state[rows] == NEW) & ~self.queue.avail[rows]]
        self.queue.push(fresh)

    def offer_row(self, row: int) -> None:
        """``offer`` of one ready row."""
        if self.state[row] == NEW and not self.queue.avail[row]:
            self.queue.push_row(row)

    def lease(self, step: int, shares: list[np.ndarray]) -> StepRecord:
        """Form ``step`` from ``shares`` (one per DP rank): their rows become LEASED."""
        rows = shares[0] if len(shares) == 1 else \
            np.concatenate(shares) if shares else np.zeros(0, np.int64)
        self.queue.remove(rows)
        self.state[int(rows[0]) if len(rows) == 1 else rows] = LEASED
        rec = StepRecord(list(shares))
        self.steps[step] = rec
        return rec

    def set_share(self, step: int, rank: int, rows: np.ndarray) -> None:
        """Rank's share of ``step`` becomes ``rows`` (NEW rows, now LEASED); rows of the
        old share not in it are NEW again, first in the ready queue (re-formed at its
        turn, ``turns.py``: no replica acked any of them)."""
        rec = self.steps[step]
        back = rec.shares[rank]
        back = back[~np.isin(back, rows)] if len(rows) else back
        self.state[back] = NEW
        self.queue.push(back, front=True)
        self.queue.remove(rows)
        self.state[rows] = LEASED
        rec.shares[rank] = rows

    def claim(self, step: int, rank: int, replica: int, session: str, consumer: str,
              now: float) -> None:
        """(rank, replica) of ``step`` is read by ``session`` until now + lease_timeout.
        The session that holds the claim asking again (a loader checking a batch at its
        yield, a call made again after a lost reply) is no redelivery."""
        rec = self.steps[step]
        key = (rank, replica)
        held = rec.claims.get(key)
        again = held is not None and bool(session) and held.session == session
        if key in rec.served:
            if not again:
                self.redelivered += len(rec.shares[rank])
        else:
            rec.served.add(key)
            if replica == 0:
                self.handed_out += len(rec.shares[rank])
        rec.claims[key] = Claim(session, consumer, now + self.config.lease_timeout, now, now)
        rec.left.pop(key, None)
        self.takeovers.claimed((step, rank, replica), session)

    def discard(self, reason: str, rows: np.ndarray) -> np.ndarray:
        rows = rows[(self.state[rows] == NEW)]
        self.queue.remove(rows)
        self.state[rows] = DISCARDED
        self.discards[reason] += len(rows)
        return rows

    def _drop_claims(self, ended: Callable[[Claim], bool]) -> int:
        """Drop every claim ``ended(claim)`` is true for: its share stays in its step for
        the next reader, and its consumer name in ``left`` (a restarted worker of that
        name gets it first). Returns the rows of the dropped claims."""
        n = 0
        for step, rec in self.steps.items():
            for key in [k for k, c in rec.claims.items() if ended(c)]:
                claim = rec.claims.pop(key)
                if claim.consumer:
                    rec.left[key] = claim.consumer
                self.takeovers.lapsed((step, *key), claim.session)
                n += len(rec.shares[key[0]])
        return n

    def expire(self, now: float) -> int:
        """Drop every claim not renewed in time; returns the rows of the expired claims
        (counted in ``expired``)."""
        n = self._drop_claims(lambda c: c.expiry < now)
        self.expired += n
        return n

    def cancel(self, session: str) -> int:
        """Drop every claim of ``session``, which stopped (``Controller.cancel``); returns
        the rows of those claims (counted in ``cancelled``)."""
        n = self._drop_claims(lambda c: c.session == session)
        self.cancelled += n
        return n

    def check_writer(self, key: tuple[int, int, int], session: str, now: float) -> float | None:
        """A write by ``session`` through its meta of (step, rank, replica) ``key``:
        LeaseTakenOver if another reader took the share over (``takeovers.py``); else the
        seconds its claim holds without a renewal, or None if it holds none now."""
        self.takeovers.check(key, session, self.name, "writes to")
        rec = self.steps.get(key[0])
        claim = None if rec is None else rec.claims.get((key[1], key[2]))
        if claim is None or claim.session != session or claim.expiry <= now:
            return None  # none, or lapsed (not dropped yet): no deadline to tell
        return claim.expiry - now

    def renew(self, session: str, now: float) -> int:
        """Extend every claim of ``session``; returns how many it holds."""
        n = 0
        expiry = now + self.config.lease_timeout
        for rec in self.steps.values():
            for c in rec.claims.values():
                if c.session == session:
                    c.expiry = expiry
                    c.renewed = now
                    n += 1
        self.renewed += n
        return n

    def version_at(self, step: int) -> int | None:
        """The consumer's version when it reads ``step``. Up to the step it reads now
        (``position``), that is its version; a later step, formed ahead of its turn, is
        given the version the consumer will hold by then at its pace (``every``: its
        next change that many steps after the last one, and not before ``position``).
        Without a pace (none declared, no change seen yet) no change is predicted. A prediction: a
        step formed for it leaves out rows that would be stale at its turn, it never
        discards them; a trainer that changes its version faster than predicted finds
        the batch behind at its yield, and the share is checked again then
        (``turns.py``). Predicting slower than the trainer costs that check; predicting
        faster would leave out rows still in the bound until they really went stale."""
        if self.version is None or self.version_step is None:
            return self.version
        now = max(self.version_step, self.position if self.position is not None else -1)
        every = self.every()
        if step <= now or every is None:
            return self.version
        first = max(now + 1, self.version_step + every)
        return self.version if step < first else \
            self.version + 1 + (step - first) // every

    def every(self) -> int | None:
        """Steps per version change: declared (``set_admission``), else the pace of
        the last change seen; None if neither is known."""
        return self.steps_per_version if self.steps_per_version is not None else self.cadence

    def awaits_turn(self, step: int | None, session: str, now: float,
                    patience: float) -> bool:
        """``step`` is formed ahead of its turn (see ``version_at``) for a reader whose
        session holds a live claim here (the batch its trainer is on) and whose trainer
        moved on (acked a batch, or said which step it reads) within ``patience``
        seconds: a wait for that step that runs out says so (``TurnNotReached``), and a
        dataset asks again. A trainer that stopped moving gets a plain WaitTimeout."""
        if step is None or not session or self.version_at(step) == self.version:
            return False
        if now - self.last_move >= patience:
            return False
        return any(c.session == session and c.expiry > now
                   for rec in self.steps.values() for c in rec.claims.values())

    def set_version(self, version: int, at_step: int | None) -> None:
        """The consumer's version from step ``at_step`` on. The same version set again
        (every rank sets it, or a trainer that repeats it) is no change: ``at_step``
        then only says where the consumer reads (see ``reading``). A version for a step
        before ``version_step`` (a DP rank or peer behind the one that set a later
        step's, setting the version it had for that step again) changes nothing but the
        position; a different version for an earlier step (a trainer restarted from an
        older checkpoint) takes effect from that step on, as any change does."""
        if at_step is not None and self.version_step is not None:
            if at_step < self.version_step and self.version_for(at_step) in (version, None):
                self.reading(at_step)
                return
            if at_step < self.version_step:  # a restart: what was set from there is over
                self.history = {s: v for s, v in self.history.items() if s < at_step}
            elif version == self.version:
                self.reading(at_step)
                return
            elif self.version is not None:
                self.history[self.version_step] = self.version
                self._prune_history()
                if version > self.version:  # the pace of its changes, for version_at
                    self.cadence = max(1, (at_step - self.version_step)
                                       // (version - self.version))
        else:
            self.history = {}
        self.version, self.version_step = version, at_step
        self.position = at_step

    def version_for(self, step: int) -> int | None:
        """The version the consumer set for ``step`` (not a prediction: for a step
        after ``version_step``, the one set last); None if none was set for it."""
        if self.version is None or self.version_step is None or step >= self.version_step:
            return self.version
        known = [s for s in self.history if s <= step]
        return self.history[max(known)] if known else None

    def _prune_history(self) -> None:
        """Forget versions of steps every rank finished (keep the one in effect at the
        oldest open step)."""
        oldest = min(self.steps, default=self.next_step)
        done = [s for s in self.history if s <= oldest]
        for s in sorted(done)[:-1]:
            del self.history[s]

    def reading(self, step: int) -> None:
        """The consumer reads ``step`` now, under its current version (the step's turn
        has come: it is formed for that version, not a predicted one)."""
        self.position = step if self.position is None else max(self.position, step)

    def soonest_expiry(self) -> float:
        return min((c.expiry for rec in self.steps.values() for c in rec.claims.values()),
                   default=float("inf"))

    def forget_row(self, rows: np.ndarray) -> None:
        """Rows freed from the partition (cleared): drop them from this task."""
        self.queue.remove(rows)
        self.state[rows] = NEW
        self.acks[rows] = 0

    def finished_rows(self, rows: np.ndarray) -> np.ndarray:
        acked: np.ndarray = rows[self.state[rows] >= ACKED]
        return acked

    def leased_count(self) -> int:
        return int(np.count_nonzero(self.state == LEASED))

    def claimed_count(self) -> int:
        return sum(len(rec.shares[r]) for rec in self.steps.values() for (r, _q) in rec.claims)

    def first_unfinished(self, rank: int, replica: int | None = None) -> Resume:
        """Where a (re)starting reader of ``rank`` resumes: the first step whose share
        for ``rank`` some replica (or ``replica``, if given) has not acked, and the
        later steps formed so far that are done (to skip): those whose share is acked,
        and those every rank acked (gone), so a reader after a gap of steps acked by
        other calls skips them. A replica never reads again a step it acked itself,
        even while its peers have not."""
        full = self.full_acks if replica is None else 1 << replica
        open_ = [s for s in sorted(self.steps) if self.steps[s].end or
                 not self.steps[s].share_done(rank, full, self.acks)]
        if not open_:
            return Resume(step=self.next_step, skip=[])
        start, still = open_[0], set(open_)
        return Resume(step=start,
                      skip=[s for s in range(start + 1, self.next_step) if s not in still])

    def stats(self, now: float) -> dict[str, Any]:
        return {
            "fields": list(self.config.fields),
            "available": int(self.queue.count),
            "leased": self.leased_count(),
            "claimed": self.claimed_count(),
            "handed_out": self.handed_out,
            "acked": self.acked,
            "discarded": dict(self.discards),
            "renewed": self.renewed,
            "expired": self.expired,
            "cancelled": self.cancelled,
            "redelivered": self.redelivered,
            "next_step": self.next_step,
            "first_unacked": [self.first_unfinished(r).step
                              for r in range(self.config.dp_size)],
            "version": self.version,
            "ended": self.ended,
            "at": now,
        }
