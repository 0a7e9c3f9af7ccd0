"""Checkpoints you can trust: checksums, clear errors on damaged files, nothing half
loaded, private files, one file per storage unit, consistent saves under load."""

from __future__ import annotations

import os
import random
import stat

import pytest
import torch

import tq_stream as tq
from tests.conftest import assert_same_snapshot, keys_of, nested, snapshot
from tests.helpers.checkpoint_cases import save_under_load
from tq_stream.deploy import snapshot as ckpt
from tq_stream.deploy.embedded import EmbeddedBackend
from tq_stream.errors import CheckpointError, TQError

P = "train"


def fill(stream: tq.Stream, n: int = 24) -> None:
    keys = keys_of("k", n)
    stream.writer(P).put(keys, {
        "x": torch.arange(n * 4, dtype=torch.float32).reshape(n, 4),
        "r": nested([torch.arange(i % 5 + 1) for i in range(n)]),
        "s": [f"row{i}" for i in range(n)],
    }, tags=[{"v": i} for i in range(n)])
    client = stream.client()
    client.register_task(P, "actor", ["x"], batch_size=4)
    client.ack(client.get_meta(P, "actor", 0, timeout=1.0))


@pytest.fixture
def saved(tmp_path):
    """A checkpoint of 3 units at ``tmp_path/ckpt`` and the snapshot it holds."""
    path = str(tmp_path / "ckpt")
    with tq.init(storage_units=3) as stream:
        fill(stream)
        before = snapshot(stream, P)
        stream.save(path)
    return path, before


def files_of(path: str) -> list[str]:
    return sorted(os.path.join(path, f) for f in os.listdir(path))


def test_round_trip_with_one_file_per_unit(saved):
    path, before = saved
    names = sorted(os.listdir(path))
    assert names[0] == "controller.tq"
    units = names[1:]
    assert len(units) == 3 and all(n.startswith("unit-") and n.endswith(".tq") for n in units)
    with tq.init(storage_units=3, restore=path) as stream:
        assert_same_snapshot(before, snapshot(stream, P))


def test_checkpoint_files_are_private(saved):
    path, _ = saved
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    for f in files_of(path):
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600, f


def test_a_second_save_to_the_same_path_replaces_the_first(saved):
    path, _ = saved
    with tq.init(storage_units=3) as stream:
        stream.writer(P).put(["only"], {"x": torch.ones(1, 4)})
        stream.save(path)
    assert len(os.listdir(path)) == 4  # the first save's unit files are gone
    with tq.init(storage_units=3, restore=path) as stream:
        assert [r["key"] for r in stream.kv.list(partition=P)] == ["only"]


def test_a_flipped_data_byte_is_an_error_naming_the_file(saved):
    path, _ = saved
    unit_file = files_of(path)[1]
    data = bytearray(open(unit_file, "rb").read())
    data[-3] ^= 0x10  # inside the last frame: row bytes
    open(unit_file, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=os.path.basename(unit_file)) as info:
        tq.init(storage_units=3, restore=path)
    assert "checksum" in str(info.value)


def test_a_missing_unit_file_is_an_error(saved):
    path, _ = saved
    os.unlink(files_of(path)[2])
    with pytest.raises(CheckpointError, match="unit-"):
        tq.init(storage_units=3, restore=path)


@pytest.mark.parametrize("restore", ["missing", "file"])
def test_restore_of_something_else_is_an_error(tmp_path, restore):
    path = tmp_path / "x"
    if restore == "file":
        path.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="restore must name a checkpoint folder"):
        tq.init(restore=str(path))


def damaged(data: bytes, rng: random.Random) -> bytes:
    """``data`` truncated, or with 1-3 bits flipped, or with a byte range zeroed."""
    kind = rng.choice(["truncate", "flip", "zero"])
    if kind == "truncate":
        return data[: rng.randrange(len(data))]
    out = bytearray(data)
    if kind == "flip":
        for _ in range(rng.randint(1, 3)):
            out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
    else:
        start = rng.randrange(len(out))
        n = min(rng.randint(1, 64), len(out) - start)
        out[start: start + n] = bytes(n)
    return bytes(out)


def test_damaged_files_restore_exactly_or_raise_and_load_nothing(saved):
    """A seeded loop over truncations, bit flips and zeroed ranges of every file."""
    path, before = saved
    files = files_of(path)
    originals = {f: open(f, "rb").read() for f in files}
    rng = random.Random(11)
    outcomes = {"error": 0, "same": 0}
    for _ in range(150):
        victim = rng.choice(files)
        with open(victim, "wb") as f:
            f.write(damaged(originals[victim], rng))
        target = EmbeddedBackend(3)
        try:
            ckpt.restore(path, target.controller(), target.units())
        except TQError as exc:
            assert os.path.basename(victim) in str(exc) or "controller.tq" in str(exc), exc
            assert target.controller().partitions() == []
            assert all(u.nbytes() == 0 for u in target.units())
            outcomes["error"] += 1
        else:
            stream = tq.Stream(target, tq.StreamConfig(), "embedded")
            assert_same_snapshot(before, snapshot(stream, P))
            outcomes["same"] += 1
        finally:
            target.close()
            with open(victim, "wb") as f:
                f.write(originals[victim])
    assert outcomes["error"] > 100


def test_save_under_load_restores_the_bytes_written_for_each_key(tmp_path):
    with tq.init(storage_units=2) as stream:
        checked = save_under_load(stream, str(tmp_path),
                                  lambda p: tq.init(storage_units=2, restore=p))
    assert checked > 0


def test_controller_state_is_detached_from_later_calls():
    """A save encodes the state after the controller's lock is released: later leases
    and acks must not change it (its arrays were once the live task arrays)."""
    with tq.init() as stream:
        fill(stream)
        ctrl = stream.connection.controller()
        state = ctrl.state_dict()
        acks = state["tasks"][P]["actor"]["acks"].copy()
        task_state = state["tasks"][P]["actor"]["state"].copy()
        client = stream.client()
        client.get_meta(P, "actor", 1, timeout=1.0)  # leases rows: their state changes
        assert (state["tasks"][P]["actor"]["acks"] == acks).all()
        assert (state["tasks"][P]["actor"]["state"] == task_state).all()


def test_a_crafted_huge_frame_length_is_refused_before_allocation(saved):
    """A table whose checksum was recomputed after setting a 2**60 byte length."""
    import struct
    import zlib

    path, _ = saved
    meta = os.path.join(path, "controller.tq")
    raw = bytearray(open(meta, "rb").read())
    count = struct.unpack_from("<Q", raw, 8)[0]
    struct.pack_into("<Q", raw, 16 + 8, 2**60)  # frame 0's length
    end = 16 + 24 * count
    struct.pack_into("<I", raw, end, zlib.crc32(raw[:end]))
    open(meta, "wb").write(bytes(raw))
    with pytest.raises(CheckpointError, match="frame 0 spans"):
        tq.init(storage_units=3, restore=path)


def test_a_unit_reads_and_writes_only_files_named_for_the_save():
    from tq_stream.backends.memory import MemoryUnit
    from tq_stream.deploy.services import UnitService

    service = UnitService(MemoryUnit())
    with pytest.raises(tq.errors.ConfigError, match="unit-<unit>-<save>.tq"):
        service.load_rows("/etc/passwd", "ab12", 0)
    with pytest.raises(tq.errors.ConfigError, match="unit-<unit>-<save>.tq"):
        service.save_rows({"file": "/tmp/x/.bashrc", "save": "ab12", "unit": 0,
                           "partitions": {}})


def test_rows_a_unit_loaded_must_be_placed_there_by_the_metadata():
    with tq.init(storage_units=2) as stream:
        fill(stream)
        state = stream.connection.controller().state_dict()
    spec = ckpt._unit_rows(state, 0)[P]
    ckpt._check_unit_rows(state, 0, {P: [spec["slots"], spec["tokens"]]}, "u0")  # all known
    wrong = spec["tokens"].copy()
    wrong[0] += 1 << 32  # the same row index at another generation
    with pytest.raises(CheckpointError, match="'u0' holds 1 rows of partition 'train'"):
        ckpt._check_unit_rows(state, 0, {P: [spec["slots"], wrong]}, "u0")
    with pytest.raises(CheckpointError, match="holds 2 rows"):
        ckpt._check_unit_rows(state, 1, {P: [spec["slots"][:2], spec["tokens"][:2]]}, "u1")
