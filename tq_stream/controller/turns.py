"""Shares checked at their turn: the staleness bound at hand-out (issue 20 item 2).

A step is formed once, for the version the consumer holds at its turn as far as it is
known then (``TaskState.version_at``; a step formed ahead by a prefetch, by a DP peer
or by a read of a later step by number). When its share is handed out after the
consumer set a newer version for that step (``TaskState.version_for``: a version it
set, never a prediction), the task's sampler says which rows of the share are now out
of its bound (``Sampler.out_of_bound``). Those rows are discarded (reason ``stale``:
stale against a version the trainer set) and the rank's share is formed again from its
rows still in bound and the ready rows, by the same sampler; the new share is what
every reader of that (step, rank) gets from then on. A loader compares the version a
batch's share was checked for (``BatchMeta.turn``) with its own when it yields the
batch, and asks for the step again when its version is newer (``datasets/at_yield.py``).

The rule for TP/PP peers (replicas of one dp_rank, which must train identical rows):

- a share is never changed once any replica acked a row of it, nor for a reader that
  may not take it (another live session claims that (step, rank, replica));
- otherwise a share is re-formed at most once per version set for its step, by the
  first reader that finds the version newer than the share's ``turn``; every later
  reader of that (step, rank) gets the re-formed share. Peers set the same version for
  the same step (one model), so each peer holding the earlier share finds its own
  version newer than that share's ``turn`` at its yield too and asks again: all
  replicas train the same rows.

While no replacement is ready on an open partition, the old share stays as it is and
its reader waits (woken by new rows). On a drained partition the share keeps what the
sampler's ``tail`` gives; with nothing left it is empty and its readers skip the step
(as for a share whose rows died with their unit).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from tq_stream.controller.task import StepRecord, TaskState
from tq_stream.errors import StateError
from tq_stream.samplers.base import Candidates, Sampler, merge_discards

EMPTY = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class Reform:
    """What re-forming a share decided: ``stale`` rows of the old share (discarded),
    the new ``share`` (empty: nothing left for the rank), and the rows the sampler
    dropped while choosing it, by reason."""

    stale: np.ndarray
    share: np.ndarray
    discard: Mapping[str, np.ndarray] = field(default_factory=dict)


def behind(rec: StepRecord, rank: int, version: int | None) -> bool:
    """Rank's share was formed (or last checked) for an older version than
    ``version``, the one the consumer set for its step."""
    if rec.turns is None or version is None:
        return False
    turn = rec.turns[rank]
    return turn is None or version > turn


def acked(state: TaskState, rec: StepRecord, rank: int) -> bool:
    """Some replica acked a row of rank's share: it was trained and stays as it is."""
    share = rec.shares[rank]
    return bool(len(share)) and bool(state.acks[share].any())


def reform(sampler: Sampler, share: Candidates, pool: Callable[[np.ndarray], Candidates],
           batch_size: int, drained: bool) -> Reform | None:
    """Check ``share`` (its rows, with ``version`` the one set for the step) and, if
    rows are out of the bound, choose the rank's new share from ``pool(kept)`` (the
    kept rows first, then the ready rows). None: rows are out of the bound and no
    replacement is ready yet (the partition may still bring rows): wait."""
    out = np.asarray(sampler.out_of_bound(share), dtype=bool)
    if out.shape != (share.count,):
        raise StateError(f"sampler {type(sampler).__name__}.out_of_bound must return a "
                         f"boolean mask of {share.count} rows, got shape {out.shape}")
    if not out.any():
        return Reform(EMPTY, share.index)
    kept = share.index[~out]
    cands = pool(kept)
    sel = sampler.sample(cands, batch_size)
    dropped = dict(sel.discard)
    if not sel.ready:
        if not drained:
            return None
        sel = sampler.tail(cands, batch_size)
        # tail sees the same candidates: its discards repeat those of sample
        dropped = {r: np.unique(v) for r, v in merge_discards(dropped, sel.discard).items()}
    new = EMPTY
    if sel.ready:
        if len(sel.shares) != 1:
            raise StateError(f"sampler {type(sampler).__name__} must return 1 share for a "
                             f"share formed again for one rank, got {len(sel.shares)}")
        new = np.asarray(sel.shares[0], dtype=np.int64)
        if len(np.unique(new)) != len(new) or not np.isin(new, cands.index).all():
            raise StateError(f"sampler {type(sampler).__name__} must re-form a share from "
                             f"distinct candidate rows, got {new.tolist()[:8]}")
    return Reform(share.index[out], new, dropped)


__all__ = ["EMPTY", "Reform", "acked", "behind", "reform"]
