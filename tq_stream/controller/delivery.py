"""Delivery: the rules by which a task's rows become steps, shares, claims and acks.

A row of a task goes NEW → (ready: in the queue) → LEASED (in one share of a formed
step) → ACKED (every replica of its rank acked it), or NEW → DISCARDED (its sampler
dropped it; ``task.py`` keeps the per-row state). Here:

- **formation** (``_select``): a step is formed once, for all DP ranks together, by
  the task's sampler, and each share never changes, except at its turn
  (``_at_turn``, ``turns.py``: a share formed ahead for a predicted policy version
  that went stale is formed again). A closed, drained partition ends with one
  ``end`` step every rank receives, so all ranks see the same number of batches;
- **discards** (``discard``): rows a sampler drops are counted per reason and freed
  once every declared consumer is done with them (``Book.finish_rows``);
- **hand-out and claims** (``try_step``): by number (``get_meta(step=n)``: DP
  lockstep; a loader starts at ``first_unfinished(rank)``) or "the next batch for
  me" (``step=None``: a pool of stage workers gets, in order, a share its own
  consumer name held under a dead session, a share nobody claims, or a new step).
  Each (step, rank, replica) is claimed by one live session; a claim held by
  another live session is never handed out (the caller waits; at its timeout a
  ConfigError names ``replica``), and a replica that acked its share is refused it;
- **redelivery**: a claim that expired, was released or cancelled drops only the
  claim: the share stays, LEASED, for the next reader of that (step, rank). A "next
  batch" caller gets the end only once no share of its rank and replica is held by
  another live session that is not itself waiting in a get_meta (two workers that
  each fetch ahead would otherwise wait for each other);
- **acks per replica** (``held_rows``, ``ack_rows``): each replica sets its bit;
  a row every replica acked is ACKED, and a step every rank finished goes.

Every call is made with the book's lock held, by ``Consuming`` (consumer calls),
``waiting.py`` (why a wait waits) and the journal replay.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from tq_stream.controller import access, events, turns
from tq_stream.controller.book import Book
from tq_stream.controller.candidates import candidates, check_selection, pending
from tq_stream.controller.partition import PartitionMeta
from tq_stream.controller.task import ACKED, LEASED, Claim, StepRecord, TaskState
from tq_stream.controller.timings import Timings
from tq_stream.controller.waiters import Waiters
from tq_stream.errors import LeaseError, ReplicaClash
from tq_stream.messages.reads import StepMeta
from tq_stream.samplers.base import Selection
from tq_stream.samplers.sequential import SequentialSampler

PREFIX_MIN = 16384  # candidates a prefix-ok sampler sees at least


SMALL = 64  # rows below which plain Python sets beat numpy's set operations


def _within(rows: np.ndarray, share: np.ndarray) -> bool:
    """Every one of ``rows`` is in ``share``."""
    if len(share) <= SMALL:  # a small batch: np.isin costs far more than its work
        return set(rows.tolist()) <= set(share.tolist())
    return bool(np.isin(rows, share).all())


class Delivery:
    """The delivery rules of every task (see the module docstring); lock held."""

    def __init__(self, book: Book, waiters: Waiters, timings: Timings) -> None:
        self._book = book
        self._waiters = waiters  # the get_meta calls waiting (waiters.py)
        self._timings = timings  # hand-out latency

    def discard(self, part: PartitionMeta, state: TaskState, sel: Selection,
                detail: str = "") -> int:
        """Discard the selection's rows (``detail``: for the WARNING line)."""
        if not sel.discard:  # the usual case: nothing to record, free or wake
            return 0
        n = 0
        freed: list[Any] = []
        for reason, rows in sel.discard.items():
            rows = np.asarray(rows, dtype=np.int64)
            if self._book.journal is not None and len(rows):
                self._book.journal.discarded(part.name, state.name, str(reason), rows,
                                        part.generation[rows])
            done = state.discard(str(reason), rows)
            events.discarded(part.name, state.name, str(reason), len(done), detail)
            n += len(done)
            freed += self._book.finish_rows(part, done)
        self._book.free_slots(part.name, freed)
        if n:
            self._book.cond.notify_all()  # admission may open
        return n

    def _form(self, part: PartitionMeta, state: TaskState, given: Sequence[np.ndarray]) -> None:
        shares = [s if type(s) is np.ndarray and s.dtype == np.int64 else
                  np.asarray(s, dtype=np.int64) for s in given]
        if self._book.journal is not None:
            self._book.journal.formed(part.name, state.name, state.next_step, shares,
                                 [part.generation[s] for s in shares])
        rec = state.lease(state.next_step, shares)
        if state.sampler.version_bound:  # the version its shares are in the bound for
            rec.turns = [state.version_at(state.next_step)] * len(shares)
        state.next_step += 1
        rows = shares[0] if len(shares) == 1 else np.concatenate(shares)
        written = part.write_time[int(rows[0])] if len(rows) == 1 else part.write_time[rows]
        self._timings.handed_out(part.name, state.name, written,
                                 self._book.clock())

    def _select(self, part: PartitionMeta, state: TaskState) -> bool:
        """Try to form step ``state.next_step``; True if it was formed."""
        if state.ended:
            return False
        cfg, step = state.config, state.next_step
        if cfg.batch_size * cfg.dp_size == 1 and type(state.sampler) is SequentialSampler \
                and state.queue.count:
            # The default sampler, one row per step (a single waiting consumer: the
            # write→wake latency case) takes the oldest ready row. Building candidates
            # and checking the sampler's answer would cost more than the step itself.
            row = state.queue.oldest()
            if row is not None:
                self._form(part, state, [np.array([row], dtype=np.int64)])
                return True
        # Samplers that want the oldest rows first see a prefix of the ready queue;
        # only when it cannot fill a step do they see every candidate.
        window = max(8 * cfg.batch_size * cfg.dp_size, PREFIX_MIN) \
            if state.sampler.prefix_ok else None
        while True:
            cands = candidates(part, state, cfg.dp_size, step, window)
            sel = state.sampler.sample(cands, cfg.batch_size)
            if not sel.ready and window is not None and cands.count >= window:
                self.discard(part, state, sel)
                window = None  # the prefix was not enough: look at everything
                continue
            if sel.ready:
                check_selection(state, sel, cfg.dp_size)
                self.discard(part, state, sel)
                self._form(part, state, sel.shares)
                return True
            if not self.discard(part, state, sel):
                break
        if not part.closed or pending(part, state):
            return False
        cands = candidates(part, state, cfg.dp_size, step)
        if cands.count and state.version_at(step) != state.version:
            # Ahead of its turn: a sampler may have left rows out that are in time for
            # the version the consumer will actually hold. The last steps wait for the
            # turn (``reading``), so no row is dropped on a prediction; with no row
            # left, nothing can be, and the end is formed at once.
            return False
        if not cfg.drop_last and cands.count:
            sel = state.sampler.tail(cands, cfg.batch_size)
            if sel.ready:
                check_selection(state, sel, cfg.dp_size)
                self.discard(part, state, sel)
                self._form(part, state, sel.shares)
                return True
            self.discard(part, state, sel)
        leftover = state.queue.ordered()
        if len(leftover):
            self.discard(part, state, Selection.wait({"tail": leftover}))
        if self._book.journal is not None:
            self._book.journal.ended(part.name, state.name, step)
        state.steps[step] = StepRecord([np.zeros(0, np.int64)] * cfg.dp_size, end=True)
        state.ended = True
        state.next_step += 1
        return True

    def try_step(self, part: PartitionMeta, state: TaskState, step: int | None,
                 dp_rank: int, replica: int, session: str,
                  consumer: str) -> StepMeta | None:
        now = self._book.clock()
        events.expired(part.name, state.name, state.expire(now))
        asked_next = step is None
        if step is None:
            step = self._next_for(part, state, dp_rank, replica, session, consumer)
            if step is None:
                return None
        while step >= state.next_step and not state.ended:
            if not self._select(part, state):
                return None
        rec = state.steps.get(step)
        if rec is None and state.ended and step >= state.next_step - 1:
            rec = state.steps[state.next_step - 1]
        if rec is None:
            raise ReplicaClash(
                f"step must not be already acked by every rank (each of its replicas), got "
                f"step={step} of task "
                f"{state.name!r}; rank {dp_rank} resumes at step "
                f"{state.first_unfinished(dp_rank).step} (get_meta(step=None) or a "
                f"fresh loader finds it by itself){_peers_hint(state)}"
            )
        if rec.end:
            if asked_next and self.held_elsewhere(part, state, dp_rank, replica, session):
                return None  # not the end yet: a share another session holds may come back
            meta = access.placement(part, np.zeros(0, np.int64), state.config.fields)
            # An end meta carries the end step itself, so a reader that asked for a later
            # step learns where the stream ended (multi-partition loaders route by it).
            return StepMeta(**meta, task=state.name, step=state.next_step - 1,
                            dp_rank=dp_rank, replica=replica, end=True)
        if not len(rec.shares[dp_rank]) and dp_rank in rec.lost:
            return self._lost_meta(part, state, step, dp_rank, replica)
        if rec.share_done(dp_rank, state.full_acks, state.acks):
            raise ReplicaClash(
                f"step {step} of task {state.name!r} was already acked by every replica of "
                f"rank {dp_rank}; it must not be read again (rank {dp_rank} resumes at step "
                f"{state.first_unfinished(dp_rank).step}){_peers_hint(state)}")
        if rec.share_done(dp_rank, 1 << replica, state.acks):
            raise ReplicaClash(
                f"replica {replica} of rank {dp_rank} acked its share of step {step} of task "
                f"{state.name!r} already; it must not read it again (it resumes at step "
                f"{state.first_unfinished(dp_rank, replica).step}). If two TP/PP peers "
                f"read as one replica, give each its own replica= (replicas="
                f"{state.config.replicas})")
        if self.held_by_other(rec, (dp_rank, replica), session) is not None:
            return None  # wait: until that session's lease expires, it is cancelled or acks
        if rec.turns is not None and not self._at_turn(part, state, rec, step, dp_rank):
            return None  # its stale rows wait for rows within the bound to replace them
        if not len(rec.shares[dp_rank]):  # formed again at its turn, with no row left
            return self._lost_meta(part, state, step, dp_rank, replica)
        state.claim(step, dp_rank, replica, session, consumer, now)
        share = rec.shares[dp_rank]
        meta = access.placement(part, share, state.config.fields)
        return StepMeta(**meta, task=state.name, step=step, dp_rank=dp_rank,
                        replica=replica, lease_timeout=state.config.lease_timeout,
                        turn=None if rec.turns is None else rec.turns[dp_rank])

    def _lost_meta(self, part: PartitionMeta, state: TaskState, step: int, dp_rank: int,
                   replica: int) -> StepMeta:
        """Every row of this share died with its storage unit, or went stale with none
        to replace it: an empty batch says so at once (a loader goes on with its next
        step) instead of a wait."""
        meta = access.placement(part, np.zeros(0, np.int64), state.config.fields)
        return StepMeta(**meta, task=state.name, step=step, dp_rank=dp_rank,
                        replica=replica, lost=True)

    def _at_turn(self, part: PartitionMeta, state: TaskState, rec: StepRecord, step: int,
                 rank: int) -> bool:
        """Check rank's share of a formed ``step`` against the version the consumer set
        for it, and re-form it if rows went out of the bound (``turns.py``). False: a
        replacement is not ready yet, the reader waits."""
        version = state.version_for(step)
        if not turns.behind(rec, rank, version) or turns.acked(state, rec, rank):
            return True
        assert rec.turns is not None and version is not None
        share = replace(candidates(part, state, 1, step, index=rec.shares[rank]),
                        version=version)
        plan = turns.reform(
            state.sampler, share,
            lambda kept: candidates(part, state, 1, step,
                                          index=np.concatenate([kept, state.queue.ordered()])),
            state.config.batch_size, part.closed and not pending(part, state))
        if plan is None:
            return False
        if len(plan.stale):
            self._set_share(part, state, step, rank, turns.EMPTY)
            self.discard(part, state, Selection.wait(plan.discard))
            self.discard(part, state, Selection.wait({"stale": plan.stale}), (
                f"; at their turn: the last, step {step} rank {rank}, was formed for "
                f"version {rec.turns[rank]} and is stale at version {version}, set for that "
                f"step; its share was formed again ({len(plan.share)} rows)"))
            self._set_share(part, state, step, rank, plan.share)
            rec.served -= {k for k in rec.served if k[0] == rank}  # new rows: handed out
            if not len(plan.share):
                rec.lost.add(rank)  # nothing left for it: its readers skip the step
            # its new rows were chosen for the version predicted for its turn
            predicted = state.version_at(step)
            version = version if predicted is None else max(version, predicted)
        rec.turns[rank] = version
        return True

    def _set_share(self, part: PartitionMeta, state: TaskState, step: int, rank: int,
                   rows: np.ndarray) -> None:
        if self._book.journal is not None:
            self._book.journal.share_set(part.name, state.name, step, rank, rows,
                                    part.generation[rows])
        state.set_share(step, rank, rows)

    def _next_for(self, part: PartitionMeta, state: TaskState, rank: int, replica: int,
                  session: str, consumer: str) -> int | None:
        """The step "the next batch for me" hands out (see the module docstring)."""
        key, full = (rank, replica), state.full_acks
        bit = 1 << replica
        unclaimed = None
        for s in sorted(state.steps):
            rec = state.steps[s]
            if rec.end:
                continue
            share = rec.shares[rank]
            if (state.acks[share] & bit).all():
                continue  # this replica is done with it
            if rec.share_done(rank, full, state.acks):
                continue
            claim = rec.claims.get(key)
            if claim is not None:
                continue  # a live session reads it (this one, or another): never twice
            name = rec.left.get(key, "")
            if consumer and name == consumer:
                return s  # what this consumer's dead earlier session held: resume it
            if unclaimed is None:
                unclaimed = s
        if unclaimed is not None:
            return unclaimed
        if state.ended:
            return state.next_step - 1
        return state.next_step  # form a new step

    def held_by_other(self, rec: StepRecord, key: tuple[int, int],
                      session: str) -> Claim | None:
        """The claim on (rank, replica) ``key`` of another session, if any: every claim
        there is live (``TaskState.expire`` dropped the expired ones, ``cancel`` those
        of stopped sessions). A caller without a session (a direct controller call: no
        heartbeat, no Client) is not checked."""
        claim = rec.claims.get(key)
        if claim is None or not session or claim.session == session:
            return None
        return claim

    def held_elsewhere(self, part: PartitionMeta, state: TaskState, rank: int,
                       replica: int, session: str) -> list[tuple[int, int, Claim]]:
        """(step, rows, claim) of every share of (rank, replica) that replica has not
        acked and another live session claims, whose holder may yet give it back: a pool
        worker asking for the next batch at the end waits for those (acked: the end; its
        holder died: the share comes back to the next asker). A holder that is itself
        waiting in a get_meta on the partition is alive and finishes its share itself
        (a worker that fetches ahead): waiting for it would stall both until a timeout."""
        bit = 1 << replica
        waiting = self._waiters.sessions(part.name, time.monotonic())
        held = []
        for step, rec in state.steps.items():
            if rec.end or rec.share_done(rank, bit, state.acks):
                continue
            claim = self.held_by_other(rec, (rank, replica), session)
            if claim is not None and claim.session not in waiting:
                held.append((step, len(rec.shares[rank]), claim))
        return held

    def no_lease(self, state: TaskState, step: int, what: str) -> LeaseError:
        return LeaseError(
            f"{what} needs rows of a formed step, but step {step} of task {state.name!r} "
            f"is not open (it was already acked by every rank, or never formed)"
        )

    def held_rows(self, part: PartitionMeta, state: TaskState, step: int, dp_rank: int,
                  index: np.ndarray, generation: np.ndarray, what: str) -> np.ndarray:
        rec = state.steps.get(step)
        if rec is None or rec.end or not 0 <= dp_rank < len(rec.shares):
            raise self.no_lease(state, step, what)
        share = rec.shares[dp_rank]
        index = np.asarray(index, dtype=np.int64)
        generation = np.asarray(generation, dtype=np.int64)
        alive = part.used[index] & (part.generation[index] == generation)
        index = index[alive]  # rows cleared meanwhile are simply gone
        if not _within(index, share):
            raise LeaseError(f"{what} must name rows of step {step} rank {dp_rank} of task "
                             f"{state.name!r}; got rows outside that share")
        return index

    def ack_rows(self, state: TaskState, step: int, dp_rank: int, replica: int,
                 rows: np.ndarray) -> np.ndarray:
        """Set ``replica``'s bit on ``rows``; returns the rows that became ACKED."""
        rows = rows[state.state[rows] == LEASED]
        if len(rows):
            state.last_move = self._book.clock()  # the trainer moved on (``awaits_turn``)
        state.acks[rows] |= 1 << replica
        done: np.ndarray = rows[state.acks[rows] == state.full_acks]
        state.state[done] = ACKED
        state.acked += len(done)
        rec = state.steps[step]
        if rec.share_done(dp_rank, 1 << replica, state.acks):
            rec.claims.pop((dp_rank, replica), None)
        # A share a lost unit emptied is not done: the step is kept (its shares are
        # empty arrays), so that rank's reader is told its rows were lost.
        if all(rec.share_done(r, state.full_acks, state.acks) for r in range(len(rec.shares))) \
                and all(len(rec.shares[r]) for r in rec.lost):
            del state.steps[step]
        return done


def _peers_hint(state: TaskState) -> str:
    """What a reader of an acked step is told when the task has one replica: two TP/PP
    peers that both read a rank without ``replicas=`` race for its steps."""
    if state.config.replicas > 1:
        return ""
    return (". If TP/PP peers read this rank together, register the task with replicas= "
            "(how many peers) and give each peer its replica=; with replicas=1 one of them "
            "trains every step and the other is refused")


__all__ = ["ACKED", "Delivery"]
