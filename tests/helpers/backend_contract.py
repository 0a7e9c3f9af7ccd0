"""The contract every storage backend passes (see ``tq_stream.backends.base``).

Mix ``BackendContract`` into a test class and provide a fixture ``unit`` that
yields a fresh, open StorageUnit; ``tests/backends/test_backend_memory.py`` shows how.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tq_stream.backends.base import occupancy
from tq_stream.columns import Ragged
from tq_stream.errors import ClosedError, ConfigError, MemoryBudgetExceeded, StateError, TQError


def slots(*s: int) -> np.ndarray:
    return np.asarray(s, dtype=np.int64)


def dense(n: int, base: float = 0.0, width: int = 3) -> torch.Tensor:
    return torch.arange(n * width, dtype=torch.float32).reshape(n, width) + base


def ragged(lengths: list[int], base: int = 0) -> Ragged:
    return Ragged.from_list([torch.arange(k, dtype=torch.int64) + base + 100 * i
                             for i, k in enumerate(lengths)])


def ragged_rows(col: Ragged) -> list[list[int]]:
    return [col.row(i).tolist() for i in range(len(col))]


class BackendContract:
    """Tests every StorageUnit must pass; needs a fixture ``unit``."""

    # ---------------------------------------------------------------- round trips
    def test_dense_round_trip(self, unit):
        x = dense(4)
        unit.put("p", slots(0, 1, 2, 3), {"x": x})
        got = unit.get("p", slots(0, 1, 2, 3), ["x"])["x"]
        assert got.dtype == torch.float32 and torch.equal(got, x)

    def test_dense_multi_dim_and_dtypes(self, unit):
        cols = {"img": torch.randint(0, 255, (3, 2, 4), dtype=torch.uint8),
                "mask": torch.tensor([True, False, True]),
                "logp": torch.randn(3, 5, dtype=torch.float64)}
        unit.put("p", slots(5, 6, 7), cols)
        got = unit.get("p", slots(5, 6, 7), list(cols))
        for name, col in cols.items():
            assert got[name].dtype == col.dtype and torch.equal(got[name], col), name

    def test_ragged_round_trip(self, unit):
        col = ragged([3, 0, 5, 1])
        unit.put("p", slots(0, 1, 2, 3), {"r": col})
        got = unit.get("p", slots(0, 1, 2, 3), ["r"])["r"]
        assert isinstance(got, Ragged)
        assert got.offsets.tolist() == [0, 3, 3, 8, 9]
        assert ragged_rows(got) == ragged_rows(col)

    def test_ragged_with_tail_dims(self, unit):
        rows = [torch.randn(k, 2, 3) for k in (2, 4, 1)]
        unit.put("p", slots(0, 1, 2), {"r": Ragged.from_list(rows)})
        got = unit.get("p", slots(2, 0), ["r"])["r"]
        assert torch.equal(got.row(0), rows[2]) and torch.equal(got.row(1), rows[0])

    def test_object_round_trip(self, unit):
        values = ["a", 1, 2.5, True, None, b"\x00\x01", [1, [2, "x"]], {"k": [1, 2]}]
        unit.put("p", np.arange(len(values)), {"o": values})
        assert unit.get("p", np.arange(len(values)), ["o"])["o"] == values

    def test_object_values_are_copied_in_and_out(self, unit):
        value = {"k": [1, {"n": 2}], "t": (1, [2]), "s": "x"}
        unit.put("p", slots(0, 1), {"o": [value, [value["k"]]]})
        value["k"][1]["n"] = 99  # the caller's objects change after the put
        value["t"][1].append(3)
        got = unit.get("p", slots(0, 1), ["o"])["o"]
        assert got == [{"k": [1, {"n": 2}], "t": (1, [2]), "s": "x"}, [[1, {"n": 2}]]]
        assert type(got[0]["t"]) is tuple
        got[0]["k"].append("changed")  # and the reader's objects change after the get
        got[1][0][1]["n"] = -1
        again = unit.get("p", slots(0, 1), ["o"])["o"]
        assert again[0]["k"] == [1, {"n": 2}] and again[1] == [[1, {"n": 2}]]

    def test_get_follows_slot_order(self, unit):
        unit.put("p", slots(0, 1, 2, 3), {"x": dense(4), "r": ragged([1, 2, 3, 4]),
                                          "o": ["a", "b", "c", "d"]})
        order = slots(3, 0, 2, 0)
        got = unit.get("p", order, ["x", "r", "o"])
        assert torch.equal(got["x"], dense(4)[torch.from_numpy(order)])
        assert [len(got["r"].row(i)) for i in range(4)] == [4, 1, 3, 1]
        assert got["o"] == ["d", "a", "c", "a"]

    def test_empty_get(self, unit):
        unit.put("p", slots(0), {"x": dense(1), "r": ragged([2]), "o": ["a"]})
        got = unit.get("p", slots(), ["x", "r", "o"])
        assert got["x"].shape == (0, 3) and len(got["r"]) == 0 and got["o"] == []

    # ------------------------------------------------------------ partial writes
    def test_partial_field_write_leaves_other_fields_and_rows(self, unit):
        unit.put("p", slots(0, 1, 2), {"x": dense(3), "o": ["a", "b", "c"]})
        unit.put("p", slots(1), {"y": torch.tensor([7.0])})
        unit.put("p", slots(2), {"x": dense(1, base=50)})
        got = unit.get("p", slots(0, 1, 2), ["x", "o"])
        assert torch.equal(got["x"][:2], dense(3)[:2])
        assert torch.equal(got["x"][2], dense(1, base=50)[0])
        assert got["o"] == ["a", "b", "c"]
        assert unit.get("p", slots(1), ["y"])["y"].tolist() == [7.0]

    def test_overwrite(self, unit):
        unit.put("p", slots(0, 1), {"x": dense(2), "r": ragged([2, 3]), "o": ["a", "b"]})
        unit.put("p", slots(1), {"x": dense(1, base=9), "r": ragged([6], base=7), "o": ["z"]})
        got = unit.get("p", slots(0, 1), ["x", "r", "o"])
        assert torch.equal(got["x"][1], dense(1, base=9)[0])
        assert torch.equal(got["x"][0], dense(2)[0])
        assert ragged_rows(got["r"]) == [[0, 1], ragged_rows(ragged([6], base=7))[0]]
        assert got["o"] == ["a", "z"]

    # ------------------------------------------------------------- free and reuse
    def test_free_then_reuse(self, unit):
        unit.put("p", slots(0, 1, 2), {"x": dense(3), "r": ragged([1, 2, 3]), "o": [1, 2, 3]})
        unit.free("p", slots(1))
        unit.put("p", slots(1), {"x": dense(1, base=40), "r": ragged([5], base=40), "o": [9]})
        got = unit.get("p", slots(0, 1, 2), ["x", "r", "o"])
        assert torch.equal(got["x"], torch.cat([dense(3)[:1], dense(1, base=40), dense(3)[2:]]))
        assert [len(got["r"].row(i)) for i in range(3)] == [1, 5, 3]
        assert got["o"] == [1, 9, 3]

    @pytest.mark.parametrize("field", ["x", "r", "o"])
    def test_freed_field_never_returned_for_reput_slot(self, unit, field):
        unit.put("p", slots(0, 1), {"x": dense(2), "r": ragged([2, 2]), "o": ["a", "b"],
                                    "k": torch.ones(2)})
        unit.free("p", slots(1))
        unit.put("p", slots(1), {"k": torch.zeros(1)})  # the slot's new row lacks `field`
        with pytest.raises(TQError, match=repr(field)):
            unit.get("p", slots(1), [field])
        assert len(unit.get("p", slots(0), [field])[field]) == 1  # row 0 still readable

    def test_a_field_the_row_in_a_reused_slot_lacks_is_refused_with_its_token(self, unit):
        old = occupancy(np.array([0, 1]), np.array([0, 0]))
        new = occupancy(np.array([5]), np.array([0]))
        unit.put("p", slots(0, 1), {"x": dense(2), "k": torch.ones(2)}, generations=old)
        unit.free("p", slots(1))  # row 0 keeps the partition's stores
        unit.put("p", slots(1), {"k": torch.zeros(1)}, generations=new)  # no "x"
        with pytest.raises(TQError, match="'x'"):
            unit.get("p", slots(1), ["x"], generations=new)
        assert unit.get("p", slots(1), ["k"], generations=new)["k"].tolist() == [0.0]
        assert torch.equal(unit.get("p", slots(0), ["x"], generations=old[:1])["x"], dense(1))

    def test_growth_past_initial_capacity(self, unit):
        n = 10_000
        s = np.arange(n, dtype=np.int64)
        x = torch.arange(n * 2, dtype=torch.float32).reshape(n, 2)
        r = Ragged.from_list([torch.full((i % 5,), i, dtype=torch.int32) for i in range(n)])
        objs = [f"v{i}" for i in range(n)]
        for lo in range(0, n, 2500):  # several puts, each growing the stores
            part = slice(lo, lo + 2500)
            rows = Ragged.from_list([r.row(i) for i in range(lo, lo + 2500)])
            unit.put("p", s[part], {"x": x[part], "o": objs[part], "r": rows})
        pick = np.asarray([0, 17, 4999, 9999, 2500], dtype=np.int64)
        got = unit.get("p", pick, ["x", "r", "o"])
        assert torch.equal(got["x"], x[torch.from_numpy(pick)])
        assert [got["r"].row(i).tolist() for i in range(5)] == \
            [[p] * (p % 5) for p in pick.tolist()]
        assert got["o"] == [f"v{p}" for p in pick.tolist()]

    def test_ragged_churn_keeps_values(self, unit):
        """Many overwrites of the same slots (arena garbage, compaction) keep values right."""
        expect = {}
        for it in range(60):
            lengths = [(it * 7 + i) % 900 for i in range(8)]
            unit.put("p", np.arange(8), {"r": ragged(lengths, base=it)})
            expect = ragged_rows(ragged(lengths, base=it))
        assert ragged_rows(unit.get("p", np.arange(8), ["r"])["r"]) == expect

    # ------------------------------------------------------------------- memory
    def test_drop_returns_memory(self, unit):
        assert unit.nbytes() == 0
        unit.put("p", np.arange(100), {"x": dense(100), "r": ragged([3] * 100),
                                       "o": ["s"] * 100})
        assert unit.nbytes() > 0
        unit.drop("p")
        assert unit.nbytes() == 0
        with pytest.raises(TQError):
            unit.get("p", slots(0), ["x"])

    def test_free_of_every_row_returns_memory(self, unit):
        unit.put("p", np.arange(50), {"x": dense(50), "r": ragged([4] * 50)})
        unit.free("p", np.arange(25))
        assert unit.nbytes() > 0
        unit.free("p", np.arange(25, 50))
        assert unit.nbytes() == 0

    def test_many_partitions_isolated(self, unit):
        for i in range(20):
            unit.put(f"p{i}", slots(0, 1), {"x": dense(2, base=100 * i), "o": [i, -i]})
        unit.drop("p3")
        unit.free("p4", slots(0, 1))
        for i in range(20):
            if i in (3, 4):
                continue
            got = unit.get(f"p{i}", slots(0, 1), ["x", "o"])
            assert torch.equal(got["x"], dense(2, base=100 * i)) and got["o"] == [i, -i]

    # ------------------------------------------------------------------- errors
    def test_unknown_field_raises(self, unit):
        unit.put("p", slots(0), {"x": dense(1)})
        with pytest.raises(TQError, match="'nope'"):
            unit.get("p", slots(0), ["nope"])
        with pytest.raises(TQError):
            unit.get("other", slots(0), ["x"])

    def test_closed_unit_raises(self, unit):
        unit.put("p", slots(0), {"x": dense(1)})
        unit.close()
        unit.close()  # idempotent
        with pytest.raises(ClosedError):
            unit.put("p", slots(1), {"x": dense(1)})
        with pytest.raises(ClosedError):
            unit.get("p", slots(0), ["x"])

    # ------------------------------------------------------ occupancy tokens
    def test_get_with_tokens_of_the_rows_written(self, unit):
        tokens = occupancy(np.array([0, 1]), np.array([3, 3]))
        unit.put("p", slots(0, 1), {"x": dense(2)}, generations=tokens)
        got = unit.get("p", slots(1, 0), ["x"], generations=tokens[::-1].copy())
        assert torch.equal(got["x"], dense(2)[[1, 0]])
        unit.put("p", slots(0), {"y": torch.ones(1)}, generations=tokens[:1])  # a later field
        assert unit.get("p", slots(0), ["x", "y"], generations=tokens[:1])["y"].item() == 1

    def test_get_with_a_stale_token_raises(self, unit):
        old = occupancy(np.array([0]), np.array([0]))
        unit.put("p", slots(0, 1), {"x": dense(2)}, generations=np.concatenate(
            [old, occupancy(np.array([1]), np.array([0]))]))
        unit.free("p", slots(0))
        with pytest.raises(StateError):
            unit.get("p", slots(0), ["x"], generations=old)
        new = occupancy(np.array([7]), np.array([0]))  # another row now in slot 0
        unit.put("p", slots(0), {"x": dense(1, base=9)}, generations=new)
        with pytest.raises(StateError):
            unit.get("p", slots(0), ["x"], generations=old)
        assert torch.equal(unit.get("p", slots(0), ["x"], generations=new)["x"],
                           dense(1, base=9))
        with pytest.raises(StateError):
            unit.get("gone", slots(0), ["x"], generations=old)

    def test_a_put_never_replaces_a_row_of_another_token(self, unit):
        """A late put of rows cleared meanwhile (its slots hold newer rows now) is
        refused and changes nothing; a put of a row's own token adds to it."""
        live = occupancy(np.array([5, 6]), np.array([3, 3]))
        unit.put("p", slots(0, 1), {"x": dense(2, base=9)}, generations=live)
        late = occupancy(np.array([1, 2]), np.array([0, 0]))
        with pytest.raises(StateError, match=r"slots \[1\] of partition 'p' hold other"):
            unit.put("p", slots(2, 1), {"x": dense(2), "y": torch.ones(2)},
                     generations=late)
        got = unit.get("p", slots(0, 1), ["x"], generations=live)["x"]
        assert torch.equal(got, dense(2, base=9))
        unit.put("p", slots(1), {"y": torch.ones(1)}, generations=live[1:])
        assert unit.get("p", slots(1), ["y"], generations=live[1:])["y"].item() == 1

    # ----------------------------------------------------------------- aliasing
    def test_results_do_not_alias_storage(self, unit):
        unit.put("p", slots(0, 1), {"x": dense(2), "r": ragged([2, 3]),
                                    "o": [[1, 2], {"a": [3]}]})
        got = unit.get("p", slots(0, 1), ["x", "r", "o"])
        got["x"].fill_(-1)
        got["r"].values.fill_(-1)
        got["o"][0].append(99)
        got["o"][1]["a"].append(99)
        again = unit.get("p", slots(0, 1), ["x", "r", "o"])
        assert torch.equal(again["x"], dense(2))
        assert ragged_rows(again["r"]) == ragged_rows(ragged([2, 3]))
        assert again["o"] == [[1, 2], {"a": [3]}]

    def test_later_put_does_not_change_earlier_result(self, unit):
        unit.put("p", slots(0, 1), {"x": dense(2), "r": ragged([2, 3]), "o": ["a", "b"]})
        before = unit.get("p", slots(0, 1), ["x", "r", "o"])
        unit.put("p", slots(0, 1), {"x": dense(2, base=5), "r": ragged([4, 4], base=5),
                                    "o": ["c", "d"]})
        unit.free("p", slots(0))
        assert torch.equal(before["x"], dense(2))
        assert ragged_rows(before["r"]) == ragged_rows(ragged([2, 3]))
        assert before["o"] == ["a", "b"]

    def test_input_not_aliased(self, unit):
        x, objs = dense(2), [[1], [2]]
        unit.put("p", slots(0, 1), {"x": x, "o": objs})
        x.fill_(0)
        objs[0].append(5)
        got = unit.get("p", slots(0, 1), ["x", "o"])
        assert torch.equal(got["x"], dense(2)) and got["o"] == [[1], [2]]

    # ---------------------------------------------------------------- memory budget
    # A unit either keeps ``set_memory`` (budget and cold fields, ``backends/spill.py``)
    # or refuses it with a ConfigError; it never takes it and ignores it.
    def _spills(self, unit) -> bool:
        try:
            unit.set_memory("p", 1 << 30, [])
        except ConfigError:
            return False
        return True

    def test_cold_fields_read_back_as_written_and_hold_no_memory(self, unit):
        if not self._spills(unit):
            pytest.skip("this unit refuses set_memory")
        unit.set_memory("p", None, ["img", "r", "o"])
        unit.put("p", slots(3, 1, 2), {"img": dense(3, width=64), "x": dense(3),
                                       "r": ragged([2, 0, 5]), "o": ["a", {"b": 1}, None]},
                 occupancy(slots(3, 1, 2), slots(0, 0, 0)))
        got = unit.get("p", slots(2, 3), ["img", "x", "r", "o"])
        assert torch.equal(got["img"], dense(3, width=64)[[2, 0]])
        assert torch.equal(got["x"], dense(3)[[2, 0]])
        assert ragged_rows(got["r"]) == [ragged_rows(ragged([2, 0, 5]))[i] for i in (2, 0)]
        assert got["o"] == [None, "a"]
        part = unit.stats()["partitions"]["p"]
        assert set(part["fields"]) == {"x"} and part["spilled"] > 0
        unit.free("p", slots(1, 2, 3))
        assert unit.stats()["partitions"].get("p", {"spilled": 0})["spilled"] == 0
        with pytest.raises(TQError):
            unit.get("p", slots(3), ["img"])

    def test_marking_a_field_cold_moves_its_rows(self, unit):
        if not self._spills(unit):
            pytest.skip("this unit refuses set_memory")
        unit.put("p", slots(0, 1), {"x": dense(2), "y": dense(2, 5.0)})
        unit.set_memory("p", None, ["x"])
        assert set(unit.stats()["partitions"]["p"]["fields"]) == {"y"}
        assert torch.equal(unit.get("p", slots(1, 0), ["x"])["x"], dense(2)[[1, 0]])
        unit.put("p", slots(1), {"x": dense(1, 9.0)})  # overwrite on disk
        assert torch.equal(unit.get("p", slots(1), ["x"])["x"], dense(1, 9.0))

    def test_a_put_past_the_budget_is_refused_and_leaves_other_rows(self, unit):
        if not self._spills(unit):
            pytest.skip("this unit refuses set_memory")
        unit.set_memory("p", 64 << 10, [])
        unit.put("p", slots(0), {"x": dense(1)})
        with pytest.raises(MemoryBudgetExceeded, match="memory_budget of partition 'p'"):
            unit.put("p", slots(1), {"big": dense(1, width=1 << 16)})
        assert torch.equal(unit.get("p", slots(0), ["x"])["x"], dense(1))
        assert unit.stats()["partitions"]["p"]["budget"] == 64 << 10
        assert sum(unit.stats()["partitions"]["p"]["fields"].values()) <= 64 << 10

    @pytest.mark.parametrize("bad", [0, -1, 1.5, "1"])
    def test_a_bad_budget_names_memory_budget(self, unit, bad):
        with pytest.raises(ConfigError, match="memory_budget"):
            unit.set_memory("p", bad, [])

    def test_rows_told_they_may_spill_read_back_equal(self, unit):
        spills = self._spills(unit)  # with a budget, a spilling unit moves them to disk
        unit.put("p", slots(0, 1, 2, 3), {"r": ragged([3, 1, 0, 2]), "x": dense(4)},
                 occupancy(slots(0, 1, 2, 3), slots(0, 0, 0, 0)))
        unit.may_spill("p", slots(3, 1), ["r"])
        got = unit.get("p", slots(3, 0, 1, 2), ["r", "x"],
                       occupancy(slots(3, 0, 1, 2), slots(0, 0, 0, 0)))
        want = ragged_rows(ragged([3, 1, 0, 2]))
        assert ragged_rows(got["r"]) == [want[i] for i in (3, 0, 1, 2)]
        assert torch.equal(got["x"], dense(4)[[3, 0, 1, 2]])
        if spills:
            assert unit.stats()["partitions"]["p"]["spilled"] > 0
        unit.put("p", slots(1), {"r": ragged([4], 7)})  # a later put overwrites
        assert ragged_rows(unit.get("p", slots(1), ["r"])["r"]) == ragged_rows(ragged([4], 7))
        unit.free("p", slots(0, 1, 2, 3))
        assert unit.stats()["partitions"].get("p", {"spilled": 0})["spilled"] == 0
