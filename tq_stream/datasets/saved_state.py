"""What a StreamingDataset saves for torchdata's Stateful protocol, and how a dataset
resumed from it takes over from the iteration that saved it.

``state_dict()`` names whom the dataset reads for, the batches it yielded and has not
acked (trained: acked as the resumed iteration starts) and the session of the
iteration that saved it. The resumed dataset's first iteration cancels that session
(``Controller.cancel``) before anything else, so the steps it held come to the new
reader at once. Its predecessor may never have ended it: a DataLoader worker that
torch killed (SIGTERM, after a 5 s join) or that hung, a trainer that crashed; its
claims would stay live until their lease expired (``lease_timeout``, 300 s by
default) and the resumed reader's wait for them failed (ConfigError, "held by another
live session"). Loading a state is taking over: a predecessor that still runs is
fenced (its waits end, its acks are refused with LeaseTakenOver), so two live sessions
never share a claim. A state without ``session`` (saved by an older version) resumes
as before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tq_stream.errors import ConfigError, LeaseError, check_positive
from tq_stream.meta import BatchMeta

if TYPE_CHECKING:
    from tq_stream.client import Client
    from tq_stream.connection.protocols import ControllerAPI

STATE_KEYS = ("partition", "task", "dp_rank", "replica", "yielded", "session")
Reader = tuple[str, str, int, int | None]  # (partition, task, dp_rank, replica) of a dataset


def saved(reader: Reader, yielded: Sequence[BatchMeta], session: str | None) -> dict[str, Any]:
    """The state of a dataset reading as ``reader`` (``StreamingDataset.state_dict``)."""
    partition, task, dp_rank, replica = reader
    return {"partition": partition, "task": task, "dp_rank": dp_rank, "replica": replica,
            "yielded": [[m.partition, m.step] for m in yielded], "session": session}


def loaded(reader: Reader, state: object) -> tuple[list[tuple[str, int]], str | None]:
    """The batches ``state`` lists as yielded, and the session that saved it.

    Raises:
        ConfigError: ``state`` is not a state of a dataset reading as ``reader``.
    """
    keys = set(state) if isinstance(state, dict) else None
    if keys is None or not set(STATE_KEYS) - {"session"} <= keys <= set(STATE_KEYS):
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ConfigError(f"state must have keys {sorted(STATE_KEYS)}, got {got}")
    assert isinstance(state, dict)
    theirs = (state["partition"], state["task"], state["dp_rank"], state["replica"])
    if tuple(reader) != theirs:
        raise ConfigError(f"state must come from a dataset of (partition, task, dp_rank, "
                          f"replica) {tuple(reader)}, got {theirs}")
    return [(str(p), int(s)) for p, s in state["yielded"]], saved_session(state)


def saved_session(state: Mapping[str, object]) -> str | None:
    """The session of the iteration that saved ``state`` (None: ended, or an older state).

    Raises:
        ConfigError: ``state['session']`` is neither None nor a non-empty str.
    """
    session = state.get("session")
    if session is not None and (not isinstance(session, str) or not session):
        raise ConfigError(f"state['session'] must be the session id (a non-empty str) of "
                          f"the iteration that saved it, or None, got {session!r}")
    return session


LOADER_KEYS = ("partition", "task", "dp_rank", "step", "yielded", "session")


def loader_loaded(reader: tuple[str, str, int], state: Mapping[str, Any]
                  ) -> tuple[int, list[tuple[str, int]], str | None]:
    """A ``StreamingDataLoader`` state of a loader reading as ``reader`` (partition,
    task, dp_rank): (its next step, the steps it yielded, its iteration's session).

    Raises:
        ConfigError: ``state`` is not such a state.
    """
    if not set(LOADER_KEYS) - {"session"} <= set(state) <= set(LOADER_KEYS):
        raise ConfigError(f"state must have keys {sorted(LOADER_KEYS)} (session may be "
                          f"absent: an older state), got {sorted(state)}")
    session = saved_session(state)
    theirs = (state["partition"], state["task"], state["dp_rank"])
    if tuple(reader) != theirs:
        raise ConfigError(f"state must come from a loader of (partition, task, dp_rank) "
                          f"{tuple(reader)}, got {theirs}")
    step = check_positive("state['step']", state["step"], allow_zero=True)
    return step, [(str(p), int(s)) for p, s in state["yielded"]], session


def take_over(controller: ControllerAPI, predecessor: str | None, session: str) -> None:
    """End ``predecessor``'s claims and waits (it saved the state ``session`` resumes)."""
    if predecessor and predecessor != session:
        controller.cancel(session=predecessor)


def ack_saved(client: Client, task: str, dp_rank: int, replica: int | None, timeout: float,
              steps: Sequence[tuple[str, int]]) -> None:
    """Ack ``steps`` (partition, step) a loaded state lists as yielded, if nobody did (a
    crash after the save, before their ack); each once."""
    for partition, step in steps:
        try:
            meta = client.get_meta(partition, task, step, dp_rank, timeout=timeout,
                                   replica=replica)
            if meta is not None and not meta.end:
                client.ack(meta)
        except LeaseError:
            pass  # acked already


__all__ = ["LOADER_KEYS", "STATE_KEYS", "ack_saved", "loaded", "loader_loaded", "saved",
           "saved_session", "take_over"]
