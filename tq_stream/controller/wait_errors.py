"""What a waiting ``get_meta`` lacks, and the error it ends with at its timeout.

Plain functions (lock held): ``waiting_for`` says what the wait waits for (rows
the sampler needs, tags no row has, a step formed ahead of its turn, a share gone
stale, writers blocked by a full partition), and ``wait_error`` picks the error a
timed-out wait raises: the end held by other live sessions, a replica claimed by
another session (ConfigError naming ``replica``), fields never written, or a
partition never written to (a misspelt name).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from tq_stream import fieldpath
from tq_stream.controller import turns
from tq_stream.controller.candidates import candidates
from tq_stream.controller.capacity import held_hint
from tq_stream.controller.delivery import Delivery
from tq_stream.controller.partition import PartitionMeta
from tq_stream.controller.task import TaskState
from tq_stream.controller.waiting import holders, not_ready
from tq_stream.errors import ConfigError, WaitTimeout, format_seconds
from tq_stream.stats import describe


def waiting_for(part: PartitionMeta, state: TaskState, step: int | None, dp_rank: int,
                now: float) -> str:
    """What a waiting get_meta lacks, e.g. "task 't' step 0 (rank 0): 1 complete
    group of 4 ready (4 rows), 2 needed per step"."""
    cfg = state.config
    cands = candidates(part, state, cfg.dp_size, state.next_step)
    try:
        progress = state.sampler.progress(cands, cfg.batch_size)
    except Exception as exc:  # a message must not hide the wait
        progress = f"{cands.count} rows ready ({type(exc).__name__} describing them)"
    which = "the next step" if step is None else f"step {step}"
    missing = [t for t in state.tags if t not in part.tags.present]
    hint = f"; no row has tag(s) {missing} the sampler needs yet" if missing else ""
    hint += reform_hint(part, state, step, dp_rank)
    turn = state.version_at(state.next_step)
    if turn != state.version:
        still = format_seconds(max(0.0, now - state.last_move))
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


def wait_error(delivery: Delivery, parts: Mapping[str, PartitionMeta], part: PartitionMeta,
               state: TaskState, args: tuple[Any, ...], timeout: float, now: float) -> Exception:
    """The error a ``get_meta`` that waited ``timeout`` seconds ends with (``args``:
    its step, dp_rank, replica, session, consumer; ``now``: wall-clock seconds)."""
    step, dp_rank, replica, session, _consumer = args
    if step is None and state.ended:
        held = delivery.held_elsewhere(part, state, dp_rank, replica, session)
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
    claim = None if rec is None else delivery.held_by_other(rec, (dp_rank, replica), session)
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
    rows = part.live - part.shared.count  # shared entries are no rows
    if unknown and rows:  # a timeout still: a later stage may write the field
        return WaitTimeout(
            f"get_meta waited timeout={format_seconds(timeout)} for task {state.name!r} "
            f"on partition "
            f"{part.name!r}, but fields {unknown} were never written to any of its "
            f"{rows} rows (known fields: {sorted(part.schemas)}); check the name, "
            f"or start the stage that writes them")
    hint = ""
    if not part.schemas:  # a misspelt partition looks like this: help find the name
        written = sorted(n for n, p in parts.items() if p.schemas)
        hint = (f"; no row was ever written to partition {part.name!r} (partitions "
                f"written to: {written[:20]}): check the name, or start its producer")
    return WaitTimeout(
        f"get_meta waited timeout={format_seconds(timeout)} on partition {part.name!r} for "
        f"{waiting_for(part, state, step, dp_rank, now)}{hint}")


def reform_hint(part: PartitionMeta, state: TaskState, step: int | None,
                rank: int) -> str:
    """Why a reader of a formed step waits: its share went stale (for a WaitTimeout)."""
    rec = None if step is None else state.steps.get(step)
    if rec is None or rec.turns is None or step is None:
        return ""
    version = state.version_for(step)
    if not turns.behind(rec, rank, version):
        return ""
    share = replace(candidates(part, state, 1, step, index=rec.shares[rank]),
                    version=version)
    n = int(np.count_nonzero(state.sampler.out_of_bound(share)))
    return (f"; step {step}'s share for rank {rank} was formed for version "
            f"{rec.turns[rank]} and {n} of its {share.count} rows are stale at version "
            f"{version}, set for that step: it waits for ready rows within the bound to "
            f"form it again")
