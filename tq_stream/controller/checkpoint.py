"""Controller metadata as plain data (dicts, lists, numpy arrays) and back.

A restored task exists at once (its rows keep their consumption state, so rows
it has not acked are never freed by other tasks' acks, new rows are offered to
it, and a second checkpoint keeps it), but it serves no step until its consumer
registers it again with the same settings; the sampler object comes from that
consumer and the checkpointed sampler state is loaded into it. Formed steps are
kept with their shares and acks, and so are claims: a restarted controller's live
consumers go on renewing theirs, so no share a live session holds goes to another.
A restore into a new deployment drops them first (``for_new_deployment``): their
sessions died with the old processes, so a resumed consumer asking for a step it
had not acked gets the same rows again at once. Media pins are kept under
``"media"`` (``media_pins.MediaPins.state_dict``; absent in earlier checkpoints):
a new deployment holds them itself (``media_pins.for_new_deployment``).

A restore into a new deployment also drops (``for_new_deployment``, ``"drop"``) the
rows the save found freed meanwhile (``gone``) and every put in flight at the save:
rows and shared entries no field was committed to (no producer of the new deployment
commits them), and the rows naming a dropped entry (``dropped``). So a restored row
holds its own and its entry's bytes, and no uncommitted entry or claim comes back.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from tq_stream.controller.media_pins import MediaPins
from tq_stream.controller.media_pins import for_new_deployment as pins_for_new_deployment
from tq_stream.controller.partition import PartitionMeta
from tq_stream.controller.reservations import hold_restored
from tq_stream.controller.task import Claim, StepRecord, TaskState
from tq_stream.controller.task_config import TaskConfig
from tq_stream.errors import ConfigError
from tq_stream.samplers.base import Sampler
from tq_stream.schemas import FieldSchema

if TYPE_CHECKING:
    from tq_stream.controller.book import Book

FORMAT = 2
STATE_KEYS = ("format", "partitions", "tasks")
OPTIONAL_KEYS = ("media", "drop")  # media: absent in earlier checkpoints; drop: a restore's


def _part_state(part: PartitionMeta) -> dict[str, Any]:
    rows = np.flatnonzero(part.used)
    # Spare rows belong to writers of this deployment only: a restored one gets them
    # back as free rows and slots (with a new generation, so old handles never match).
    spare = np.flatnonzero(part.spare)
    generation = part.generation.copy()
    generation[spare] += 1
    return {
        "capacity": part.capacity, "closed": part.closed, "admitted": part.admitted,
        "consumers": None if part.consumers is None else list(part.consumers),
        "spills": part.spills,
        "versions": {k: list(v) for k, v in part.versions.items()},
        "schemas": {f: s.to_dict() for f, s in part.schemas.items()},
        "size": part.size, "rows": rows, "keys": part.keys[rows].tolist(),
        "unit": part.unit[rows], "slot": part.slot[rows],
        "generation": generation, "write_time": part.write_time[rows],
        "created": part.created[rows], "next_created": part.next_created,
        "ready": part.shared.own_ready(part, rows),  # what each row's slot holds
        "tags": part.tags.state_dict(), "shared": part.shared.state_dict(),
        **part.free_state(spare),
    }


def _task_state(task: TaskState) -> dict[str, Any]:
    c = task.config
    if task.restored is not None:  # not registered again yet: keep the checkpointed sampler
        sampler, sampler_state = task.restored
    else:
        sampler, sampler_state = type(task.sampler).__name__, task.sampler.state_dict()
    return {
        "config": c.to_dict(),
        "sampler": sampler, "sampler_state": sampler_state,
        "state": task.state, "acks": task.acks,
        "available": task.queue.ordered(),
        "steps": [{"step": s, "end": r.end, "shares": list(r.shares),
                   "served": sorted(list(k) for k in r.served), "turns": r.turns,
                   "claims": [[r_, q, c.session, c.consumer, c.expiry]
                              for (r_, q), c in r.claims.items()]}
                  for s, r in task.steps.items()],
        "next_step": task.next_step, "ended": task.ended, "version": task.version,
        "version_step": task.version_step,
        "steps_per_version": task.steps_per_version, "cadence": task.cadence,
        "discards": dict(task.discards), "handed_out": task.handed_out, "acked": task.acked,
        "takeovers": task.takeovers.state_dict(),
        "counters": {"renewed": task.renewed, "expired": task.expired,
                     "cancelled": task.cancelled, "redelivered": task.redelivered},
    }


def controller_state(parts: dict[str, PartitionMeta],
                     tasks: dict[str, dict[str, TaskState]], pins: MediaPins) -> dict[str, Any]:
    """The metadata as plain data, sharing no array with the live controller (the
    state of one moment: acks after the lock is released never change it)."""
    state: dict[str, Any] = _detached({
        "format": FORMAT,
        "partitions": {n: _part_state(p) for n, p in parts.items()},
        "tasks": {n: {t: _task_state(s) for t, s in ts.items()} for n, ts in tasks.items()},
        "media": pins.state_dict(),
    })
    return state


def _detached(value: Any) -> Any:
    """``value`` with every numpy array, dict and list copied (strings and numbers are
    immutable and shared)."""
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_detached(v) for v in value)
    return value


def for_new_deployment(state: dict[str, Any],
                       gone: Mapping[str, list[str]] | None = None) -> dict[str, Any]:
    """``state`` (from ``controller_state``) for a new deployment, in place: every
    step's claims dropped and the media pins held by the deployment (their sessions
    belong to the old deployment); the rows of ``gone`` (keys per partition, freed
    during the save) and of the puts in flight are to drop (``"drop"``)."""
    state["drop"] = {name: list((gone or {}).get(name, [])) + _in_flight(part)
                     for name, part in state["partitions"].items()}
    for tasks in state["tasks"].values():
        for task in tasks.values():
            for step in task["steps"]:
                step["claims"] = []
    if isinstance(state.get("media"), dict):
        pins_for_new_deployment(state["media"])
    return state


def _in_flight(part: Mapping[str, Any]) -> list[str]:
    """Keys of the rows of a partition's state no field was committed to (of their
    own, or of an entry they name): rows and shared entries of puts in flight."""
    named = np.asarray(part["shared"]["named"] if "shared" in part else [], np.int64)
    written = np.isin(np.asarray(part["rows"], dtype=np.int64), named)
    for r in part["ready"].values():
        written |= np.asarray(r, dtype=bool)
    return [k for k, w in zip(part["keys"], written.tolist(), strict=True) if not w]


def dropped(parts: Mapping[str, PartitionMeta], state: Mapping[str, Any]) -> dict[
        str, np.ndarray]:
    """Per partition, the rows of ``state["drop"]`` (``for_new_deployment``) with the rows
    naming the entries among them (a row is restored only with its entry's bytes)."""
    drop = state.get("drop") or {}
    if not isinstance(drop, Mapping) or not all(
            name in parts and isinstance(keys, list) and all(isinstance(k, str) for k in keys)
            for name, keys in drop.items()):
        raise ConfigError(f"drop of a controller state must give key lists of its "
                          f"partitions {sorted(parts)}, got {drop!r:.120}")
    out = {}
    for name, keys in drop.items():
        rows = parts[name].lookup(keys)  # a row in flight may be gone too: once each
        rows = parts[name].shared.with_namers(np.unique(rows[rows >= 0]))
        if len(rows):
            out[name] = rows
    return out


def load_controller(state: Any, n_units: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Partitions and (restored, not yet registered) tasks from ``state``."""
    if not isinstance(state, dict) or not set(STATE_KEYS) <= set(state) <= \
            set(STATE_KEYS + OPTIONAL_KEYS):
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ConfigError(f"controller state must have keys {sorted(STATE_KEYS)} (and "
                          f"{list(OPTIONAL_KEYS)}), got {got}")
    if state["format"] != FORMAT:
        raise ConfigError(f"checkpoint format must be {FORMAT}, got {state['format']!r}")
    parts: dict[str, PartitionMeta] = {}
    for name, s in state["partitions"].items():
        if len(s["pools"]) != n_units:
            raise ConfigError(f"storage_units must be {len(s['pools'])} to restore this "
                              f"checkpoint, got {n_units}")
        part = PartitionMeta(name, s["capacity"], n_units)
        part.closed = s["closed"]
        part.admitted = int(s.get("admitted", 0))
        part.spills = s.get("spills") is True  # (absent before memory budgets)
        part.consumers = None if s["consumers"] is None else tuple(s["consumers"])
        part.versions = {str(k): (int(v), None if at is None else int(at))
                         for k, (v, at) in s["versions"].items()}
        part.grow_to(int(s["size"]))
        part.fix_schemas({f: FieldSchema.from_dict(d) for f, d in s["schemas"].items()})
        rows = np.asarray(s["rows"], dtype=np.int64)
        part.keys[rows] = s["keys"]
        part.used[rows] = True
        part.unit[rows] = s["unit"]
        part.slot[rows] = s["slot"]
        part.generation[:] = s["generation"]
        part.write_time[rows] = s["write_time"]
        part.created[rows] = s["created"]
        part.next_created = int(s["next_created"])
        for f, r in s["ready"].items():
            part.ready[f][rows] = r
        part.tags.load_state_dict(s["tags"])
        if "shared" in s:  # none in a checkpoint of an earlier version
            part.shared.load_state_dict(part, s["shared"])
        part.key_index = dict(zip(s["keys"], rows.tolist(), strict=True))
        part.live = len(rows)
        part.load_free_state(s)
        parts[name] = part
    tasks: dict[str, dict[str, TaskState]] = {name: {} for name in parts}
    for name, ts in state["tasks"].items():
        if name not in parts:
            raise ConfigError(f"tasks of partition {name!r} must come with that partition in "
                              f"the checkpoint, got partitions {sorted(parts)}")
        for task, s in ts.items():
            tasks[name][task] = _load_task(task, s, parts[name])
    return parts, tasks


def load_into(book: Book, state: Mapping[str, Any], n_units: int) -> list[
        tuple[str, list[tuple[int, np.ndarray]]]]:
    """``state`` into the empty ``book`` (lock held): its partitions, tasks and pins,
    without the rows to drop; rows reserved before the save are held
    (``hold_restored``). Returns the slots to free (``Book.free_slots``, lock not held)."""
    parts, tasks = load_controller(state, n_units)
    drop = dropped(parts, state)  # checked before anything is loaded
    book.replace(parts, tasks, load_pins(state, parts))
    freed = [(name, book.undo_rows(parts[name], rows)) for name, rows in drop.items()]
    hold_restored(book.reservations, parts, book.clock())
    return freed


def load_pins(state: Mapping[str, Any], parts: dict[str, PartitionMeta]) -> MediaPins:
    """The media pins of ``state`` over ``parts`` (of ``load_controller``; none in a
    checkpoint of an earlier version)."""
    pins = MediaPins()
    if state.get("media") is not None:
        pins.load_state_dict(state["media"], parts)
    return pins


def _load_task(name: str, s: dict[str, Any], part: PartitionMeta) -> TaskState:
    config = TaskConfig.from_dict(s["config"])
    task = TaskState(name, config, Sampler(), part.size)
    task.restored = (s["sampler"], copy.deepcopy(s["sampler_state"]))
    task.state[: len(s["state"])] = s["state"]
    task.acks[: len(s["acks"])] = s["acks"]
    task.queue.push(np.asarray(s["available"], dtype=np.int64))
    for st in s["steps"]:
        shares = [np.array(x, dtype=np.int64) for x in st["shares"]]
        task.steps[int(st["step"])] = StepRecord(
            shares, bool(st["end"]), served={(int(r), int(q)) for r, q in st["served"]},
            turns=_turns(st.get("turns")),  # None in a checkpoint of an earlier version
            claims={(int(r), int(q)): Claim(str(s_), str(c), float(e))
                    for r, q, s_, c, e in st["claims"]})
    task.next_step, task.ended, task.version = s["next_step"], s["ended"], s["version"]
    task.version_step = s["version_step"]
    spv, cadence = s.get("steps_per_version"), s.get("cadence")
    task.steps_per_version = None if spv is None else int(spv)
    task.cadence = None if cadence is None else int(cadence)
    task.discards = Counter(s["discards"])
    task.takeovers.load_state_dict(s.get("takeovers", {}))  # none in an earlier checkpoint
    task.handed_out, task.acked = s["handed_out"], s["acked"]
    c = s["counters"]
    task.renewed, task.expired, task.redelivered = c["renewed"], c["expired"], c["redelivered"]
    task.cancelled = int(c.get("cancelled", 0))  # a checkpoint of an earlier version: 0
    return task


def _turns(value: list[Any] | None) -> list[int | None] | None:
    return None if value is None else [None if t is None else int(t) for t in value]


def adopt(task: TaskState, config: TaskConfig, sampler: Sampler) -> None:
    """A consumer registers a restored ``task`` again: check it, load its sampler's state."""
    if config != task.config:
        raise ConfigError(f"task {task.name!r} must be registered with its checkpointed "
                          f"settings {task.config}, got {config}")
    assert task.restored is not None
    name, sampler_state = task.restored
    if name != type(sampler).__name__:
        raise ConfigError(f"sampler of task {task.name!r} must be {name} as checkpointed, "
                          f"got {type(sampler).__name__}")
    sampler.load_state_dict(sampler_state)
    task.sampler, task.restored = sampler, None
    task.tags = tuple(sampler.required_tags())
