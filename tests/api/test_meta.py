"""BatchMeta: select, chunk, concat and their errors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tq_stream.errors import ConfigError
from tq_stream.messages.reads import Found, StepMeta
from tq_stream.meta import BatchMeta


def meta(n: int = 5, step: int = 0) -> BatchMeta:
    return BatchMeta.from_reply(StepMeta(
        partition="p", keys=[f"k{i}" for i in range(n)], index=np.arange(n),
        generation=np.arange(n) * 10, unit=np.zeros(n), slot=np.arange(n) + 100,
        tags=[{"i": i} for i in range(n)], fields=["x"], schemas={}, task="t", step=step,
        dp_rank=0, replica=0))


def test_select_positions_and_mask():
    m = meta()
    s = m.select([3, 1])
    assert s.keys == ("k3", "k1") and s.index.tolist() == [3, 1]
    assert s.generation.tolist() == [30, 10] and s.slot.tolist() == [103, 101]
    assert s.tags == ({"i": 3}, {"i": 1}) and s.task == "t" and s.fields == ("x",)
    masked = m.select(np.array([True, False, False, False, True]))
    assert masked.keys == ("k0", "k4")
    assert len(m.select([])) == 0


def test_select_errors():
    m = meta()
    with pytest.raises(ConfigError, match=r"positions must be in \[0, 5\), got \[5\]"):
        m.select([5])
    with pytest.raises(ConfigError, match="a mask must have 5 entries"):
        m.select(np.array([True, False]))


def test_chunk():
    parts = meta(7).chunk(3)
    assert [len(p) for p in parts] == [3, 2, 2]
    assert sum((p.keys for p in parts), ()) == meta(7).keys
    for bad in (0, 1.5, True):
        with pytest.raises(ConfigError, match="chunks must be an int >= 1"):
            meta().chunk(bad)


def test_concat_round_trips_chunks():
    m = meta(6)
    joined = BatchMeta.concat(m.chunk(4))
    assert joined.keys == m.keys and joined.index.tolist() == m.index.tolist()
    assert joined.tags == m.tags and joined.slot.tolist() == m.slot.tolist()


def test_concat_errors():
    with pytest.raises(ConfigError, match="non-empty list"):
        BatchMeta.concat([])
    with pytest.raises(ConfigError, match="share partition, task, step and dp_rank"):
        BatchMeta.concat([meta(2, step=0), meta(2, step=1)])


def test_a_lookup_reply_gives_the_defaults_of_no_step():
    one = np.zeros(1, np.int64)
    m = BatchMeta.from_reply(Found(partition="p", keys=["a"], index=one, generation=one,
                                   unit=one, slot=one, fields=[], schemas={}))
    assert m.tags == ({},) and m.step == -1 and not m.end and m.index.dtype == np.int64
    assert m.task == "" and m.turn is None and m.shared is None


def test_from_reply_sets_every_field_and_the_result_stays_frozen():
    d = StepMeta(partition="p", keys=["a", "b"], index=np.array([1, 2]),
                 generation=np.array([0, 3]), unit=np.array([0, 1]), slot=np.array([5, 6]),
                 schemas={"x": {"kind": "dense", "dtype": "float32", "shape": [2]}},
                 fields=["x"], task="t", step=4, dp_rank=1, replica=1)
    meta = BatchMeta.from_reply(d)
    assert set(vars(meta)) == {f.name for f in dataclasses.fields(BatchMeta)}
    assert meta.index.dtype == np.int64 and meta.unit.dtype == np.int32
    assert meta.tags == ({}, {}) and meta.session == "" and meta.end is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        meta.step = 5  # type: ignore[misc]
    assert meta.select([1]).keys == ("b",) and meta.select([1]).slot.tolist() == [6]


def test_a_batch_meta_from_the_embedded_controller_cannot_change_its_state(stream):
    """In embedded mode the reply's ``index`` is the controller's own share array: a
    BatchMeta hands it out read-only (as a decoded reply's arrays are in local mode)."""
    from tests.conftest import keys_of, put_rows

    put_rows(stream, keys_of("k", 2))
    client = stream.client()
    client.register_task("train", "t", ["x"], batch_size=1)
    meta = client.get_meta("train", "t", 0)
    for name in ("index", "generation", "unit", "slot"):
        with pytest.raises(ValueError, match="read-only"):
            getattr(meta, name)[0] = 1
    assert client.get_meta("train", "t", 0).keys == meta.keys == ("k0",)
    client.ack(meta)
    assert stream.stats()["train"]["tasks"]["t"]["acked"] == 1
