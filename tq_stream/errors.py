"""The one exception tree of tq_stream.

    TQError
    ├── ConfigError            a bad argument or configuration value (also a ValueError)
    │   ├── SchemaError        data whose dtype/shape/kind disagrees with the field's schema
    │   └── KeyConflictError   duplicate keys in one put, or keys that do not exist
    ├── StateError             an operation not allowed in the current state
    │   ├── ClosedError        use after close(), or a write to a closed partition
    │   │   └── DeploymentGone a deployment whose owner died or closed it: nothing serves
    │   ├── LeaseError         ack/release of rows this consumer does not hold
    │   │   ├── LeaseTakenOver a write or ack by a reader whose lease lapsed and went to another
    │   │   └── ReplicaClash   a read of a share its replica acked (two TP/PP peers reading as
    │   │                      one replica: it names replicas= and replica=)
    │   └── LengthUnknownError len() of an open stream (also a TypeError)
    ├── WaitTimeout            a bounded wait expired (also a TimeoutError)
    │   ├── Unreachable        no server accepted the connection: the request was never sent
    │   ├── TurnNotReached     a step formed ahead of the trainer's turn waited its timeout
    │   ├── ConnectionLost     the connection broke after the request was sent
    │   └── WorkerStalled      a DataLoader worker alive but delivering nothing
    ├── SerializationError     a malformed, truncated or unsupported message
    │   └── CheckpointError    a checkpoint file that is missing, damaged or inconsistent
    ├── AuthError              an admin call without the deployment owner's token
    └── RemoteError            an error raised on the other side of a transport

Every message names the argument, the rule and the offending value, e.g.
``batch_size must be >= 1, got 0``. Helpers below build the common messages so
the same sentence is never pasted into several files.
"""

from __future__ import annotations


class TQError(Exception):
    """Base class of every error raised by tq_stream."""


class ConfigError(TQError, ValueError):
    """A bad argument or configuration value."""


class SchemaError(ConfigError):
    """Data that disagrees with the schema fixed by a field's first write."""


class KeyConflictError(ConfigError):
    """Duplicate keys in one request, or keys that do not exist."""


class StateError(TQError):
    """An operation that is not allowed in the current state."""


class ClosedError(StateError):
    """Use of a closed object, or a write to a closed partition."""


class DeploymentGone(ClosedError):
    """The deployment a handle points at is gone (its owner process died, or it was
    closed): nothing will serve or restart its servers, so a call is not sent again."""


class MemoryBudgetExceeded(StateError):
    """A put that would take a partition's column bytes in memory past its
    ``memory_budget`` with nothing left to spill: the writer aborts its rows and puts
    again every 0.2 s within its timeout (consumers' acks free room), then raises it."""


class MemoryBudgetTooSmall(MemoryBudgetExceeded):
    """A put whose rows need more than the partition's ``memory_budget`` by themselves
    (a store holds at least 16 rows of each in-memory field): it could never fit however
    many rows are freed, so it fails at once (not put again); raise the budget."""


class LeaseError(StateError):
    """An ack/release/renew of rows the caller does not hold."""


class LeaseTakenOver(LeaseError):
    """A ``put_data`` or ``ack`` through a BatchMeta whose lease lapsed (its process stopped
    renewing it: paused, frozen, cut off) and was handed to another reader since: that
    reader's work counts, this one's is refused (nothing of it was written or acked)."""


class ReplicaClash(LeaseError):
    """A read of a step's share that its (rank, replica) acked already: two TP/PP peers
    reading as one replica (``replicas=`` / ``replica=`` missing), or a loop reading a
    step it trained. Its message names ``replicas=`` and ``replica=``."""


class LengthUnknownError(StateError, TypeError):
    """len() of a loader whose number of steps is not known yet (an open partition)."""


class WaitTimeout(TQError, TimeoutError):
    """A bounded wait expired before its condition held."""


class Unreachable(WaitTimeout):
    """No server accepted the connection before the deadline: the request was never sent
    (so it had no effect, and may be sent again)."""


class TurnNotReached(WaitTimeout):
    """A step formed ahead of its turn waited its timeout while the trainer, alive (its
    session holds the batch it trains), was still on an earlier step: the step waits
    for that turn (see ``StalenessSampler``); asking again is safe."""


class WorkerStalled(WaitTimeout):
    """A DataLoader worker process of a StreamingDataLoader delivered neither a batch nor
    an error within the loader's ``timeout`` although it lives (stuck, e.g. on a lock or
    an import a thread of its parent held when it was forked): the loader stopped its
    workers; iterating it again resumes at the first step not acked."""


class ConnectionLost(WaitTimeout):
    """The connection broke after the request was sent (the server went away): it may or
    may not have run."""


class SerializationError(TQError):
    """A malformed, truncated or unsupported message."""


class CheckpointError(SerializationError):
    """A checkpoint file that is missing, truncated, corrupted or from another save."""


class AuthError(TQError, PermissionError):
    """An admin call (attach or drop units, load or read the controller state, clear a
    whole partition, ...) from a client that lacks the deployment owner's token."""


class RemoteError(TQError):
    """An error raised on the far side of a transport, carried back as a value.

    Attributes:
        kind: the class name of the remote exception.
        where: the address or component that raised it.
    """

    def __init__(self, kind: str, message: str, where: str = "") -> None:
        super().__init__(f"{kind} at {where}: {message}" if where else f"{kind}: {message}")
        self.kind = kind
        self.where = where


def shown(value: object, limit: int = 120) -> str:
    """``repr(value)`` as messages show it: at most ``limit`` characters (a list of
    thousands of keys passed where a name goes would otherwise fill the screen)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def check_positive(name: str, value: object, *, allow_zero: bool = False) -> int:
    """Return ``value`` as an int, or raise ConfigError naming ``name``."""
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{name} must be an int >= {low}, got {shown(value)}")
    return value


def check_timeout(name: str, value: object) -> float:
    """Return a timeout in seconds (None = wait forever is not allowed)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(f"{name} must be a number of seconds > 0, got {shown(value)}")
    return float(value)


def check_name(name: str, value: object) -> str:
    """Return ``value`` if it is a non-empty str (partition, task, field names)."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{name} must be a non-empty str, got {shown(value)}")
    return value


def check_consumers(value: object) -> tuple[str, ...]:
    """Return declared consumer task names: a non-empty list of distinct non-empty str."""
    if isinstance(value, str) or not isinstance(value, list | tuple) or not value or \
            not all(isinstance(v, str) and v for v in value) or len(set(value)) != len(value):
        raise ConfigError(f"consumers must be a non-empty list of distinct task names, "
                          f"got {shown(value)}")
    return tuple(value)


def check_replica(value: object, replicas: int) -> int:
    """Return which TP/PP peer (``replica``) of its rank a consumer is. ``None`` means 0,
    and is refused when the rank has several peers: the library cannot know the
    framework's layout of TP/PP/DP ranks, and two peers that both ack as replica 0 leave
    every row leased forever."""
    if value is None:
        if replicas > 1:
            raise ConfigError(
                f"replica must be given when replicas > 1 (replicas={replicas}: which TP/PP "
                f"peer of its dp_rank this consumer is, an int in [0, {replicas}), each peer "
                f"its own, e.g. tp_rank + tp_size * pp_rank), got None")
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < replicas:
        raise ConfigError(f"replica must be an int in [0, {replicas}) (replicas={replicas}), "
                          f"got {shown(value)}")
    return value


def format_seconds(value: float) -> str:
    """A duration as messages print it: ``15 s``, ``2.5 s``, ``0.05 s`` (a timeout shortened
    by the time already waited reads as the round number it nearly is, not
    ``14.999999639999942s``)."""
    value = float(value)
    if abs(value) >= 10:
        text = f"{value:.0f}"
    elif abs(value) >= 0.1:
        text = f"{value:.2f}".rstrip("0").rstrip(".")
    else:
        text = f"{value:.2g}"
    return f"{text} s"
