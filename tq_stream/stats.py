"""The shapes of what ``Stream.stats()``, ``Stream.deployment_stats()`` and
``Stream.processes()`` return.

``stats()`` keeps its plain-dict form (it travels over RPC unchanged); these
TypedDicts document every key. Counters (``*_total`` in Prometheus terms) only grow
for the life of the deployment; gauges are the value now.

Examples:
    >>> s = stream.stats()["train"]["tasks"]["actor"]
    >>> s["available"], s["oldest_ready_age"], s["rates"]["acked"]
    (12, 0.8, 250.0)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypedDict


class HistogramStats(TypedDict):
    """Fixed-bucket histogram: ``counts[i]`` observations were <= ``buckets[i]`` seconds
    (and > ``buckets[i-1]``); the last count is above the last bucket."""

    buckets: list[float]
    counts: list[int]
    sum: float
    count: int


class Rates(TypedDict):
    """Rows per second over about the last minute (between ``stats()`` calls)."""

    handed_out: float
    acked: float


class _LeaseCounters(TypedDict):
    renewed: int  # claims renewed by consumers' heartbeats
    expired: int  # rows whose reader's claim ran out (its process stopped renewing)
    cancelled: int  # rows whose reader's claim ended with its session (a loader stopped)
    redelivered: int  # rows handed out again (same step and rank) after an expiry,
    # a release or a replaced consumer


class NotReady(TypedDict):
    """Live rows a task has not been handed that are not ready for it (gauges):
    ``lack_fields["reward"] == 308``: 308 of them lack field ``reward``."""

    rows: int
    lack_fields: dict[str, int]
    lack_tags: dict[str, int]  # tags its sampler requires


class LeaseStats(TypedDict):
    """One claim on a share: who holds it and whether its heartbeat still runs (a
    dead consumer's ``heartbeat_age`` grows until it expires; a slow one's stays
    below ``lease_timeout / 4``)."""

    step: int
    dp_rank: int
    replica: int
    rows: int
    session: str
    consumer: str  # the client's consumer name ("" for a loader)
    age: float | None  # seconds since it was claimed (None: restored from a checkpoint)
    heartbeat_age: float | None  # seconds since its last renewal
    expires_in: float  # seconds left without a renewal


class TaskStats(_LeaseCounters):
    """One consumer task on one partition."""

    fields: list[str]
    available: int  # rows ready for this task and not handed out (gauge)
    leased: int  # rows in formed steps not acked by every replica yet (gauge)
    claimed: int  # rows of shares a live consumer session reads now (gauge)
    handed_out: int  # rows handed out for the first time (counter; see redelivered)
    acked: int  # rows acked by every replica (counter)
    discarded: dict[str, int]  # rows dropped without delivery, by reason (counters)
    next_step: int
    first_unacked: list[int]  # per DP rank: the first step it has not fully acked
    version: int | None
    ended: bool
    at: float  # epoch seconds when these figures were read
    oldest_ready_age: float  # seconds the oldest available row has been ready (0: none)
    rates: Rates
    get_meta_wait: HistogramStats  # seconds a get_meta call waited for its rows
    write_to_handout: HistogramStats  # seconds from a row's last write to its hand-out
    not_ready: NotReady  # rows not handed out yet that are not ready, and what they lack
    leases: list[LeaseStats]  # claims on its shares now, the oldest first (at most 32)


class BlockedSeconds(TypedDict):
    """Seconds writers spent blocked, by reason (counters)."""

    capacity: float  # reserve waiting for a bounded partition to free rows
    admission: float  # Writer.reserve waiting for the staleness window
    memory_budget: float  # a put paused for acks to free room under a unit's memory_budget


class SharedStats(TypedDict):
    """Shared entries of a partition: ``Stream.stats()[partition]["shared"]``."""

    entries: int  # live entries (not counted in ``rows``; each takes a row of capacity)
    bytes: int  # bytes put into them
    refs: int  # live rows naming one
    fields: list[str]  # the partition's shared fields


class MediaStats(TypedDict):
    """Media held by pins of a partition: ``Stream.stats()[partition]["media"]``."""

    entries: int  # entries a live pin holds (``Media.put``, ``Media.pin``)
    bytes: int  # bytes put into them
    pins: dict[str, int]  # live pins per holder ("host:pid"; "restored from host:pid"
    # for pins a restored deployment holds)
    bytes_by_holder: dict[str, int]  # bytes of the entries each holder pins


class PartitionStats(TypedDict):
    """One partition: ``Stream.stats()[partition]``."""

    rows: int  # live rows (gauge)
    capacity: int | None
    closed: bool
    consumers: list[str] | None  # declared consumer tasks (None: not declared)
    held: dict[str, int]  # live rows not yet finished, per declared consumer (or
    # {"undeclared": rows} for a partition whose rows stay until cleared)
    rows_created: int  # rows ever created (counter)
    rows_lost: int  # rows dropped with their storage unit (counter)
    lost_writes_skipped: int  # rows puts named after they were lost, not written (counter)
    fields: dict[str, str]  # field -> schema description
    shared: SharedStats  # entries put once and named by rows (``Writer.put_shared``)
    media: MediaStats  # what media handles hold, and by whom (``tq_stream.media``)
    blocked_seconds: BlockedSeconds
    tasks: dict[str, TaskStats]


class RpcStats(TypedDict):
    """Calls a server ran, per method, and the errors they raised by exception name."""

    calls: dict[str, int]
    errors: dict[str, dict[str, int]]


class UnitPartitionStats(TypedDict):
    rows: int  # slots holding a row
    fields: dict[str, int]  # field -> bytes allocated in memory (its sum: in memory)
    spilled: int  # bytes of the partition's rows on the unit's local disk
    budget: int | None  # memory_budget (None: unbounded)


class UnitStats(TypedDict):
    """One storage unit, as ``deployment_stats()["units"][i]``."""

    unit: int
    up: bool  # it answered; when False only ``unit`` and ``error`` are meaningful
    error: str
    pid: int
    nbytes: int  # bytes allocated for row data
    partitions: dict[str, UnitPartitionStats]
    rpc: RpcStats


class ControllerServerStats(TypedDict):
    pid: int
    rpc: RpcStats


class DeploymentStats(TypedDict):
    """``Stream.deployment_stats()``: the servers of the deployment."""

    mode: str
    controller: ControllerServerStats
    units: list[UnitStats]


@dataclass(frozen=True)
class ProcessInfo:
    """One process of a deployment (``Stream.processes()``).

    Attributes:
        role: "controller" or "unit".
        index: the unit's index (0 for the controller).
        pid: its process id (on ``host``).
        host: the machine it runs on (hostname/boot id).
        address: where clients reach it (None in embedded mode).
        folder: the folder of its unix sockets, removed when the deployment stops
            (None when it serves on tcp only).
    """

    role: str
    index: int
    pid: int
    host: str
    address: str | None
    folder: str | None


def describe(waiting: Mapping[str, Any]) -> str:
    """``not_ready`` in words: "308 rows lack field 'reward', 12 lack tag 'score'"."""
    parts = [f"{n} lack field {f!r}" for f, n in waiting["lack_fields"].items()]
    parts += [f"{n} lack tag {t!r}" for t, n in waiting["lack_tags"].items()]
    if not parts:
        return ""
    return f"{waiting['rows']} rows not ready: " + ", ".join(parts)
