"""The controller's metadata checkpoint file (deploy/meta_checkpoint.py) and the
reconciliation of a restored controller with what a unit holds, in process."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from tests.conftest import keys_of, put_rows
from tq_stream.deploy import meta_checkpoint
from tq_stream.errors import StateError


def test_a_checkpoint_round_trips_and_is_private(tmp_path):
    path = str(tmp_path / "c.tqmeta")
    state = {"a": [1, 2.5, "x", None], "b": np.arange(5), "c": {"d": True}}
    meta_checkpoint.write(path, state)
    back = meta_checkpoint.read(path)
    assert back["a"] == state["a"] and back["c"] == state["c"]
    assert np.array_equal(back["b"], state["b"])
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert os.listdir(tmp_path) == ["c.tqmeta"]  # no temporary file left


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage"])
def test_a_damaged_checkpoint_is_a_state_error_naming_the_file(tmp_path, damage):
    path = str(tmp_path / "c.tqmeta")
    meta_checkpoint.write(path, {"rows": np.arange(100)})
    raw = bytearray(open(path, "rb").read())
    if damage == "truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "flip":
        raw[-10] ^= 0xFF
    else:
        raw = bytearray(b"not a checkpoint at all")
    open(path, "wb").write(bytes(raw))
    with pytest.raises(StateError, match="c.tqmeta"):
        meta_checkpoint.read(path)


def test_reconcile_keeps_held_rows_drops_gone_ones_frees_orphans(stream):
    put_rows(stream, keys_of("k", 6))
    ctrl = stream.connection.controller()
    unit = stream.connection.units()[0]
    part = ctrl.book.parts["train"]
    held = unit.held()["train"]
    assert len(held["slots"]) == 6
    gone_slot = int(held["slots"][0])
    keep = held["slots"] != gone_slot
    orphan = int(held["slots"].max()) + 7
    held = {"slots": np.append(held["slots"][keep], orphan),
            "tokens": np.append(held["tokens"][keep], 12345)}
    gone, orphans = meta_checkpoint.reconcile(part, 0, held)
    assert part.slot[gone].tolist() == [gone_slot]
    assert orphans.tolist() == [orphan]


def test_held_lists_written_slots_with_their_tokens(stream):
    put_rows(stream, keys_of("k", 3))
    meta = stream.kv.meta(keys_of("k", 3), partition="train")
    held = stream.connection.units()[0].held()["train"]
    from tq_stream.backends.base import occupancy

    assert sorted(held["slots"].tolist()) == sorted(meta.slot.tolist())
    want = dict(zip(meta.slot.tolist(), occupancy(meta.index, meta.generation).tolist(),
                    strict=True))
    assert dict(zip(held["slots"].tolist(), held["tokens"].tolist(), strict=True)) == want
