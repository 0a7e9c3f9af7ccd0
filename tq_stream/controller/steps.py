"""StepLogic: how the controller forms steps, runs samplers and ends a stream.

A step is formed once, for all DP ranks together, by the task's sampler; every
rank (and every replica of a rank) asking for that step gets its own share.
A share returned by ``release`` or lease expiry is refilled on the next request
for it. No new step is formed while an earlier step has such a hole: the rows
returned stay available for the refill, so a later step cannot take them and
leave the earlier step unfillable at the end of the stream (ranks of a DP job
advance together anyway). A closed, drained partition ends with one ``end``
step that every rank receives, so all ranks see the same number of batches.

Called with the controller's lock held; ``self`` is the Controller.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from tq_stream.controller import events
from tq_stream.controller.partition import PartitionMeta
from tq_stream.controller.task import ACKED, LEASED, NEW, StepRecord, TaskState
from tq_stream.errors import LeaseError, StateError
from tq_stream.samplers.base import Candidates, Selection

PREFIX_MIN = 16384  # candidates a prefix-ok sampler sees at least


class StepLogic:
    """Mixin of Controller; see the module docstring."""

    _tasks: dict[str, dict[str, TaskState]]

    def _candidates(self, part: PartitionMeta, state: TaskState, dp_size: int,
                    step: int, limit: int | None = None) -> Candidates:
        index = state.queue.ordered(limit)
        tags = part.tags
        return Candidates(
            index=index, ready_time=part.write_time[index], dp_size=dp_size,
            closed=part.closed, pending=self._pending(part, state) if part.closed else 0,
            version=state.version, step=step, partition=part.name,
            _tags=tags.get, _has_tag=tags.columns.__contains__,
        )

    def _pending(self, part: PartitionMeta, state: TaskState) -> int:
        """Live rows that are neither available nor handed out: not yet ready."""
        n = min(part.size, state.state.shape[0])
        return int(np.count_nonzero(part.used[:n] & (state.state[:n] == NEW)
                                    & ~state.queue.avail[:n]))

    def _apply_discards(self, part: PartitionMeta, state: TaskState, sel: Selection) -> int:
        n = 0
        freed: list = []
        for reason, rows in sel.discard.items():
            done = state.discard(str(reason), np.asarray(rows, dtype=np.int64))
            events.discarded(part.name, state.name, str(reason), len(done))
            n += len(done)
            freed += self._finish_rows(part, done)
        self._free_slots(part.name, freed)  # type: ignore[attr-defined]
        if n:
            self._cond.notify_all()  # type: ignore[attr-defined]  # admission may open
        return n

    def _check_selection(self, state: TaskState, sel: Selection, dp_size: int) -> None:
        rows = sel.rows
        ok = (len(sel.shares) == dp_size and all(len(s) for s in sel.shares)
              and len(np.unique(rows)) == len(rows) and bool(state.queue.avail[rows].all()))
        if not ok:
            raise StateError(
                f"sampler {type(state.sampler).__name__} must return {dp_size} non-empty, "
                f"disjoint shares of available rows, got shares of sizes "
                f"{[len(s) for s in sel.shares]}"
            )

    @staticmethod
    def _has_holes(state: TaskState) -> bool:
        """True if a formed step has a returned share waiting to be refilled."""
        return any(s is None and not d for rec in state.steps.values() if not rec.end
                   for s, d in zip(rec.shares, rec.done, strict=True))

    def _select(self, part: PartitionMeta, state: TaskState) -> bool:
        """Try to form step ``state.next_step``; True if it was formed."""
        if state.ended or self._has_holes(state):
            return False
        cfg, step = state.config, state.next_step
        # Samplers that want the oldest rows first see a prefix of the ready queue;
        # only when it cannot fill a step do they see every candidate.
        window = max(8 * cfg.batch_size * cfg.dp_size, PREFIX_MIN) \
            if state.sampler.prefix_ok else None
        while True:
            cands = self._candidates(part, state, cfg.dp_size, step, window)
            sel = state.sampler.sample(cands, cfg.batch_size)
            if not sel.ready and window is not None and cands.count >= window:
                self._apply_discards(part, state, sel)
                window = None  # the prefix was not enough: look at everything
                continue
            if sel.ready:
                self._check_selection(state, sel, cfg.dp_size)
                self._apply_discards(part, state, sel)
                state.lease(step, [np.asarray(s, dtype=np.int64) for s in sel.shares],
                            time.time())
                self._timings.handed_out(part.name, state.name, part.write_time[sel.rows], time.time())  # type: ignore[attr-defined]  # noqa: E501
                state.next_step += 1
                return True
            if not self._apply_discards(part, state, sel):
                break
        if not part.closed or state.leased_count() or self._pending(part, state):
            return False
        cands = self._candidates(part, state, cfg.dp_size, step)
        if not cfg.drop_last and cands.count:
            sel = state.sampler.tail(cands, cfg.batch_size)
            if sel.ready:
                self._check_selection(state, sel, cfg.dp_size)
                self._apply_discards(part, state, sel)
                state.lease(step, list(sel.shares), time.time())
                self._timings.handed_out(part.name, state.name, part.write_time[sel.rows], time.time())  # type: ignore[attr-defined]  # noqa: E501
                state.next_step += 1
                return True
            self._apply_discards(part, state, sel)
        leftover = state.queue.ordered()
        if len(leftover):
            self._apply_discards(part, state, Selection.wait({"tail": leftover}))
        state.steps[step] = StepRecord([None] * cfg.dp_size, float("inf"), end=True,
                                       done=[False] * cfg.dp_size)
        state.ended = True
        state.next_step += 1
        return True

    def _refill(self, part: PartitionMeta, state: TaskState, step: int,
                dp_rank: int) -> np.ndarray | None:
        cands = self._candidates(part, state, 1, step)
        sel = state.sampler.sample(cands, state.config.batch_size)
        if not sel.ready and part.closed and not self._pending(part, state):
            sel = state.sampler.tail(cands, state.config.batch_size)
        if not sel.ready:
            return None
        self._check_selection(state, sel, 1)
        self._apply_discards(part, state, sel)
        share = np.asarray(sel.shares[0], dtype=np.int64)
        rec = state.steps[step]
        state.queue.remove(share)
        state.state[share] = LEASED
        state.handed_out += len(share)
        self._timings.handed_out(part.name, state.name, part.write_time[share], time.time())  # type: ignore[attr-defined]  # noqa: E501
        rec.shares[dp_rank] = share
        rec.expiry = time.time() + state.config.lease_timeout
        self._cond.notify_all()  # type: ignore[attr-defined]  # a hole closed: steps may form
        return share

    def _try_step(self, part: PartitionMeta, state: TaskState, step: int,
                  dp_rank: int) -> dict[str, Any] | None:
        now = time.time()
        events.expired(part.name, state.name, state.expire(now))
        while step >= state.next_step and not state.ended:
            if not self._select(part, state):
                return None
        rec = state.steps.get(step)
        if rec is None and state.ended and step >= state.next_step - 1:
            rec = state.steps[state.next_step - 1]
        if rec is None:
            raise LeaseError(
                f"step must not be already acked by every rank, got step={step} of task "
                f"{state.name!r} (next step is {state.next_step}); resume from the loader's "
                f"state_dict to continue where it stopped"
            )
        if rec.end:
            meta = self._placement(part, np.zeros(0, np.int64), state.config.fields)  # type: ignore[attr-defined]
            # An end meta carries the end step itself, so a reader that asked for a later
            # step learns where the stream ended (multi-partition loaders route by it).
            return {**meta, "task": state.name, "step": state.next_step - 1,
                    "dp_rank": dp_rank, "end": True}
        if rec.done[dp_rank]:
            raise LeaseError(f"step {step} of task {state.name!r} was already acked by rank "
                             f"{dp_rank}; it must not be read again")
        share = rec.shares[dp_rank]
        if share is None:
            share = self._refill(part, state, step, dp_rank)
            if share is None:
                return None
        rec.expiry = now + state.config.lease_timeout
        meta = self._placement(part, share, state.config.fields)  # type: ignore[attr-defined]
        return {**meta, "task": state.name, "step": step, "dp_rank": dp_rank, "end": False}

    def _next_expiry(self, state: TaskState) -> float:
        soonest = min((r.expiry for r in state.steps.values()), default=float("inf"))
        return max(0.01, min(60.0, soonest - time.time()))

    def _no_lease(self, state: TaskState, step: int, what: str) -> LeaseError:
        return LeaseError(
            f"{what} needs rows leased to the caller, but step {step} of task {state.name!r} "
            f"holds no open lease (it expired, was released, or was already acked)"
        )

    def _held_rows(self, part: PartitionMeta, state: TaskState, step: int, dp_rank: int,
                   index: Any, generation: Any, what: str) -> np.ndarray:
        rec = state.steps.get(step)
        if rec is None or rec.end or not 0 <= dp_rank < len(rec.shares):
            raise self._no_lease(state, step, what)
        share = rec.shares[dp_rank]
        index = np.asarray(index, dtype=np.int64)
        generation = np.asarray(generation, dtype=np.int64)
        if share is None or rec.done[dp_rank]:
            raise self._no_lease(state, step, what)
        alive = part.used[index] & (part.generation[index] == generation)
        index = index[alive]  # rows cleared meanwhile are simply gone
        if not np.isin(index, share).all():
            raise LeaseError(f"{what} must name rows of step {step} rank {dp_rank} of task "
                             f"{state.name!r}; got rows outside that share")
        return index

    def _ack_rows(self, state: TaskState, step: int, dp_rank: int,
                  rows: np.ndarray) -> np.ndarray:
        rows = rows[state.state[rows] == LEASED]
        state.acks[rows] += 1
        done = rows[state.acks[rows] >= state.config.replicas]
        state.state[done] = ACKED
        state.acked += len(done)
        rec = state.steps[step]
        share = rec.shares[dp_rank]
        if share is not None and (state.state[share] >= ACKED).all():
            rec.done[dp_rank] = True
        if all(rec.done):  # a returned share (None) still needs its refill: keep the step
            del state.steps[step]
        return done

    def _release_share(self, state: TaskState, step: int, dp_rank: int,
                       rows: np.ndarray) -> None:
        state.give_back(rows)
        rec = state.steps[step]
        share = rec.shares[dp_rank]
        if share is None:
            return
        keep = share[state.state[share] != NEW]
        rec.shares[dp_rank] = keep if len(keep) else None
        if len(keep) and (state.state[keep] >= ACKED).all():
            rec.done[dp_rank] = True

    def _finish_rows(self, part: PartitionMeta, rows: np.ndarray) -> list:
        """Free rows that every registered task has acked or discarded."""
        if len(rows) == 0:
            return []
        for other in self._tasks[part.name].values():
            rows = other.finished_rows(rows)
        return self._release_rows(part, rows)  # type: ignore[attr-defined]
