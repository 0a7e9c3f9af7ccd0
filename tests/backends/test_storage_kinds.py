"""Storage kinds (``tq_stream.backends.kinds``): one table names every backend; a new one
is one class plus one line, and runs in embedded and local mode."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pytest
import torch

import tq_stream as tq
from tq_stream.backends.base import StorageUnit
from tq_stream.backends.kinds import KINDS, make_unit, storage_or_shm
from tq_stream.backends.memory import MemoryUnit
from tq_stream.backends.shm import ShmUnit
from tq_stream.errors import ConfigError, StateError


class DictUnit(StorageUnit):
    """The smallest backend: one tensor per (partition, field, slot), dense fields only;
    ``nbytes`` counts exactly the bytes of its rows (a MemoryUnit counts capacity)."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str, int], tuple[torch.Tensor, int | None]] = {}

    def put(self, partition: str, slots: np.ndarray, columns: Mapping[str, object],
            generations: np.ndarray | None = None) -> None:
        for field, column in columns.items():
            assert isinstance(column, torch.Tensor), "dense fields only"
            for i, slot in enumerate(slots.tolist()):
                token = None if generations is None else int(generations[i])
                self.rows[partition, field, slot] = (column[i].clone(), token)

    def get(self, partition: str, slots: np.ndarray, fields: Sequence[str],
            generations: np.ndarray | None = None) -> dict[str, torch.Tensor]:
        out = {}
        for field in fields:
            picked = []
            for i, slot in enumerate(slots.tolist()):
                value, token = self.rows[partition, field, slot]
                if generations is not None and token != int(generations[i]):
                    raise StateError(f"slot {slot} of {partition!r} holds another row")
                picked.append(value)
            out[field] = torch.stack(picked)
        return out

    def free(self, partition: str, slots: np.ndarray) -> None:
        gone = set(slots.tolist())
        self.rows = {k: v for k, v in self.rows.items() if k[0] != partition or k[2] not in gone}

    def drop(self, partition: str) -> None:
        self.rows = {k: v for k, v in self.rows.items() if k[0] != partition}

    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v, _ in self.rows.values())


@pytest.fixture
def dict_kind(monkeypatch):
    monkeypatch.setitem(KINDS, "dict", DictUnit)  # the one line a new backend adds


def round_trip_through(stream: tq.Stream) -> None:
    keys = ["a", "b", "c"]
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    stream.writer("p").put(keys, {"x": x})
    assert torch.equal(stream.kv.get_batch(keys[::-1], partition="p")["x"], x.flip(0))
    assert [u["nbytes"] for u in stream.deployment_stats()["units"]] == [x.nbytes]


def test_a_kind_registered_with_one_line_serves_embedded_mode(dict_kind):
    with tq.init(storage="dict") as stream:
        assert all(isinstance(u, DictUnit) for u in stream.connection.units())
        round_trip_through(stream)


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_kind_registered_with_one_line_serves_local_mode(dict_kind):
    # the forked unit process inherits the table of this one
    with tq.init(mode="local", storage="dict", config=tq.StreamConfig(timeout=20.0)) as stream:
        round_trip_through(stream)


def test_the_built_in_kinds():
    assert sorted(KINDS) == ["memory", "shm"]
    assert type(make_unit("memory")) is MemoryUnit
    unit = make_unit("shm")
    try:
        assert isinstance(unit, ShmUnit) and unit.keep_bytes == 16 << 20
    finally:
        unit.close()


@pytest.mark.parametrize("mode", ["embedded", "local", "ray"])
def test_an_unknown_kind_is_named_before_anything_starts(mode):
    with pytest.raises(ConfigError, match=r"storage must be one of \['memory', 'shm'\], "
                                          r"got 'disk'"):
        tq.init(mode=mode, storage="disk")


def test_shm_is_the_older_spelling_of_storage():
    assert storage_or_shm(None, None) == "shm"
    assert storage_or_shm(None, False) == "memory"
    assert storage_or_shm(None, True) == "shm"
    assert storage_or_shm("memory", False) == "memory"
    with pytest.raises(ConfigError, match=r"shm must agree with storage .*\(shm=True means "
                                          r"storage='shm'\), got storage='memory'"):
        storage_or_shm("memory", True)
    with pytest.raises(ConfigError, match="storage must be one of"):
        storage_or_shm("disk", None)
