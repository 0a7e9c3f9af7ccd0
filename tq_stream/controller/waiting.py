"""What a task's rows wait for, and who holds its leases (``stats()``, lock held).

A stalled trainer should show why: the rows the task has not been handed that are
not ready yet, counted by the field or tag they lack ("308 rows lack field
`reward`"), and each claim on a share with its holder, age and last heartbeat, so
a dead consumer (no heartbeat for a while) does not look like a slow one.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tq_stream.controller.partition import PartitionMeta
from tq_stream.controller.task import NEW, Claim, TaskState
from tq_stream.errors import format_seconds

MAX_LEASES = 32  # claims listed per task in stats() (the oldest first)


def not_ready(part: PartitionMeta, state: TaskState) -> dict[str, Any]:
    """``{"rows": n, "lack_fields": {field: rows}, "lack_tags": {tag: rows}}``: live rows
    this task has not been handed that are not ready for it, and what they lack."""
    n = min(part.size, len(state.state), len(state.queue.avail))
    waiting = part.row_mask(n) & (state.state[:n] == NEW) & ~state.queue.avail[:n]
    count = int(np.count_nonzero(waiting))
    fields: dict[str, int] = {}
    tags: dict[str, int] = {}
    if count:
        for f in state.config.fields:
            r = part.ready.get(f)
            lack = count if r is None else int(np.count_nonzero(waiting & ~r[:n]))
            if lack:
                fields[f] = lack
        for t in state.tags:
            p = part.tags.present.get(t)
            lack = count if p is None else int(np.count_nonzero(waiting & ~p[:n]))
            if lack:
                tags[t] = lack
    return {"rows": count, "lack_fields": fields, "lack_tags": tags}


def leases(state: TaskState, now: float) -> list[dict[str, Any]]:
    """The claims on this task's shares (at most ``MAX_LEASES``, the oldest first):
    step, rank, replica, rows, holder (session and consumer name), age, seconds since
    its last heartbeat and until it expires."""
    out: list[dict[str, Any]] = []
    for step, rec in state.steps.items():
        for (rank, replica), c in rec.claims.items():
            out.append({"step": step, "dp_rank": rank, "replica": replica,
                        "rows": len(rec.shares[rank]), "session": c.session,
                        "consumer": c.consumer,
                        "age": round(now - c.since, 3) if c.since else None,
                        "heartbeat_age": round(now - c.renewed, 3) if c.renewed else None,
                        "expires_in": round(c.expiry - now, 3)})
    out.sort(key=lambda lease: -(lease["age"] or 0.0))
    return out[:MAX_LEASES]


def holders(held: list[tuple[int, int, Claim]], now: float, most: int = 4) -> str:
    """Who holds the shares a wait waited for, from (step, rows, claim) triples: "step 1
    (2 rows) held by session 5f0c1d2e3a4b (consumer 'reward'), lease age 12 s, last
    heartbeat 1 s ago" (at most ``most`` of them, then how many more)."""
    said = []
    for step, rows, c in held[:most]:
        name = f"consumer {c.consumer!r}" if c.consumer else "no consumer name"
        age = format_seconds(now - c.since) if c.since else "unknown"
        beat = f"{format_seconds(now - c.renewed)} ago" if c.renewed else "unknown"
        said.append(f"step {step} ({rows} rows) held by session {c.session[:12]} ({name}), "
                    f"lease age {age}, last heartbeat {beat}")
    more = f" and {len(held) - most} more" if len(held) > most else ""
    return "; ".join(said) + more
