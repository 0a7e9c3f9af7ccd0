"""Takeovers: which sessions lost a share to another reader, so their late work is refused.

A claim on (step, rank, replica) lapses when its session stops renewing it (the process
was paused, frozen or cut off for longer than ``lease_timeout``) or is cancelled. The
share then goes to the next reader. If the first session comes back, its writes through
the old BatchMeta (``put_data``) and its ``ack`` would land on rows another reader owns
now: a result overwritten after the new reader wrote it, a step acked for work it did
not finish. So each lapse is remembered, and a claim of the same share by *another*
session marks the lapsed one as taken over; the controller then refuses that session's
``ack`` and ``put_data`` of the share with ``LeaseTakenOver`` (a ``reserve`` and a
``commit`` both check, so a put that started before the takeover does not commit after
it). A lapsed claim nobody took yet is no takeover: its late ack or write is accepted.

Both maps are bounded (``LIMIT`` entries, oldest forgotten first) and checkpointed with
their task (``state_dict``). They are not in the ack journal: a controller restarted from
its checkpoint does not know of a lapse or takeover after that checkpoint (seconds old),
and accepts such a late ack.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import TypeVar

from tq_stream.errors import ConfigError, LeaseTakenOver, check_name

LIMIT = 65536  # lapsed claims and takeovers remembered, each
ShareKey = tuple[int, int, int]  # (step, rank, replica)
K = TypeVar("K")


class Takeovers:
    """Lapsed claims and the sessions another reader took their share from."""

    def __init__(self, limit: int = LIMIT) -> None:
        self.limit = limit
        self._lapsed: OrderedDict[ShareKey, str] = OrderedDict()
        self._taken: OrderedDict[tuple[ShareKey, str], None] = OrderedDict()

    def lapsed(self, key: ShareKey, session: str) -> None:
        """``session``'s claim on ``key`` expired or was cancelled."""
        if session:
            self._lapsed[key] = session
            self._lapsed.move_to_end(key)
            _trim(self._lapsed, self.limit)

    def claimed(self, key: ShareKey, session: str) -> None:
        """``session`` claims ``key``: a lapsed other session's share is taken over."""
        before = self._lapsed.pop(key, None)
        if before is not None and before != session:
            self._taken[(key, before)] = None
            _trim(self._taken, self.limit)

    def state_dict(self) -> dict[str, list[list[int | str]]]:
        """Plain data for a checkpoint: ``{"lapsed": [[step, rank, replica, session]],
        "taken": [...]}``, oldest first."""
        return {"lapsed": [[*k, s] for k, s in self._lapsed.items()],
                "taken": [[*k, s] for k, s in self._taken]}

    def load_state_dict(self, state: Mapping[str, list[list[int | str]]]) -> None:
        """Restore what ``state_dict`` gave (a checkpoint of an earlier version has none)."""
        for step, rank, replica, session in state.get("lapsed", []):
            self.lapsed((int(step), int(rank), int(replica)), str(session))
        for step, rank, replica, session in state.get("taken", []):
            self._taken[((int(step), int(rank), int(replica)), str(session))] = None
        _trim(self._taken, self.limit)

    def check(self, key: ShareKey, session: str, task: str, what: str) -> None:
        """Raise LeaseTakenOver if another reader took ``key`` from ``session``; a write
        is also told how long the session's claim holds for sure (``left``)."""
        if session and (key, session) in self._taken:
            step, rank, replica = key
            raise LeaseTakenOver(
                f"session must still hold the share it {what}, got session="
                f"{session[:12]!r}: its lease on step {step} of task {task!r} (rank "
                f"{rank}, replica {replica}) ended, so another reader took the share over: "
                f"the session was cancelled (a loader resumed from this one's saved state "
                f"takes over its session) or its lease lapsed (its process stopped "
                f"renewing it for longer than lease_timeout); that reader's work counts, "
                f"nothing of this call was applied")


def check_holder(holder: object) -> tuple[str, ShareKey, str] | None:
    """``holder`` of a write through a BatchMeta: ``{"task", "step", "dp_rank", "replica",
    "session"}`` -> (task, (step, rank, replica), session), or None."""
    if holder is None:
        return None
    if not isinstance(holder, Mapping) or set(holder) != set(HOLDER_KEYS):
        raise ConfigError(f"holder must be a dict of exactly {list(HOLDER_KEYS)}, got "
                          f"{holder!r:.200}")
    ids = [holder[k] for k in ("step", "dp_rank", "replica")]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in ids):
        raise ConfigError(f"holder's step, dp_rank and replica must be ints, got {ids!r:.200}")
    session = holder["session"]
    if not isinstance(session, str):
        raise ConfigError(f"holder's session must be a str, got {session!r:.100}")
    return check_name("holder's task", holder["task"]), (ids[0], ids[1], ids[2]), session


HOLDER_KEYS = ("task", "step", "dp_rank", "replica", "session")


def _trim(d: OrderedDict[K, None] | OrderedDict[K, str], limit: int) -> None:
    while len(d) > limit:
        d.popitem(last=False)
