"""A storage unit's own checkpoint file: the rows the controller's metadata names.

``stream.save`` asks every unit to write its rows itself (``StorageUnit.save_rows``),
so no row travels through the owner. The request names, per partition, the slots
of the checkpointed rows, their occupancy tokens and which fields are written. A
slot whose token differs (its row was freed after the controller's state was taken,
and the slot perhaps reused) is skipped and reported back: the checkpoint then
drops that row, never stores another row's bytes under its key.

File contents (``framefile``, checksummed)::

    {"format", "save", "unit",
     "partitions": {name: {"slots", "tokens", "fields": {field: {"slots", "column"}}}}}
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np

from tq_stream import framefile
from tq_stream.backends.slots import check_slots
from tq_stream.columns import Column, column_len
from tq_stream.errors import CheckpointError, ConfigError

FORMAT = 1

# A request: {"file", "save", "unit", "partitions": {name: {"slots", "tokens",
# "fields": {field: bool mask over slots}}}}.
Request = Mapping[str, Any]
# What ``collect`` returns per partition: (slots kept, tokens kept, {field: (slots, column)}).
Collected = tuple[np.ndarray, np.ndarray, dict[str, tuple[np.ndarray, Column]]]


def check_file(file: Any, save: Any, unit: Any) -> None:
    """Raise ConfigError unless ``file`` is an absolute path named ``unit-<unit>-<save>.tq``
    (a unit reads and writes no other file on a client's word)."""
    if not (isinstance(save, str) and save.isalnum() and isinstance(unit, int)
            and isinstance(file, str) and os.path.isabs(file)
            and os.path.basename(file) == f"unit-{unit}-{save}.tq"):
        raise ConfigError(f"file must be an absolute path ending in unit-<unit>-<save>.tq, "
                          f"got file {file!r}, unit {unit!r}, save {save!r}")


def check_request(request: Any) -> Request:
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


def write(request: Request, collected: dict[str, Collected]) -> dict[str, Any]:
    """Write ``collected`` rows to ``request["file"]``; returns the skipped slots."""
    os.makedirs(os.path.dirname(request["file"]), mode=0o700, exist_ok=True)
    parts, missing = {}, {}
    for name, spec in request["partitions"].items():
        slots, tokens, fields = collected[name]
        parts[name] = {"slots": slots, "tokens": tokens,
                       "fields": {f: {"slots": s, "column": c} for f, (s, c) in fields.items()}}
        missing[name] = np.setdiff1d(np.asarray(spec["slots"], dtype=np.int64), slots)
    framefile.dump({"format": FORMAT, "save": request["save"], "unit": request["unit"],
                    "partitions": parts}, request["file"])
    return {"missing": missing, "rows": int(sum(len(p["slots"]) for p in parts.values()))}


def read(path: str, save: str, unit: int) -> dict[str, Any]:
    """The checked contents of a unit file (see module docstring).

    Raises:
        CheckpointError: the file is missing, damaged, of another save or unit, or
            names slots or columns that do not fit together.
    """
    try:
        data = framefile.load(path)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path!r} must exist, but it is missing "
                              f"(on a multi-node cluster the checkpoint folder must be on "
                              f"storage every node sees)") from None
    except OSError as exc:
        raise CheckpointError(f"checkpoint file {path!r} cannot be read: {exc}") from None
    with invalid_as_checkpoint_error(path):
        _check(data, save, unit)
    return data


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


def _slots(value: Any, what: str) -> np.ndarray:
    return check_slots(value, what, CheckpointError)


def _check(data: Any, save: str, unit: int) -> None:
    bad = CheckpointError
    if not isinstance(data, dict) or set(data) != {"format", "save", "unit", "partitions"}:
        got = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise bad(f"a unit file must hold format, save, unit and partitions, got {got}")
    if data["format"] != FORMAT or data["save"] != save or data["unit"] != unit:
        raise bad(f"the file must be format {FORMAT} of save {save} for unit {unit}, got "
                  f"format {data['format']!r} of save {data['save']!r} for unit "
                  f"{data['unit']!r} (a file of another save or unit)")
    for name, part in data["partitions"].items():
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


def put_all(unit: Any, data: dict[str, Any]) -> dict[str, Any]:
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
