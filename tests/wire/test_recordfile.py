"""recordfile: records written and read one at a time; any damage is a CheckpointError."""

from __future__ import annotations

import pytest
import torch

from tq_stream import recordfile
from tq_stream.errors import CheckpointError


def _write(path, n=3):
    return recordfile.write(str(path), ({"i": i, "x": torch.full((5,), float(i))}
                                        for i in range(n)))


def test_records_come_back_in_order(tmp_path):
    assert _write(tmp_path / "f") == 3
    got = list(recordfile.read(str(tmp_path / "f")))
    assert [r["i"] for r in got] == [0, 1, 2]
    assert torch.equal(got[2]["x"], torch.full((5,), 2.0))
    assert got[1]["x"].data_ptr() % 64 == 0  # frames stay aligned in their buffer


@pytest.mark.parametrize("cut", [8, 100, -24, -1])
def test_a_file_cut_anywhere_is_an_error(tmp_path, cut):
    path = tmp_path / "f"
    _write(path)
    data = path.read_bytes()
    path.write_bytes(data[:cut])
    with pytest.raises(CheckpointError, match="truncated|corrupted"):
        list(recordfile.read(str(path)))


def test_a_file_cut_between_two_records_lacks_its_end(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    _write(one, 1)
    _write(two, 2)
    end = 8 + 16 + 8  # the end: marker, count, checksum
    path = tmp_path / "f"
    path.write_bytes(two.read_bytes()[: len(one.read_bytes()) - end])  # one record, no end
    with pytest.raises(CheckpointError, match="truncated"):
        list(recordfile.read(str(path)))


def test_every_flipped_byte_is_an_error(tmp_path):
    path = tmp_path / "f"
    _write(path, 2)
    data = path.read_bytes()
    for at in range(8, len(data), 7):
        bad = bytearray(data)
        bad[at] ^= 0x01
        path.write_bytes(bytes(bad))
        with pytest.raises(CheckpointError):
            list(recordfile.read(str(path)))
