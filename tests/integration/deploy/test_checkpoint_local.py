"""Checkpoints of a local deployment: one file per unit process, consistent under load."""

from __future__ import annotations

import os

import pytest
import torch

import tq_stream as tq
from tests.helpers.checkpoint_cases import save_under_load
from tests.helpers.shared_checkpoint_cases import save_while_groups_stream
from tests.helpers.tq_fixtures import CONFIG, start_local
from tq_stream.errors import CheckpointError

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def test_units_write_their_own_files_and_restore_reads_them(tmp_path):
    path = str(tmp_path / "ckpt")
    keys = [f"k{i}" for i in range(40)]
    x = torch.arange(40 * 3, dtype=torch.float32).reshape(40, 3)
    with start_local(storage_units=2) as stream:
        stream.writer("p").put(keys, {"x": x, "s": [f"v{i}" for i in range(40)]})
        stream.save(path)
    names = sorted(os.listdir(path))
    assert names[0] == "controller.tq" and len(names) == 3
    with tq.init(mode="local", storage_units=2, config=CONFIG, restore=path) as stream:
        got = stream.kv.get_batch(keys, ["x", "s"], partition="p")
        assert torch.equal(got["x"], x) and got["s"] == [f"v{i}" for i in range(40)]
    unit_file = os.path.join(path, names[1])
    data = bytearray(open(unit_file, "rb").read())
    data[-2] ^= 1
    open(unit_file, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=names[1]):
        tq.init(mode="local", storage_units=2, config=CONFIG, restore=path)


def test_save_under_load_restores_the_bytes_written_for_each_key(tmp_path):
    with start_local(storage_units=2) as stream:
        checked = save_under_load(stream, str(tmp_path), lambda p: tq.init(
            mode="local", storage_units=2, config=CONFIG, restore=p), saves=5)
    assert checked > 0


def test_saves_while_groups_stream_restore_consistent_states(tmp_path):
    # shared entries and the rows naming them, put while the owner saves: no entry
    # key as a row, no row without its entry's image, no uncommitted entry restored
    with start_local(storage_units=2) as stream:
        checked = save_while_groups_stream(stream, str(tmp_path), lambda p: tq.init(
            mode="local", storage_units=2, config=CONFIG, restore=p), saves=5)
    assert checked > 0
