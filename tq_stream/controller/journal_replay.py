"""Replaying ack-journal records (``deploy/ack_journal.py``) onto a restored controller.

A restarted controller loads its last checkpoint, then replays the delivery
changes made after it, in their order: steps formed, shares formed again at
their turn, end steps, discards, acks and task registrations. Each is applied
as the live call applied it, to the rows that still exist with the recorded
generation (rows written after the checkpoint are not in it: they are simply
skipped). Rows a replayed ack or discard finishes
are freed in the controller only: the units are not attached yet, and their
slots still hold the rows' tokens, so the reconciliation that follows frees them
there (``meta_checkpoint.reconcile``).

A record naming a task or partition the restored controller does not know, or a
step already in the checkpoint, changes nothing. Called with the controller's
lock held, before it serves (``Controller.replay_journal``), on its book (the
partitions and tasks), its delivery rules (the acks) and its ``register_task``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from tq_stream.controller.book import Book
from tq_stream.controller.delivery import Delivery
from tq_stream.controller.partition import PartitionMeta
from tq_stream.controller.task import NEW, StepRecord, TaskState
from tq_stream.errors import CheckpointError

RowsOf = Callable[[Any], np.ndarray]  # decodes a recorded array (``ack_journal.rows_of``)


def _alive(part: PartitionMeta, rows: np.ndarray, generation: np.ndarray) -> np.ndarray:
    inside = (rows >= 0) & (rows < part.size)
    rows, generation = rows[inside], generation[inside]
    alive: np.ndarray = rows[part.used[rows] & (part.generation[rows] == generation)]
    return alive


def _target(book: Book, partition: str, task: str) -> tuple[PartitionMeta, TaskState] | None:
    part = book.parts.get(partition)
    state = book.tasks.get(partition, {}).get(task)
    return None if part is None or state is None else (part, state)


def replay(book: Book, delivery: Delivery, register: Callable[..., None],
           records: Iterable[list[Any]], rows_of: RowsOf, source: str) -> dict[str, int]:
    """Apply ``records`` to ``book``; returns how many of each kind changed something.

    Args:
        rows_of: decodes a recorded array (``ack_journal.rows_of``).
        source: the journal file, named by errors.
    Raises:
        CheckpointError: a record of an unknown kind or shape (naming ``source``).
    """
    counts = {"formed": 0, "reformed": 0, "ended": 0, "discarded": 0, "acked": 0,
              "registered": 0}
    for rec in records:
        try:
            _apply(book, delivery, register, rec, rows_of, counts)
        except (TypeError, ValueError, IndexError, KeyError) as exc:
            raise CheckpointError(f"ack journal {source!r} has a malformed {rec[0]!r} "
                                  f"record: {type(exc).__name__}: {exc}") from None
    return counts


def _apply(book: Book, delivery: Delivery, register: Callable[..., None], rec: list[Any],
           rows_of: RowsOf, counts: dict[str, int]) -> None:
    kind = rec[0]
    if kind == "r":
        args = dict(rec[1])
        known = book.tasks.get(args["partition"], {})
        if args["task"] not in known:
            register(**args)
            counts["registered"] += 1
        return
    if kind not in ("a", "f", "s", "e", "d"):
        raise ValueError(f"unknown record kind {kind!r}")
    found = _target(book, rec[1], rec[2])
    if found is None:
        return
    part, state = found
    if kind == "f":
        step = int(rec[3])
        if step < state.next_step:
            return  # in the checkpoint already
        shares = [_alive(part, rows_of(s), rows_of(g)) for s, g in zip(rec[4], rec[5],
                                                                         strict=True)]
        shares = [s[state.state[s] == NEW] for s in shares]
        # The version the step was formed for is not journaled: its shares are checked
        # at their hand-out against the version set for the step then (turns.py).
        state.lease(step, shares).turns = [None] * len(shares)
        state.next_step = step + 1
        counts["formed"] += 1
    elif kind == "s":
        step, rank = int(rec[3]), int(rec[4])
        step_rec = state.steps.get(step)
        if step_rec is None or step_rec.end or not 0 <= rank < len(step_rec.shares):
            return  # fully acked in the checkpoint already
        rows = _alive(part, rows_of(rec[5]), rows_of(rec[6]))
        mine = np.isin(rows, step_rec.shares[rank])
        state.set_share(step, rank, rows[mine | (state.state[rows] == NEW)])
        counts["reformed"] += 1
    elif kind == "e":
        step = int(rec[3])
        if step < state.next_step:
            return
        state.steps[step] = StepRecord([np.zeros(0, np.int64)] * state.config.dp_size,
                                       end=True)
        state.ended = True
        state.next_step = step + 1
        counts["ended"] += 1
    elif kind == "d":
        done = state.discard(str(rec[3]), _alive(part, rows_of(rec[4]), rows_of(rec[5])))
        _finish(book, part, done)
        counts["discarded"] += len(done)
    else:
        step, rank, replica = int(rec[3]), int(rec[4]), int(rec[5])
        step_rec = state.steps.get(step)
        if step_rec is None or step_rec.end or not 0 <= rank < len(step_rec.shares):
            return  # fully acked in the checkpoint already
        rows = _alive(part, rows_of(rec[6]), rows_of(rec[7]))
        rows = rows[np.isin(rows, step_rec.shares[rank])]
        done = delivery.ack_rows(state, step, rank, replica, rows)
        _finish(book, part, done)
        counts["acked"] += len(rows)


def _finish(book: Book, part: PartitionMeta, rows: np.ndarray) -> None:
    """Free rows every declared consumer finished, in the controller only (see the
    module docstring): their slots are reusable once reconciliation freed them."""
    for unit, slots in book.finish_rows(part, rows):
        part.give_slots(unit, slots)


__all__ = ["replay"]
