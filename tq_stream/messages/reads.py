"""Messages of consumers and of rows by key: steps, acks, leases, tasks, lookups.

Each RPC is its request struct (the method's keyword arguments, defaults included),
its reply type and its flags (``rpc.py``). Rows by key come back as ``Found`` (a
lookup), ``Located`` (a locate) and a step's rows as ``StepMeta`` (a get_meta), all
built by the controller (``controller/access.py``, ``controller/delivery.py``); row
indices, generations, units and slots are int numpy arrays. Replies still given as
plain values are declared as such (a dict of the shape the controller method
documents: the public stats, ``list_rows``' rows as ``KV.list`` returns them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from tq_stream.config import DEFAULT_LEASE_TIMEOUT
from tq_stream.messages.rpc import Rpc

Plain = dict[str, Any]  # a reply given as a plain dict (shape: the controller method's)


class SharedPlaces(msgspec.Struct, kw_only=True):
    """The shared entries rows read ``fields`` from: ``pos[i]``, row i's position among
    the distinct entries (-1: none), placed by ``index``, ``unit``, ``slot`` and
    ``generation`` (``shared_refs.SharedRefs`` on the client)."""

    fields: list[str]
    pos: np.ndarray
    index: np.ndarray
    unit: np.ndarray
    slot: np.ndarray
    generation: np.ndarray


class Found(msgspec.Struct, kw_only=True):
    """Rows by key (a ``lookup``): where they live, their tags (one dict per row;
    None: not asked), the ``fields`` read and their ``schemas`` (FieldSchema dicts),
    and the shared entries of shared fields among them (None: none)."""

    partition: str
    keys: list[str]
    index: np.ndarray
    unit: np.ndarray
    slot: np.ndarray
    generation: np.ndarray
    fields: list[str]
    schemas: dict[str, dict[str, Any]]
    tags: list[dict[str, Any]] | None = None
    shared: SharedPlaces | None = None


class Located(Found, kw_only=True):
    """A ``locate``: ``Found`` without tags or fields, and ``held``: how many of the
    keys hold each field some of them hold."""

    held: dict[str, int]


class StepMeta(Found, kw_only=True):
    """A ``get_meta``: the rows of ``step`` for ``dp_rank`` and ``replica`` of ``task``
    (``Found``), ``end`` (a drained partition: no rows, ``step`` the end step),
    ``lost`` (every row of the share died with its unit: no rows), the task's
    ``lease_timeout`` (None: no lease taken), ``turn`` (the version the rows are
    within the sampler's staleness bound for; None: no bound) and the units' epoch
    (a service's reply)."""

    task: str
    step: int
    dp_rank: int
    replica: int
    end: bool = False
    lost: bool = False
    lease_timeout: float | None = None
    turn: int | None = None
    units_epoch: int | None = None


class Resume(msgspec.Struct, kw_only=True):
    """Where a reader of a rank resumes (``first_unfinished``): the first ``step`` not
    acked by every replica (or by the one asked about), and later steps already done
    (``skip``)."""

    step: int
    skip: list[int]


class TaskRows(msgspec.Struct, kw_only=True):
    """Rows a task will still be handed (``task_rows``, ``controller/counts.py``):
    ``exists`` (the partition does), ``closed`` (no new rows will come), ``remaining``
    rows not yet in a step nor discarded, steps ``formed`` (the end marker not counted)
    and ``ended`` (the end marker was formed)."""

    exists: bool
    closed: bool
    remaining: int
    formed: int
    ended: bool


class AdmissionStatus(msgspec.Struct, kw_only=True):
    """Rows of a partition ``admitted`` so far and the ``room`` left (None: unbounded),
    set by ``task`` (the staleness-bound task with the least room; "": none)."""

    admitted: int
    room: int | None = None
    task: str = ""


class GetMeta(msgspec.Struct, kw_only=True):
    partition: str
    task: str
    step: int | None = None
    dp_rank: int = 0
    timeout: float = 60.0
    replica: int | None = None
    session: str = ""
    consumer: str = ""


class Ack(msgspec.Struct, kw_only=True):
    partition: str
    task: str
    step: int
    dp_rank: int
    index: np.ndarray
    generation: np.ndarray
    replica: int = 0
    session: str = ""


class Renew(msgspec.Struct, kw_only=True):
    partition: str
    task: str
    step: int | None = None
    session: str = ""


class FirstUnfinished(msgspec.Struct, kw_only=True):
    partition: str
    task: str
    dp_rank: int = 0
    replica: int | None = None


class Cancel(msgspec.Struct, kw_only=True):
    session: str


class RegisterTask(msgspec.Struct, kw_only=True):
    partition: str
    task: str
    fields: Sequence[str]
    batch_size: int
    dp_size: int = 1
    replicas: int = 1
    lease_timeout: float = DEFAULT_LEASE_TIMEOUT
    drop_last: bool = False
    sampler: dict[str, Any] | None = None  # a sampler spec (``samplers/spec.py``)


class SetVersion(msgspec.Struct, kw_only=True):
    partition: str
    task: str
    version: int
    at_step: int | None = None


class Reading(msgspec.Struct, kw_only=True):
    partition: str
    task: str
    step: int


class Admit(msgspec.Struct, kw_only=True):
    partition: str
    n: int
    timeout: float = 60.0


class SetAdmission(msgspec.Struct, kw_only=True):
    partition: str
    task: str
    steps_per_version: int


class OfPartition(msgspec.Struct, kw_only=True):
    """A request naming only a partition."""

    partition: str


class OfTask(msgspec.Struct, kw_only=True):
    """A request naming a partition and a task."""

    partition: str
    task: str


class Clear(msgspec.Struct, kw_only=True):
    partition: str
    keys: Sequence[str] | None = None


class Lookup(msgspec.Struct, kw_only=True):
    partition: str
    keys: Sequence[str]
    fields: Sequence[str] | None = ()


class Keys(msgspec.Struct, kw_only=True):
    """A request naming a partition and keys."""

    partition: str
    keys: Sequence[str]


class ListRows(msgspec.Struct, kw_only=True):
    partition: str
    keys: Sequence[str] | None = None


class KeysOf(msgspec.Struct, kw_only=True):
    partition: str
    index: np.ndarray


class TagColumns(msgspec.Struct, kw_only=True):
    """Keys and tags of every row, oldest first, as columns: row ``keys[positions[j]]``
    has tag ``name`` = ``values[j]`` for ``tags[name] == [positions, values]``."""

    keys: list[str]
    tags: dict[str, list[Any]]


class SetTags(msgspec.Struct, kw_only=True):
    partition: str
    keys: Sequence[str]
    tags: list[dict[str, Any]]


class Nothing(msgspec.Struct, kw_only=True):
    """A request without arguments."""


# get_meta waits, and a sampler's discards free storage through the units; ack, clear,
# release free storage through the units; list_rows and register_task take work in
# proportion to the partition, or a sampler module's import: none of them run inline.
GET_META: Rpc[GetMeta, StepMeta | None] = Rpc("get_meta", GetMeta, StepMeta | None,
                                              waits="consume", answers=True)
ACK: Rpc[Ack, int] = Rpc("ack", Ack, int)
RELEASE: Rpc[Ack, None] = Rpc("release", Ack, None, inline=True)
RENEW: Rpc[Renew, int] = Rpc("renew", Renew, int, inline=True)
FIRST_UNFINISHED: Rpc[FirstUnfinished, Resume] = Rpc("first_unfinished", FirstUnfinished,
                                                     Resume, inline=True)
CANCEL: Rpc[Cancel, None] = Rpc("cancel", Cancel, None, inline=True)
REGISTER_TASK: Rpc[RegisterTask, None] = Rpc("register_task", RegisterTask, None)
SET_VERSION: Rpc[SetVersion, None] = Rpc("set_version", SetVersion, None, inline=True)
READING: Rpc[Reading, None] = Rpc("reading", Reading, None, inline=True)
ADMIT: Rpc[Admit, int] = Rpc("admit", Admit, int, inline=True, waits="produce")
SET_ADMISSION: Rpc[SetAdmission, None] = Rpc("set_admission", SetAdmission, None, inline=True)
ADMISSION: Rpc[OfPartition, AdmissionStatus] = Rpc("admission", OfPartition,
                                                   AdmissionStatus, inline=True)
TASK_ROWS: Rpc[OfTask, TaskRows] = Rpc("task_rows", OfTask, TaskRows, inline=True)
CLEAR: Rpc[Clear, int] = Rpc("clear", Clear, int)
LOOKUP: Rpc[Lookup, Found] = Rpc("lookup", Lookup, Found, inline=True)
LOCATE: Rpc[Keys, Located] = Rpc("locate", Keys, Located, inline=True)
LIST_ROWS: Rpc[ListRows, list[Plain]] = Rpc("list_rows", ListRows, list[Plain])
LIST_TAGS: Rpc[OfPartition, TagColumns] = Rpc("list_tags", OfPartition, TagColumns)
KEYS_OF: Rpc[KeysOf, list[str]] = Rpc("keys_of", KeysOf, list[str], inline=True)
SET_TAGS: Rpc[SetTags, None] = Rpc("set_tags", SetTags, None, inline=True)
STATS: Rpc[Nothing, Plain] = Rpc("stats", Nothing, Plain, inline=True)
DEAD_UNITS: Rpc[Nothing, list[int]] = Rpc("dead_units", Nothing, list[int], inline=True)

RPCS = (GET_META, ACK, RELEASE, RENEW, FIRST_UNFINISHED, CANCEL, REGISTER_TASK, SET_VERSION,
        READING, ADMIT, SET_ADMISSION, ADMISSION, TASK_ROWS, CLEAR, LOOKUP, LOCATE, LIST_ROWS,
        LIST_TAGS, KEYS_OF, SET_TAGS, STATS, DEAD_UNITS)
