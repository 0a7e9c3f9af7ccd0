"""Ragged and multi-ragged rows a same-host writer copies into a unit's arenas itself
(``prepare_write``'s ``arenas``, ``tq_stream.backends.arena_writes``): the same rows as
a put through the unit, checked input, no arena moved under an open write, and a put
whose copy fails leaves nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.tq_fixtures import local_stream, unit
from tests.wire.test_images import images, same
from tq_stream.backends.arena_writes import ArenaWrite
from tq_stream.backends.segments import ShmReader
from tq_stream.backends.shm import ShmUnit, shm_available
from tq_stream.columns import Ragged
from tq_stream.errors import ConfigError
from tq_stream.handling import WouldBlock, inline
from tq_stream.multiragged import MultiRagged

__all__ = ["local_stream", "unit"]  # fixtures, imported for pytest

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not shm_available(), reason="needs a writable /dev/shm"),
]


def ragged(n: int, seed: int = 0, dtype: torch.dtype = torch.int64) -> Ragged:
    g = torch.Generator().manual_seed(seed)
    return Ragged.from_list([torch.randint(0, 100, (int(k), 2), generator=g).to(dtype)
                             for k in torch.randint(0, 40, (n,), generator=g)])


def direct_put(unit: ShmUnit, partition: str, slots: np.ndarray, cols: dict,
               tokens: np.ndarray) -> None:
    """What ``SameHostUnit`` does, in this process: place, copy, publish."""
    writes = {f: ArenaWrite.of(c) for f, c in cols.items()}
    plan = unit.prepare_write(partition, slots, tokens, {},
                              {f: w.wire() for f, w in writes.items()})
    for f, lay in plan["arenas"].items():
        arena = unit.stores[partition].fields[f].values
        arena[lay["at"] : lay["at"] + writes[f].total].copy_(writes[f].values(cols[f]))
    unit.finish_write(partition, plan["ticket"], True)


def test_rows_written_in_place_read_as_rows_put_through_the_unit(unit):
    imgs = MultiRagged.from_list(images(5, seed=3), fixed_dims=(0,))
    held = np.zeros(10, np.int64)
    for step, slots in enumerate((np.arange(5), np.arange(5, 10), np.array([2, 7, 1, 0, 9]))):
        cols = {"r": ragged(5, seed=step), "img": imgs}
        tokens = slots + 100 * (step + 1)
        if step == 2:  # the last reuses slots of earlier rows, once freed (as placed)
            unit.free("d", slots)
            unit.free("s", slots)
        direct_put(unit, "d", slots, cols, tokens)
        unit.put("s", slots, cols, tokens)
        held[slots] = tokens
    every = np.arange(10)
    a = unit.get("d", every, ["r", "img"], held)  # the tokens were published
    b = unit.get("s", every, ["r", "img"], held)
    assert torch.equal(a["r"].values, b["r"].values)
    assert torch.equal(a["r"].offsets, b["r"].offsets)
    assert same(a["img"].rows(), b["img"].rows())
    assert unit.nbytes() > 0


def test_a_refused_arena_write_places_no_row(unit):
    unit.put("p", np.arange(4), {"r": ragged(4)}, np.arange(4))
    store = unit.stores["p"].fields["r"]
    end = store.end
    wrong = ArenaWrite.of(ragged(4, dtype=torch.int32))
    with pytest.raises(ConfigError, match="'r' must be a ragged arena of int32\\[2\\]"):
        unit.prepare_write("p", np.arange(4, 8), None, {}, {"r": wrong.wire()})
    assert store.end == end
    assert torch.equal(unit.get("p", np.arange(4), ["r"])["r"].values, ragged(4).values)


@pytest.mark.parametrize(("raw", "rule"), [
    (["jagged", "int64", [], np.zeros(3, np.int64)], "must be \\[kind in"),
    (["ragged", "int64", [], np.array([0, 2, 1], np.int64)], "non-decreasing ints from 0"),
    (["ragged", "int64", [], np.array([1, 2, 3], np.int64)], "non-decreasing ints from 0"),
    (["ragged", "int64", [], np.array([0, 2], np.int64)], "must be 3 non-decreasing"),
    (["ragged", "int64", [], np.array([0, 1, 2], np.int32)], "sizes must be int64"),
    (["ragged", "int64", [], np.array([0, 1, 1 << 62], np.int64)], "at most"),
    (["multiragged", "uint8", [3, -1], np.array([[3, 4], [2, 4]], np.int64)], "fit dims"),
    (["multiragged", "uint8", [3, -1], np.array([[3, -4], [3, 4]], np.int64)], ">= 0"),
])
def test_bad_arena_writes_are_refused_naming_the_field(unit, raw, rule):
    with pytest.raises(ConfigError, match=rf"arenas\['x'\].*{rule}"):
        unit.prepare_write("p", np.arange(2), None, {}, {"x": raw})
    assert "p" not in unit.stores


def values_of(n: int, fill: int) -> Ragged:
    """One row of ``n`` values [2] of ``fill``."""
    return Ragged(torch.full((n, 2), fill, dtype=torch.int64), torch.tensor([0, n]))


def test_an_arena_grows_in_place_under_an_open_write(unit):
    unit.put("p", np.arange(2), {"r": ragged(2)}, np.arange(2))
    store = unit.stores["p"].fields["r"]
    row = values_of(3, 7)
    w = ArenaWrite.of(row)
    plan = unit.prepare_write("p", np.array([2]), np.array([2]), {}, {"r": w.wire()})
    name, cap = plan["arenas"]["r"]["shm"], plan["arenas"]["r"]["shape"][0]
    reader = ShmReader()
    old = reader.view(name, torch.int64, (cap, 2))  # the writer's mapping of its layout
    with inline():  # no wait: the arena grows in its own segment, nothing is copied
        unit.put("p", np.array([3]), {"r": values_of(cap, 9)}, np.array([3]))
    assert store.values.shape[0] > cap and unit._describe(store.values)["shm"] == name
    at = plan["arenas"]["r"]["at"]
    old[at : at + 3].copy_(row.values)  # the open write lands through the old mapping
    unit.finish_write("p", plan["ticket"], True)
    got = unit.get("p", np.array([2, 3]), ["r"], np.array([2, 3]))["r"]
    assert torch.equal(got.values, torch.cat([row.values, values_of(cap, 9).values]))
    wide = reader.view(name, torch.int64, tuple(store.values.shape))  # mapped again
    assert torch.equal(wide[at : at + 3], row.values)


def test_an_arena_does_not_compact_under_an_open_write(unit):
    unit.put("p", np.array([0]), {"r": values_of(1, 1)}, np.array([1]))
    unit.put("p", np.array([1]), {"r": values_of(70_000, 2)}, np.array([5]))
    unit.put("p", np.array([4]), {"r": values_of(1, 1)}, np.array([6]))  # room ahead
    unit.free("p", np.array([1]))  # garbage beyond the live values: the next growth compacts
    store = unit.stores["p"].fields["r"]
    plan = unit.prepare_write("p", np.array([2]), np.array([2]), {},
                              {"r": ArenaWrite.of(values_of(1, 3)).wire()})
    before = store.values
    with inline(), pytest.raises(WouldBlock):  # it would wait: not on an IO thread
        unit.put("p", np.array([3]), {"r": values_of(store.values.shape[0], 4)},
                 np.array([3]))
    assert store.values is before
    unit.finish_write("p", plan["ticket"], True)
    unit.put("p", np.array([3]), {"r": values_of(store.values.shape[0], 4)}, np.array([3]))
    assert store.values.data_ptr() != before.data_ptr()  # compacted into new memory
    got = unit.get("p", np.array([0, 3]), ["r"])["r"]
    assert torch.equal(got.values[:1], values_of(1, 1).values)


def spy_calls(units):
    calls: list[tuple[str, list[str]]] = []
    for u in units:
        original = u.remote.client.transport.call

        def spy(method, args=None, timeout=None, _orig=original):
            cols = sorted((args or {}).get("columns") or (args or {}).get("arenas") or [])
            calls.append((method, cols))
            return _orig(method, args, timeout=timeout)

        u.remote.client.transport.call = spy
    return calls


def test_large_ragged_puts_write_straight_into_shared_memory(local_stream):
    units = local_stream.connection.backend.units()
    calls = spy_calls(units)
    try:
        n = 32  # 16 rows a unit: over 1 MiB each
        keys = [f"r{i}" for i in range(n)]
        tokens = [torch.arange(int(k)) for k in torch.randint(2000, 3000, (n,))]
        imgs = images(n, seed=5)
        texts = [f"row {i}" for i in range(n)]
        w = local_stream.writer("ragged_direct")
        w.put(keys, {"tokens": tokens, "image": imgs, "text": texts})
        assert "put" not in [m for m, _ in calls]
        # only the object field goes over the socket, with the finish_write
        assert [cols for m, cols in calls if m == "finish_write"] == [["text"]] * len(units)
        assert [cols for m, cols in calls if m == "prepare_write"] == \
            [["image", "tokens"]] * len(units)
        got = local_stream.kv.get_batch(keys, partition="ragged_direct", ragged="list")
        assert got["text"] == texts
        assert same(got.get("image").tolist(), imgs)
        assert same(got.get("tokens").tolist(), tokens)
    finally:
        for u in units:
            del u.remote.client.transport.call


def test_a_put_whose_copy_fails_leaves_nothing(local_stream, monkeypatch):
    w = local_stream.writer("ragged_fail")
    keys = [f"f{i}" for i in range(32)]
    rows = [torch.arange(10_000) + i for i in range(32)]  # 1.3 MB a unit: written directly

    def broken(self, column):
        raise RuntimeError("copy failed")

    with monkeypatch.context() as m:
        m.setattr(ArenaWrite, "values", broken)
        with pytest.raises(RuntimeError, match="copy failed"):
            w.put(keys, {"tokens": rows})
    assert not local_stream.kv.list(partition="ragged_fail")
    w.put(keys, {"tokens": rows})
    got = local_stream.kv.get_batch(keys, partition="ragged_fail", ragged="list")
    assert same(got.get("tokens").tolist(), rows)
