"""Checkpoints of a whole deployment: a folder of checksummed files, one per unit.

Layout of ``stream.save(path)``::

    path/                       mode 0700
        controller.tq           the controller's metadata, the save's id, the unit files
        unit-<i>-<save>.tq      the rows of storage unit i, written by that unit

Every file is a ``framefile`` dump (per-frame CRC-32, atomic, mode 0600; no pickle).

Consistency: the controller's state is taken first; each unit then copies the
rows it names *by occupancy token* under its lock and skips a slot whose token
changed (its row was freed after the state was taken and the slot perhaps reused).
Skipped rows are listed as ``gone`` and dropped on restore with the puts in flight
at the save and the rows naming a dropped shared entry (``checkpoint.for_new_deployment``),
so the restored deployment is the controller's committed state minus rows freed during
the save, and every restored row holds the bytes written for its key and its entry's.
Placement and frees never pause.

Where files go: each unit writes into ``path`` on its own host (units of a
multi-node Ray cluster write on their node). A restore reads each unit's file on
that unit's host, so on several nodes ``path`` must be on storage all nodes see.

``controller.tq`` is written last and replaced atomically: it names the unit files
of its save, so a save that failed half way leaves the previous checkpoint usable.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np

from tq_stream import framefile
from tq_stream.backends.base import StorageUnit, occupancy
from tq_stream.backends.unit_files import invalid_as_checkpoint_error
from tq_stream.controller.checkpoint import for_new_deployment
from tq_stream.errors import CheckpointError, ConfigError, StateError

FORMAT = 2
CONTROLLER_FILE = "controller.tq"
META_KEYS = {"format", "save", "units", "controller", "gone"}


class Checkpointed(Protocol):
    """What a checkpoint needs of the controller (its client, in every mode)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def partitions(self) -> list[str]: ...

    def clear(self, partition: str, keys: Sequence[str] | None = None) -> int: ...


def save(path: str, controller: Checkpointed, units: Sequence[StorageUnit]) -> None:
    """Checkpoint ``controller``'s metadata and every unit's rows into folder ``path``.

    Raises:
        ConfigError: ``path`` exists and is not a folder.
        OSError: a file could not be written (the previous checkpoint stays usable).
    """
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"path of a checkpoint must be a folder, got the file {path!r}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    state = controller.state_dict()
    save_id = secrets.token_hex(8)
    names = [f"unit-{u}-{save_id}.tq" for u in range(len(units))]
    requests = [{"file": os.path.join(path, names[u]), "save": save_id, "unit": u,
                 "partitions": _unit_rows(state, u)} for u in range(len(units))]
    results = _each(units, lambda u, unit: unit.save_rows(requests[u]))
    gone = {name: _gone_keys(name, part, results)
            for name, part in state["partitions"].items()}
    framefile.dump({"format": FORMAT, "save": save_id, "units": names, "controller": state,
                    "gone": {n: k for n, k in gone.items() if k}},
                   os.path.join(path, CONTROLLER_FILE))
    for old in os.listdir(path):  # unit files of earlier saves (on this host)
        if old.startswith("unit-") and old.endswith(".tq") and old not in names:
            os.unlink(os.path.join(path, old))


def _each(units: Sequence[StorageUnit],
          call: Callable[[int, StorageUnit], dict[str, Any]]) -> list[dict[str, Any]]:
    """``call(i, unit)`` for every unit at once (units write their files in parallel)."""
    with ThreadPoolExecutor(max_workers=min(len(units), 16)) as pool:
        futures = [pool.submit(call, u, unit) for u, unit in enumerate(units)]
        return [f.result() for f in futures]


def _unit_rows(state: dict[str, Any], u: int) -> dict[str, Any]:
    """The rows of unit ``u`` named by the controller's ``state``: slots, tokens and
    which fields are written."""
    out = {}
    for name, part in state["partitions"].items():
        sel = np.asarray(part["unit"]) == u
        rows = np.asarray(part["rows"], dtype=np.int64)
        gen = np.asarray(part["generation"], dtype=np.int64)[rows]
        out[name] = {"slots": np.asarray(part["slot"], dtype=np.int64)[sel],
                     "tokens": occupancy(rows, gen)[sel],
                     "fields": {f: np.asarray(r, dtype=bool)[sel]
                                for f, r in part["ready"].items()}}
    return out


def _gone_keys(name: str, part: dict[str, Any], results: list[dict[str, Any]]) -> list[str]:
    """Keys of the rows of partition ``name`` that their unit skipped (freed meanwhile)."""
    unit, slot = np.asarray(part["unit"]), np.asarray(part["slot"], dtype=np.int64)
    gone = np.zeros(len(unit), dtype=bool)
    for u, result in enumerate(results):
        missing = np.asarray(result["missing"].get(name, []), dtype=np.int64)
        gone |= (unit == u) & np.isin(slot, missing)
    return [k for k, g in zip(part["keys"], gone.tolist(), strict=True) if g]


def restore(path: str, controller: Checkpointed, units: Sequence[StorageUnit]) -> None:
    """Load the checkpoint folder ``path`` into an empty deployment, all or nothing.

    Every file is checked (checksums, bounds, the save it belongs to) before its
    contents are used; on any error the units drop what they loaded and the
    controller stays empty.

    Raises:
        CheckpointError: ``path`` is not a checkpoint folder, or one of its files is
            missing, damaged or from another save (the message names the file).
        ConfigError: the deployment has another number of storage units.
        StateError: the deployment is not empty.
    """
    path = os.path.abspath(os.fspath(path))
    meta_path = os.path.join(path, CONTROLLER_FILE)
    if not os.path.isdir(path):
        what = "a file" if os.path.exists(path) else "missing"
        raise CheckpointError(f"restore must name a checkpoint folder written by "
                              f"stream.save, got {path!r} ({what})")
    meta = _load_meta(meta_path, len(units))
    if controller.partitions():
        raise StateError(f"restore needs an empty deployment, got partitions "
                         f"{controller.partitions()}")
    state = meta["controller"]
    try:
        loaded = _each(units, lambda u, unit: unit.load_rows(
            os.path.join(path, meta["units"][u]), meta["save"], u))
        for u, rows in enumerate(loaded):
            _check_unit_rows(state, u, rows, os.path.join(path, meta["units"][u]))
        # a new deployment's sessions; without the rows freed during the save, the puts
        # in flight at it and the rows naming an entry dropped (checkpoint.py)
        controller.load_state_dict(for_new_deployment(state, meta["gone"]))
    except BaseException:
        _drop_all(units, state["partitions"])
        raise


def _load_meta(meta_path: str, n_units: int) -> dict[str, Any]:
    """The checked contents of ``controller.tq``."""
    from tq_stream.controller.checkpoint import load_controller, load_pins

    try:
        meta = framefile.load(meta_path)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {meta_path!r} must exist, but it is "
                              f"missing") from None
    if isinstance(meta, dict) and "units" in meta and isinstance(meta["units"], list) \
            and len(meta["units"]) != n_units:
        raise ConfigError(f"storage_units must be {len(meta['units'])} to restore this "
                          f"checkpoint, got {n_units}")
    with invalid_as_checkpoint_error(meta_path):
        if not isinstance(meta, dict) or set(meta) != META_KEYS:
            raise CheckpointError(f"must hold {sorted(META_KEYS)}, got "
                                  f"{sorted(meta) if isinstance(meta, dict) else meta!r}")
        if meta["format"] != FORMAT:
            raise CheckpointError(f"format must be {FORMAT}, got {meta['format']!r}")
        if any(n != f"unit-{u}-{meta['save']}.tq" for u, n in enumerate(meta["units"])):
            raise CheckpointError(f"unit files must be named unit-<i>-{meta['save']}.tq, got "
                                  f"{meta['units']}")
        parts, _ = load_controller(meta["controller"], n_units)  # checks, loads nothing
        load_pins(meta["controller"], parts)
        if not all(n in meta["controller"]["partitions"] and isinstance(k, list)
                   for n, k in meta["gone"].items()):
            raise CheckpointError("gone rows must be key lists of checkpointed partitions")
    return meta


def _drop_all(units: Sequence[StorageUnit], partitions: Iterable[str]) -> None:
    """Undo a failed restore on every unit (best effort: the first error is the one
    worth reporting, and ``tq.init`` stops these units anyway)."""
    for unit in units:
        for name in partitions:
            try:
                unit.drop(name)
            except Exception:  # noqa: BLE001, S112 - a dead unit holds nothing either
                continue


def _check_unit_rows(state: dict[str, Any], u: int, rows: dict[str, Any], file: str) -> None:
    """Every ``(slot, token)`` a unit loaded is one the metadata places on that unit."""
    expected = _unit_rows(state, u)
    for name, (slots, tokens) in rows.items():
        spec = expected.get(name)
        slots, tokens = np.asarray(slots, np.int64), np.asarray(tokens, np.int64)
        known = np.zeros(len(slots), dtype=bool)
        if spec is not None and len(spec["tokens"]):
            order = np.argsort(spec["tokens"])  # tokens are unique within a partition
            pos = np.searchsorted(spec["tokens"], tokens, sorter=order).clip(
                0, len(order) - 1)
            known = (spec["tokens"][order][pos] == tokens) & \
                (spec["slots"][order][pos] == slots)
        if not known.all():
            raise CheckpointError(f"{file!r} holds {int((~known).sum())} rows of partition "
                                  f"{name!r} that the controller's metadata does not place "
                                  f"on unit {u}")
