"""Unit tests (no sockets) of the small-operation fast paths: inline dispatch, spare
rows (a put in two calls), and small tensors inside the message header."""

from __future__ import annotations

import threading

import msgspec
import numpy as np
import pytest
import torch

from tests.helpers.served import Served
from tq_stream.backends.base import occupancy
from tq_stream.backends.memory import MemoryUnit
from tq_stream.columns import Ragged, schema_of
from tq_stream.connection.spares import SparePool
from tq_stream.controller import Controller
from tq_stream.controller.checkpoint import load_controller
from tq_stream.convert import schemas_of
from tq_stream.deploy.services import ControllerService
from tq_stream.errors import (
    ClosedError,
    ConfigError,
    KeyConflictError,
    SchemaError,
    SerializationError,
    StateError,
    WaitTimeout,
)
from tq_stream.handling import WouldBlock, may_block
from tq_stream.messages.puts import Committed, Rows
from tq_stream.serialization import decode, encode
from tq_stream.transport.dispatch import Dispatcher
from tq_stream.transport.handler import Methods

pytestmark = pytest.mark.timeout(60)

SCHEMA = {"x": schema_of(torch.zeros(1, 4)).to_dict()}


# ------------------------------------------------------------------ dispatch


class Handler:
    RPC_TABLE = Methods({"probe", "slow"}, inline={"probe"})

    def probe(self):
        return may_block()

    def slow(self):
        return may_block()


def test_inline_methods_run_with_may_block_false_and_only_then():
    d = Dispatcher(Handler())
    assert d.inline == {"probe"}
    assert d.call_inline("probe", {}) is False
    assert d("probe", {}) is True  # a worker (or an in-process caller) may block
    assert may_block() is True  # the flag does not leak out of the call


def test_inline_flag_is_reset_when_the_method_raises():
    class Raiser:
        RPC_TABLE = Methods({"go"}, inline={"go"})

        def go(self):
            raise WouldBlock

    with pytest.raises(WouldBlock):
        Dispatcher(Raiser()).call_inline("go", {})
    assert may_block() is True


def test_inline_methods_must_be_methods_of_the_table():
    class Bad(Handler):
        RPC_TABLE = Methods({"probe", "slow"}, inline={"probe", "missing"})

    with pytest.raises(ConfigError, match=r"RPC_TABLE.inline must be names in its methods, "
                                          r"got \['missing'\]"):
        Dispatcher(Bad())


def test_controller_inline_methods_never_free_or_wait():
    # Methods that free storage through the units (a network call) or long-poll must
    # stay on worker threads.
    for name in ("get_meta", "ack", "clear", "abort", "list_rows"):
        assert name not in ControllerService.RPC_TABLE.inline
    assert ControllerService.RPC_TABLE.inline <= ControllerService.RPC_TABLE.methods


def test_reserve_at_capacity_raises_would_block_inline_and_waits_on_a_worker():
    c = Controller(1)
    c.create_partition("p", capacity=1)
    c.reserve("p", ["a"], SCHEMA)
    d = Dispatcher(Served(c))
    args = {"partition": "p", "keys": ["b"], "schemas": SCHEMA, "timeout": 5.0}
    with pytest.raises(WouldBlock):
        d.call_inline("reserve", args)
    assert c.stats()["p"]["rows"] == 1  # nothing was allocated by the inline attempt
    with pytest.raises(WaitTimeout):
        d("reserve", {**args, "timeout": 0.05})
    # without waiting (room left) an inline reserve simply answers
    assert len(d.call_inline("reserve", {**args, "keys": ["a"]}).index) == 1


def test_admit_raises_would_block_inline_when_it_would_wait():
    from tq_stream.samplers import SequentialSampler, StalenessSampler

    c = Controller(1)
    c.register_task("p", "t", ["x"], 1, sampler=StalenessSampler(SequentialSampler(), 0))
    c.set_version("p", "t", 0)
    d = Dispatcher(Served(c))
    assert d.call_inline("admit", {"partition": "p", "n": 1}) == 1
    with pytest.raises(WouldBlock):
        d.call_inline("admit", {"partition": "p", "n": 1})


# -------------------------------------------------------------- spare rows


def put_spare(c: Controller, unit: MemoryUnit, keys, spare, value=1.0):
    """Store bytes in spare rows and commit them (what SparePool.put does)."""
    rows = {f: getattr(spare, f)[: len(keys)] for f in ("index", "unit", "slot", "generation")}
    unit.put("p", rows["slot"], {"x": torch.full((len(keys), 4), value)},
             occupancy(rows["index"], rows["generation"]))
    return c.commit_new("p", keys, rows["index"], rows["generation"], SCHEMA), rows


def test_reserve_hands_out_spare_rows_that_commit_new_turns_into_rows():
    c, unit = Controller(1), MemoryUnit()
    place = c.reserve("p", ["a"], SCHEMA, spare=3)
    assert len(place.spare.index) == 3
    assert not set(place.spare.index.tolist()) & set(place.index.tolist())
    assert c.stats()["p"]["rows"] == 1  # spare rows are no rows: not counted, not listed
    assert [r["key"] for r in c.list_rows("p")] == ["a"]
    done, rows = put_spare(c, unit, ["b", "c"], place.spare, 7.0)
    assert done == Committed(ok=True)
    meta = c.lookup("p", ["b", "c"], ["x"])
    assert meta.index.tolist() == rows["index"].tolist()
    got = unit.get("p", meta.slot, ["x"], occupancy(meta.index, meta.generation))
    assert got["x"].eq(7.0).all()
    c.register_task("p", "t", ["x"], 2)  # rows from spares are ready like any others
    assert c.get_meta("p", "t", 0, timeout=1).keys == ["b", "c"]  # "a" has no x


def test_commit_new_changes_nothing_unless_every_check_passes():
    c = Controller(1)
    place = c.reserve("p", ["a"], SCHEMA, spare=4)
    c.commit("p", place.index, place.generation, SCHEMA)
    spare = place.spare
    idx, gen = spare.index[:2], spare.generation[:2]
    assert c.commit_new("p", ["a", "b"], idx, gen, SCHEMA) == Committed(ok=False, reason="exists")
    other = {"x": schema_of(torch.zeros(1, 5)).to_dict()}
    assert c.commit_new("p", ["b", "c"], idx, gen, other) == Committed(ok=False, reason="schema")
    with pytest.raises(KeyConflictError):
        c.commit_new("p", ["b", "b"], idx, gen, SCHEMA)
    with pytest.raises(ConfigError):
        c.commit_new("p", ["b", "c"], np.array([idx[0], idx[0]]), gen, SCHEMA)
    with pytest.raises(StateError, match="spare rows"):
        c.commit_new("p", ["b", "c"], idx, gen + 1, SCHEMA)
    with pytest.raises(StateError, match="spare rows"):
        c.commit_new("p", ["b"], place.index, place.generation, SCHEMA)  # a live row
    assert [r["key"] for r in c.list_rows("p")] == ["a"]
    c.create_partition("p", capacity=1)
    assert c.commit_new("p", ["b"], idx[:1], gen[:1], SCHEMA) == \
        Committed(ok=False, reason="capacity")
    c.close_partition("p")
    with pytest.raises(ClosedError, match="closed to new rows"):
        c.commit_new("p", ["b"], idx[:1], gen[:1], SCHEMA)
    assert [r["key"] for r in c.list_rows("p")] == ["a"]


@pytest.mark.parametrize("form", ["lists", "arrays"])
def test_one_row_commit_new_checks_and_commits_like_many_rows(form):
    """A one-row put's commit_new (index and generation as lists of one int: the
    writer's form, a path of its own) makes the same checks and the same row as the
    general path (arrays)."""
    c = Controller(1)
    c.register_task("p", "t", ["x"], 1)
    place = c.reserve("p", ["a"], SCHEMA, spare=4)
    c.commit("p", place.index, place.generation, SCHEMA)
    spare = place.spare

    def one(i: int, gen_delta: int = 0) -> tuple:
        idx, gen = spare.index[i:i + 1], spare.generation[i:i + 1] + gen_delta
        return (idx.tolist(), gen.tolist()) if form == "lists" else (idx, gen)

    assert c.commit_new("p", ["a"], *one(0), SCHEMA) == Committed(ok=False, reason="exists")
    other = {"x": schema_of(torch.zeros(1, 5)).to_dict()}
    assert c.commit_new("p", ["b"], *one(0), other) == Committed(ok=False, reason="schema")
    with pytest.raises(StateError, match="spare rows"):
        c.commit_new("p", ["b"], *one(0, gen_delta=1), SCHEMA)
    live = (place.index, place.generation)
    if form == "lists":
        live = (live[0].tolist(), live[1].tolist())
    with pytest.raises(StateError, match="spare rows"):  # a live row, not a spare one
        c.commit_new("p", ["b"], *live, SCHEMA)
    with pytest.raises(ConfigError):
        c.commit_new("p", ["b"], *one(0), {})
    assert [r["key"] for r in c.list_rows("p")] == ["a"]
    assert c.commit_new("p", ["b"], *one(0), SCHEMA) == Committed(ok=True)
    assert [r["key"] for r in c.list_rows("p")] == ["a", "b"]
    assert [c.get_meta("p", "t", s, timeout=1).keys for s in (0, 1)] == [["a"], ["b"]]
    with pytest.raises(StateError, match="spare rows"):  # no longer a spare row
        c.commit_new("p", ["c"], *one(0), SCHEMA)
    c.create_partition("p", capacity=2)
    assert c.commit_new("p", ["c"], *one(1), SCHEMA) == Committed(ok=False, reason="capacity")
    c.close_partition("p")
    with pytest.raises(ClosedError, match="closed to new rows"):
        c.commit_new("p", ["c"], *one(1), SCHEMA)
    assert c.stats()["p"]["rows"] == 2


@pytest.mark.parametrize("form", ["lists", "arrays"])
def test_commit_new_rejects_bad_tags_and_clashing_field_paths_before_any_change(form):
    """Tags that are not one dict per key, and a field path that clashes with a known
    field ("x" vs "x.y"), are errors raised before the row is bound: the spare row
    stays spare and can still be committed (one row: either form of the indexes)."""
    c = Controller(1)
    c.register_task("p", "t", ["x"], 1)
    place = c.reserve("p", ["a"], SCHEMA, spare=2)
    c.commit("p", place.index, place.generation, SCHEMA)
    idx, gen = place.spare.index[:1], place.spare.generation[:1]
    if form == "lists":
        idx, gen = idx.tolist(), gen.tolist()
    for bad in ([], [{}, {}], [{"": 1}], [3]):
        with pytest.raises(ConfigError, match="tags"):
            c.commit_new("p", ["b"], idx, gen, SCHEMA, tags=bad)
    clash = {"x.y": schema_of(torch.zeros(1, 2)).to_dict()}
    with pytest.raises(SchemaError, match="x.y"):
        c.commit_new("p", ["b"], idx, gen, clash)
    with pytest.raises(ConfigError, match="needs fields and one distinct index"):
        c.commit_new("p", ["b"], idx, gen, {})
    assert [r["key"] for r in c.list_rows("p")] == ["a"]
    assert c.commit_new("p", ["b"], idx, gen, SCHEMA, tags=[{"r": 1}]) == Committed(ok=True)
    assert c.get_meta("p", "t", 1, timeout=1).tags == [{"r": 1}]


def test_no_spares_for_bounded_partitions_or_writes_through_a_meta():
    c = Controller(1)
    c.create_partition("p", capacity=10)
    assert len(c.reserve("p", ["a"], SCHEMA, spare=4).spare.index) == 0
    c2 = Controller(1)
    place = c2.reserve("q", ["a"], SCHEMA)
    c2.commit("q", place.index, place.generation, SCHEMA)
    again = c2.reserve("q", ["a"], SCHEMA, expect=place.generation, spare=4)
    assert len(again.spare.index) == 0
    with pytest.raises(ConfigError, match="spare"):
        c2.reserve("q", ["a"], SCHEMA, spare=-1)


def test_commit_new_can_refill_spares():
    c, unit = Controller(2), MemoryUnit()
    spare = c.reserve("p", ["a"], SCHEMA, spare=1).spare
    rows = msgspec.structs.asdict(spare)
    unit.put("p", rows["slot"], {"x": torch.ones(1, 4)}, occupancy(rows["index"],
                                                                   rows["generation"]))
    done = c.commit_new("p", ["b"], rows["index"], rows["generation"], SCHEMA, spare=5)
    assert done.ok and len(done.spare.index) == 5
    assert sorted(set(done.spare.unit.tolist())) == [0, 1]  # spread over the units


def test_released_and_checkpointed_spares_are_free_rows_again():
    c = Controller(1)
    spare = c.reserve("p", ["a"], SCHEMA, spare=3).spare
    state = c.state_dict()
    parts, _ = load_controller(state, 1)
    part = parts["p"]
    assert not part.spare.any()
    assert set(spare.index.tolist()) <= set(part._free_rows)
    assert set(spare.slot.tolist()) <= set(part._pools[0].free)
    assert (part.generation[spare.index] == spare.generation + 1).all()
    assert c.release_spares("p", spare.index[:2], spare.generation[:2]) == 2
    assert c.release_spares("p", spare.index[:2], spare.generation[:2]) == 0  # once
    with pytest.raises(StateError):
        c.commit_new("p", ["b"], spare.index[:1], spare.generation[:1], SCHEMA)
    assert c.release_spares("missing", spare.index, spare.generation) == 0


class FakeController:
    """Records commit_new calls and answers from a script."""

    def __init__(self, *answers) -> None:
        self.answers = list(answers)
        self.calls: list[dict] = []

    def commit_new(self, **kwargs):
        self.calls.append(kwargs)
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return Committed(**answer)


def spare_rows(n: int, start: int = 0) -> Rows:
    r = np.arange(start, start + n, dtype=np.int64)
    return Rows(index=r, unit=np.zeros(n, np.int64), slot=r, generation=r * 0)


def known_pool() -> SparePool:
    """A pool that learned field x's fixed schema (float32[4]) from an earlier put:
    a pool never writes a field whose schema it has not seen fixed."""
    pool = SparePool("p", -1)
    pool.learn(schemas_of({"x": torch.ones(1, 4)}))
    return pool


def test_a_pool_sends_unknown_fields_through_reserve():
    pool = SparePool("p", -1)
    pool.add(spare_rows(2))
    ctrl = FakeController({"ok": True})
    assert not pool.put(ctrl, [MemoryUnit()], ["a"], {"x": torch.ones(1, 4)}, None)
    assert ctrl.calls == [] and len(pool) == 2  # nothing written, no row taken


def test_pool_puts_in_two_calls_and_refills():
    unit, pool = MemoryUnit(), known_pool()
    assert pool.wanted() == SparePool.TARGET
    pool.add(spare_rows(2))
    ctrl = FakeController({"ok": True, "spare": spare_rows(3, start=10)})
    assert pool.put(ctrl, [unit], ["a"], {"x": torch.ones(1, 4)}, None)
    assert ctrl.calls[0]["keys"] == ["a"] and ctrl.calls[0]["spare"] == SparePool.TARGET - 1
    assert len(pool) == 4  # one left, three new
    assert unit.get("p", np.array([0]), ["x"], occupancy(np.array([0]), np.array([0])))[
        "x"].eq(1).all()


def test_pool_refills_in_batches_and_when_a_put_found_too_few_rows():
    unit, pool = MemoryUnit(), known_pool()
    pool.add(spare_rows(SparePool.TARGET))
    ctrl = FakeController(*[{"ok": True} for _ in range(SparePool.TARGET)])
    asked = []
    for i in range(SparePool.TARGET // 2):
        assert pool.put(ctrl, [unit], [f"k{i}"], {"x": torch.ones(1, 4)}, None)
        asked.append(ctrl.calls[-1]["spare"])
    # Nothing asked while more than half is left; then the whole gap at once.
    assert asked[:-1] == [0] * (len(asked) - 1) and asked[-1] == SparePool.TARGET // 2
    assert pool.wanted() == SparePool.TARGET // 2
    pool.add(spare_rows(2, start=100))  # above half again: nothing wanted
    assert len(pool) == SparePool.TARGET // 2 + 2 and pool.wanted() == 0
    big = [f"b{i}" for i in range(len(pool) + 1)]  # more rows than are left
    assert not pool.put(ctrl, [unit], big, {"x": torch.ones(len(big), 4)}, None)
    assert pool.wanted() == SparePool.TARGET - len(pool)  # so the next call refills


def test_pool_target_grows_when_puts_find_it_empty():
    unit, pool = MemoryUnit(), known_pool()
    ctrl = FakeController()
    targets = []
    for _ in range(6):  # as when many threads take the rows faster than refills come
        assert not pool.put(ctrl, [unit], ["a"], {"x": torch.ones(1, 4)}, None)
        targets.append(pool.wanted())
    assert targets == [32, 64, 128, 256, 256, 256]  # doubled, up to MAX_TARGET
    assert SparePool.MAX_TARGET == 256 and not ctrl.calls  # nothing was sent


def test_pool_rejected_put_frees_its_bytes_and_keeps_the_rows():
    unit, pool = MemoryUnit(), known_pool()
    pool.add(spare_rows(2))
    ctrl = FakeController({"ok": False, "reason": "exists"})
    assert not pool.put(ctrl, [unit], ["a"], {"x": torch.ones(1, 4)}, None)
    assert unit.nbytes() == 0  # the bytes stored in the spare slot are freed
    assert len(pool) == 2
    assert not pool.put(ctrl, [unit], ["b"], {"x": torch.ones(1, 4)}, None)  # cooldown
    assert len(ctrl.calls) == 1


def test_pool_drops_rows_whose_outcome_is_unknown_and_distrusts_taken_back_rows():
    unit, pool = MemoryUnit(), known_pool()
    pool.add(spare_rows(3))
    with pytest.raises(WaitTimeout):
        pool.put(FakeController(WaitTimeout("late")), [unit], ["a"],
                 {"x": torch.ones(1, 4)}, None)
    assert len(pool) == 2  # never reused: a late write could land in a live row
    assert not pool.put(FakeController(StateError("taken back")), [unit], ["a"],
                        {"x": torch.ones(1, 4)}, None)
    assert len(pool) == 0
    pool.add(spare_rows(2))
    assert not pool.put(FakeController(ClosedError("closed")), [unit], ["a"],
                        {"x": torch.ones(1, 4)}, None)  # reserve raises it properly
    assert len(pool) == 2


def test_pool_takes_only_small_puts_and_converts_to_known_schemas():
    unit, pool = MemoryUnit(), known_pool()
    pool.add(spare_rows(SparePool.MAX_ROWS + 1))
    many = [f"k{i}" for i in range(SparePool.MAX_ROWS + 1)]
    assert not pool.put(FakeController(), [unit], many, {"x": torch.ones(len(many), 4)}, None)
    pool.learn({"r": schema_of(Ragged.from_list([torch.ones(2)])).to_dict()})
    ctrl = FakeController({"ok": True})
    assert pool.put(ctrl, [unit], ["a"], {"r": torch.ones(1, 3)}, None)  # dense -> ragged
    assert ctrl.calls[0]["schemas"]["r"]["kind"] == "ragged"
    pool.learn({"d": schema_of(torch.ones(1, 2)).to_dict()})
    assert not pool.put(FakeController(), [unit], ["b"], {"d": torch.ones(1, 5)}, None)


def test_pool_is_thread_safe():
    pool = known_pool()
    pool.add(spare_rows(400))
    taken: list[int] = []

    def take():
        for _ in range(100):
            rows = pool._take(1)
            if rows is not None:
                taken.extend(rows["index"].tolist())

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(taken) == list(range(400))


# --------------------------------------------------------- small buffers inline


def test_small_tensors_travel_inside_the_header():
    value = {"t": torch.arange(6.0).view(2, 3), "b": torch.ones(3, dtype=torch.bfloat16),
             "a": np.arange(4, dtype=">i4"), "e": torch.zeros(0, 2), "s": torch.tensor(2),
             "r": Ragged.from_list([torch.ones(2), torch.ones(1)]), "big": torch.ones(64)}
    frames = encode(value, inline=64)
    assert len(frames) == 2  # only "big" (256 bytes) has a frame of its own
    out = decode(frames)
    for k in ("t", "b", "e", "s", "big"):
        assert out[k].dtype == value[k].dtype and torch.equal(out[k], value[k])
    assert out["a"].dtype == value["a"].dtype and (out["a"] == value["a"]).all()
    assert torch.equal(out["r"].values, value["r"].values)
    out["t"][0, 0] = 9  # private, writable memory
    out["a"][0] = 9
    assert value["t"][0, 0] == 0 and value["a"][0] == 0
    assert len(encode(value)) == 8  # the default: every buffer a frame (zero copy)


def test_malformed_small_buffers_are_serialization_errors():
    import msgspec

    def message(code, payload):
        ext = msgspec.msgpack.Ext(code, msgspec.msgpack.encode(payload))
        return [msgspec.msgpack.encode(["tqs", 1, 1, ext])]

    for payload in (["float32", [3], b"\0" * 4], ["nope", [1], b"\0"], ["float32", [-1], b""]):
        with pytest.raises(SerializationError):
            decode(message(5, payload))
    with pytest.raises(SerializationError):
        decode(message(6, ["<f4", [2], b"\0" * 3]))
