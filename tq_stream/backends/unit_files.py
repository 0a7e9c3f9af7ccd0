"""A storage unit's own checkpoint file: the rows the controller's metadata names.

``stream.save`` asks every unit to write its rows itself (``StorageUnit.save_rows``),
so no row travels through the owner. The request names, per partition, the slots
of the checkpointed rows, their occupancy tokens and which fields are written. A
slot whose token differs (its row was freed after the controller's state was taken,
and the slot perhaps reused) is skipped and reported back: the checkpoint then
drops that row, never stores another row's bytes under its key.

File contents (``recordfile``, checksummed records, written and read one at a time so
neither a save nor a restore holds more than one chunk of rows: ``CHUNK_BYTES``)::

    {"format", "save", "unit"}
    {"partition", "slots", "tokens", "fields": {field: {"slots", "column"}}}   per chunk

A file of format 1 (one ``framefile`` dump of every row) is still read.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

from tq_stream import framefile, recordfile
from tq_stream.backends.slots import check_slots
from tq_stream.backends.spill import check_budget, check_cold
from tq_stream.columns import Column, column_len, take
from tq_stream.errors import CheckpointError, ConfigError

FORMAT = 2
DUMP_FORMAT = 1  # a whole unit in one framefile dump (written before chunks)
CHUNK_BYTES = 64 << 20  # column bytes a save copies (or a restore reads) at a time

# A request: {"file", "save", "unit", "partitions": {name: {"slots", "tokens",
# "fields": {field: bool mask over slots}}}}.
Request = Mapping[str, Any]
# What ``collect`` yields: (partition, slots kept, tokens kept, {field: (slots, column)}).
Chunk = tuple[str, np.ndarray, np.ndarray, dict[str, tuple[np.ndarray, Column, np.ndarray]]]


class PutsRows(Protocol):
    """What a restore stores rows through (a ``StorageUnit``)."""

    def put(self, partition: str, slots: np.ndarray, columns: Mapping[str, Column],
            generations: np.ndarray | None = None) -> None: ...

    def drop(self, partition: str) -> None: ...

    def put_spilled(self, partition: str, slots: np.ndarray, columns: Mapping[str, Column],
                    generations: np.ndarray | None = None) -> None: ...

    def set_memory(self, partition: str, memory_budget: int | None = None,
                   cold: Sequence[str] = ()) -> None: ...


def check_file(file: object, save: object, unit: object) -> None:
    """Raise ConfigError unless ``file`` is an absolute path named ``unit-<unit>-<save>.tq``
    (a unit reads and writes no other file on a client's word)."""
    if not (isinstance(save, str) and save.isalnum() and isinstance(unit, int)
            and isinstance(file, str) and os.path.isabs(file)
            and os.path.basename(file) == f"unit-{unit}-{save}.tq"):
        raise ConfigError(f"file must be an absolute path ending in unit-<unit>-<save>.tq, "
                          f"got file {file!r}, unit {unit!r}, save {save!r}")


def check_request(request: object) -> Request:
    """A received request, checked: the file is named ``unit-<unit>-<save>.tq`` (so a
    request never overwrites other files) and every array fits its partition."""
    if not isinstance(request, dict) or set(request) != {"file", "save", "unit",
                                                          "partitions"}:
        raise ConfigError(f"request must hold file, save, unit and partitions, got "
                          f"{sorted(request) if isinstance(request, dict) else request!r}")
    check_file(request["file"], request["save"], request["unit"])
    for name, spec in request["partitions"].items():
        slots = check_slots(spec["slots"], f"slots of partition {name!r}")
        tokens = np.asarray(spec["tokens"])
        masks = [np.asarray(m) for m in spec["fields"].values()]
        if tokens.shape != slots.shape or any(m.shape != slots.shape or m.dtype != bool
                                              for m in masks):
            raise ConfigError(f"tokens and field masks of partition {name!r} must have one "
                              f"entry per slot ({len(slots)})")
    return request


def write(request: Request, chunks: Iterable[Chunk],
          memory: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """Write the rows ``chunks`` yields (each written before the next is copied) to
    ``request["file"]``, after the unit's ``memory`` settings
    (``StorageUnit.memory_settings``); returns the skipped slots and how many rows were
    written."""
    os.makedirs(os.path.dirname(request["file"]), mode=0o700, exist_ok=True)
    kept: dict[str, list[np.ndarray]] = {name: [] for name in request["partitions"]}

    def records() -> Iterator[dict[str, Any]]:
        yield {"format": FORMAT, "save": request["save"], "unit": request["unit"],
               "memory": {p: m for p, m in (memory or {}).items()
                          if p in request["partitions"]}}
        for name, slots, tokens, fields in chunks:
            kept[name].append(slots)
            yield {"partition": name, "slots": slots, "tokens": tokens,
                   "fields": {f: {"slots": s, "column": c, "disk": d}
                              for f, (s, c, d) in fields.items()}}

    recordfile.write(request["file"], records())
    missing = {name: np.setdiff1d(np.asarray(spec["slots"], dtype=np.int64),
                                  np.concatenate(kept[name]) if kept[name] else [])
               for name, spec in request["partitions"].items()}
    return {"missing": missing, "rows": int(sum(len(s) for k in kept.values() for s in k))}


def chunk_rows(slot_bytes: np.ndarray, chunk_bytes: int) -> list[slice]:
    """Consecutive ranges of rows whose bytes (``slot_bytes``, one per row) stay within
    ``chunk_bytes`` (a row larger than that is a range of its own)."""
    out, start, total = [], 0, 0
    for i, b in enumerate(slot_bytes.tolist()):
        if i > start and total + b > chunk_bytes:
            out.append(slice(start, i))
            start, total = i, 0
        total += b
    if start < len(slot_bytes):
        out.append(slice(start, len(slot_bytes)))
    return out


def load(unit: PutsRows, path: str, save: str, unit_index: int) -> dict[str, Any]:
    """Check and store the rows of unit file ``path``, one chunk in memory at a time;
    returns ``{partition: [slots, tokens]}``. On any error the partitions put so far are
    dropped: nothing is left half loaded.

    Raises:
        CheckpointError: the file is missing, damaged, of another save or unit, or
            names slots or columns that do not fit together.
    """
    try:
        if not recordfile.is_record_file(path):  # a checkpoint of format 1: one dump
            return put_all(unit, read(path, save, unit_index))
        records = recordfile.read(path)
        with invalid_as_checkpoint_error(path):
            head = _check_head(next(records, None), save, unit_index)
    except FileNotFoundError:
        raise _missing(path) from None
    except OSError as exc:
        raise CheckpointError(f"checkpoint file {path!r} cannot be read: {exc}") from None
    loaded: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {}
    try:
        for name, settings in head["memory"].items():  # before any row: cold fields
            loaded[name] = ([], [])  # go straight to disk
            unit.set_memory(name, settings["budget"], settings["cold"])
        while (record := next(records, None)) is not None:
            with invalid_as_checkpoint_error(path):
                name = _check_chunk(record)
                slots, tokens = _put_chunk(unit, record)
            del record  # before the next is read: one chunk in memory at a time
            have = loaded.setdefault(name, ([], []))
            have[0].append(slots)
            have[1].append(tokens)
        none = np.zeros(0, dtype=np.int64)
        out = {name: [np.concatenate([none, *s]), np.concatenate([none, *t])]
               for name, (s, t) in loaded.items()}
        for name, (slots, _) in out.items():
            if len(np.unique(slots)) != len(slots):
                raise CheckpointError(f"{path!r} is not a valid checkpoint file: slots of "
                                      f"partition {name!r} must be unique")
    except BaseException:
        for name in loaded:
            unit.drop(name)
        raise
    return out


def _missing(path: str) -> CheckpointError:
    return CheckpointError(f"checkpoint file {path!r} must exist, but it is missing "
                           f"(on a multi-node cluster the checkpoint folder must be on "
                           f"storage every node sees)")


def _check_head(head: object, save: str, unit: int) -> dict[str, Any]:
    if not isinstance(head, dict) or set(head) != {"format", "save", "unit", "memory"}:
        raise CheckpointError(f"a unit file must start with format, save, unit and memory, "
                              f"got "
                              f"{sorted(head) if isinstance(head, dict) else head!r}")
    if head["format"] != FORMAT or head["save"] != save or head["unit"] != unit:
        raise CheckpointError(
            f"the file must be format {FORMAT} of save {save} for unit {unit}, got format "
            f"{head['format']!r} of save {head['save']!r} for unit {head['unit']!r} (a "
            f"file of another save or unit)")
    memory = head["memory"]
    if not isinstance(memory, dict) or not all(
            isinstance(m, dict) and set(m) == {"budget", "cold"} for m in memory.values()):
        raise CheckpointError(f"memory settings must map partitions to budget and cold, "
                              f"got {memory!r}")
    for settings in memory.values():
        check_budget(settings["budget"])
        check_cold(settings["cold"])
    return head


def _check_chunk(record: object) -> str:
    """The partition of a chunk record, once its slots, tokens and columns fit."""
    if not isinstance(record, dict) or set(record) != {"partition", "slots", "tokens",
                                                        "fields"}:
        raise CheckpointError(f"a chunk must hold partition, slots, tokens and fields, got "
                              f"{sorted(record) if isinstance(record, dict) else record!r}")
    name = record["partition"]
    if not isinstance(name, str):
        raise CheckpointError(f"a chunk's partition must be a name, got {name!r}")
    _check_part(name, record)
    return name


def _put_chunk(unit: PutsRows, record: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    name = record["partition"]
    # Copies: a view would keep the record's whole buffer alive with the returned slots.
    slots = np.array(record["slots"], dtype=np.int64)
    tokens = np.array(record["tokens"], dtype=np.int64)
    order = np.argsort(slots)
    for field, entry in record["fields"].items():
        fslots = np.asarray(entry["slots"], dtype=np.int64)
        ftokens = tokens[order[np.searchsorted(slots, fslots, sorter=order)]]
        disk = np.asarray(entry.get("disk", np.zeros(len(fslots), dtype=bool)), dtype=bool)
        for put, rows in ((unit.put, ~disk), (unit.put_spilled, disk)):
            if rows.all():
                put(name, fslots, {field: entry["column"]}, ftokens)
            elif rows.any():
                at = torch.from_numpy(np.flatnonzero(rows))
                put(name, fslots[rows], {field: take(entry["column"], at)}, ftokens[rows])
    return slots, tokens


def read(path: str, save: str, unit: int) -> dict[str, Any]:
    """The checked contents of a unit file of format 1 (one dump).

    Raises:
        CheckpointError: the file is missing, damaged, of another save or unit, or
            names slots or columns that do not fit together.
    """
    try:
        data = framefile.load(path)
    except FileNotFoundError:
        raise _missing(path) from None
    except OSError as exc:
        raise CheckpointError(f"checkpoint file {path!r} cannot be read: {exc}") from None
    with invalid_as_checkpoint_error(path):
        _check(data, save, unit)
    checked: dict[str, Any] = data
    return checked


@contextmanager
def invalid_as_checkpoint_error(path: str) -> Iterator[None]:
    """Checks of a loaded file's contents: any failure becomes a CheckpointError naming
    the file (a value of the wrong type means the file is not a checkpoint of ours)."""
    try:
        yield
    except CheckpointError as exc:
        raise CheckpointError(f"{path!r} is not a valid checkpoint file: {exc}") from None
    except Exception as exc:
        raise CheckpointError(f"{path!r} is not a valid checkpoint file: "
                              f"{type(exc).__name__}: {exc}") from None


def _slots(value: npt.ArrayLike, what: str) -> np.ndarray:
    return check_slots(value, what, CheckpointError)


def _check(data: object, save: str, unit: int) -> None:
    bad = CheckpointError
    if not isinstance(data, dict) or set(data) != {"format", "save", "unit", "partitions"}:
        got = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise bad(f"a unit file must hold format, save, unit and partitions, got {got}")
    if data["format"] != DUMP_FORMAT or data["save"] != save or data["unit"] != unit:
        raise bad(f"the file must be format {DUMP_FORMAT} of save {save} for unit {unit}, got "
                  f"format {data['format']!r} of save {data['save']!r} for unit "
                  f"{data['unit']!r} (a file of another save or unit)")
    for name, part in data["partitions"].items():
        _check_part(name, part)


def _check_part(name: str, part: dict[str, Any]) -> None:
    """The slots, tokens and field columns of one partition's rows fit together."""
    bad = CheckpointError
    slots = _slots(part["slots"], f"slots of partition {name!r}")
    tokens = np.asarray(part["tokens"])
    if tokens.shape != slots.shape or (tokens.size and tokens.dtype.kind not in "iu"):
        raise bad(f"tokens of partition {name!r} must be ints, one per slot, got "
                  f"{tokens.dtype} of shape {tokens.shape}")
    if len(np.unique(slots)) != len(slots):
        raise bad(f"slots of partition {name!r} must be unique")
    for field, entry in part["fields"].items():
        fslots = _slots(entry["slots"], f"slots of field {field!r}")
        if not np.isin(fslots, slots).all():
            raise bad(f"slots of field {field!r} must be rows of partition {name!r}")
        n = column_len(entry["column"])
        if n != len(fslots):
            raise bad(f"field {field!r} of partition {name!r} must hold one value per "
                      f"slot ({len(fslots)}), got {n}")
        disk = np.asarray(entry.get("disk", np.zeros(n, dtype=bool)))
        if disk.shape != fslots.shape or disk.dtype != bool:
            raise bad(f"the on-disk mask of field {field!r} of partition {name!r} must be "
                      f"a bool per slot ({len(fslots)}), got {disk.dtype} {disk.shape}")


class _Loads(Protocol):
    """What ``put_all`` needs of a storage unit."""

    def put(self, partition: str, slots: np.ndarray, columns: Mapping[str, Column],
            generations: np.ndarray | None = None) -> None: ...

    def drop(self, partition: str) -> None: ...


def put_all(unit: _Loads, data: dict[str, Any]) -> dict[str, Any]:
    """Store the rows of a checked unit file; returns ``{partition: [slots, tokens]}``.

    A put that fails drops the partitions put so far: nothing is left half loaded.
    """
    done: list[str] = []
    try:
        for name, part in data["partitions"].items():
            done.append(name)
            slots = np.asarray(part["slots"], dtype=np.int64)
            tokens = np.asarray(part["tokens"], dtype=np.int64)
            token_of = dict(zip(slots.tolist(), tokens.tolist(), strict=True))
            for field, entry in part["fields"].items():
                fslots = np.asarray(entry["slots"], dtype=np.int64)
                ftokens = np.asarray([token_of[s] for s in fslots.tolist()], dtype=np.int64)
                unit.put(name, fslots, {field: entry["column"]}, ftokens)
    except BaseException:
        for name in done:
            unit.drop(name)
        raise
    return {name: [np.asarray(p["slots"], dtype=np.int64), np.asarray(p["tokens"],
                                                                      dtype=np.int64)]
            for name, p in data["partitions"].items()}
