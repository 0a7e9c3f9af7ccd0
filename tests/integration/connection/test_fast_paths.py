"""The small-operation fast paths over real sockets and processes: handlers run inline on
the server's IO thread, puts in two calls on spare rows, gets from cached layouts, and
shared-memory segments kept for a partition that empties and fills again."""

from __future__ import annotations

import collections
import os
import threading
import time

import numpy as np
import pytest
import torch

from tests.helpers.tq_fixtures import local_stream, segments_of, start_local  # noqa: F401 - fixture
from tq_stream.backends.base import occupancy
from tq_stream.backends.shm import ShmUnit, shm_available
from tq_stream.connection import shm_layout, spares
from tq_stream.connection.same_host import SameHostUnit
from tq_stream.errors import KeyConflictError, RemoteError, SchemaError, StateError
from tq_stream.handling import WouldBlock, may_block
from tq_stream.transport import unix_client, zmq_client
from tq_stream.transport.handler import Methods
from tq_stream.transport.zeromq import BUSY, RpcClient, RpcServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

ME = os.getpid()


class Handler:
    RPC_TABLE = Methods({"where", "fail", "crash", "block", "ready_or_wait"},
                        inline={"where", "fail", "crash", "ready_or_wait"})

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.ready = threading.Event()

    def where(self):
        return threading.current_thread().name

    def fail(self):
        raise KeyConflictError("key 'k' exists")

    def crash(self):
        return 1 / 0

    def block(self, timeout):
        self.entered.set()
        return self.release.wait(timeout)

    def ready_or_wait(self, timeout):
        if not self.ready.is_set() and not may_block():
            raise WouldBlock
        self.entered.set()
        return self.ready.wait(timeout), threading.current_thread().name


@pytest.fixture
def handler():
    h = Handler()
    yield h
    h.release.set()
    h.ready.set()


def test_inline_methods_run_on_the_io_thread_and_answer_errors_as_values(handler):
    with RpcServer(handler) as srv, RpcClient(srv.address, timeout=5) as c:
        assert c.call("where").endswith(" io")
        with pytest.raises(KeyConflictError, match="key 'k' exists"):
            c.call("fail")
        with pytest.raises(RemoteError) as info:
            c.call("crash")
        assert info.value.kind == "ZeroDivisionError" and info.value.where == srv.address
        assert c.call("where").endswith(" io")  # the IO thread survived both


def test_a_blocked_worker_and_a_full_backlog_do_not_delay_inline_methods(handler):
    with RpcServer(handler, workers=1, backlog=1) as srv, \
            RpcClient(srv.address, timeout=5) as c:
        results = []
        callers = [threading.Thread(target=lambda: results.append(c.call("block", {"timeout": 5})))
                   for _ in range(2)]
        callers[0].start()
        assert handler.entered.wait(5)
        callers[1].start()
        deadline = time.monotonic() + 5
        while srv.pending < 1:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        t0 = time.monotonic()
        assert c.call("where").endswith(" io")  # never queued behind the workers
        assert time.monotonic() - t0 < 1.0
        with pytest.raises(RemoteError) as info:  # a worker method is refused, as before
            c.call("block", {"timeout": 1})
        assert info.value.kind == BUSY
        handler.release.set()
        for t in callers:
            t.join(5)
        assert results == [True, True]


def test_an_inline_method_that_would_block_waits_on_a_worker(handler):
    with RpcServer(handler) as srv, RpcClient(srv.address, timeout=5) as c:
        out = []
        waiter = threading.Thread(
            target=lambda: out.append(c.call("ready_or_wait", {"timeout": 5})))
        waiter.start()
        assert handler.entered.wait(5)
        t0 = time.monotonic()
        assert c.call("where").endswith(" io")  # the IO thread is free meanwhile
        assert time.monotonic() - t0 < 1.0
        handler.ready.set()
        waiter.join(5)
        ok, thread = out[0]
        assert ok and "worker" in thread
        assert c.call("ready_or_wait", {"timeout": 5})[1].endswith(" io")  # ready: inline


# ------------------------------------------------------------------ local mode


@pytest.fixture
def calls():
    """Counts the RPCs the test's own thread makes, by method, while the test runs.

    Background threads (the lease keeper's renewals) are not the put or get path.
    """
    counter: collections.Counter[str] = collections.Counter()
    test_thread = threading.current_thread()
    classes = (zmq_client.RpcClient, unix_client.UnixRpcClient)
    originals = [cls.call for cls in classes]

    def counting(original):
        def call(self, method, args=None, timeout=None):
            if threading.current_thread() is test_thread:
                counter[method] += 1
            return original(self, method, args, timeout)
        return call

    for cls, original in zip(classes, originals, strict=True):
        cls.call = counting(original)
    try:
        yield counter
    finally:
        for cls, original in zip(classes, originals, strict=True):
            cls.call = original


def test_small_puts_take_one_call_and_gets_one(local_stream, calls):  # noqa: F811
    w = local_stream.writer("one-call")
    for i in range(40):  # both units get the field's slab
        w.put([f"warm{i}"], {"x": torch.ones(1, 4)})
    local_stream.kv.get("warm0", partition="one-call")
    calls.clear()
    for i in range(10):
        w.put([f"k{i}"], {"x": torch.full((1, 4), float(i))}, tags=[{"i": i}])
    # The bytes go straight into the units' shared memory; at most one put goes to a
    # unit (a slab that must grow for the next spare rows) and asks for its new layout.
    assert calls["commit_new"] == 10 and calls["put"] + calls["layout"] <= 2
    assert set(calls) <= {"commit_new", "put", "layout"}
    calls.clear()
    for i in range(10):
        assert local_stream.kv.get(f"k{i}", partition="one-call")["x"].eq(i).all()
    assert calls["lookup"] == 10 and calls["layout"] <= 2  # the first read of each unit
    calls.clear()
    for i in range(10):
        assert local_stream.kv.get(f"k{i}", partition="one-call")["x"].eq(i).all()
    assert calls == {"lookup": 10}  # dense fields come out of shared memory, no layout call
    rows = {r["key"]: r["tags"] for r in local_stream.kv.list(partition="one-call")}
    assert rows["k3"] == {"i": 3}
    # The units themselves know those rows: a read through a unit's socket sees them.
    meta = local_stream.kv.meta([f"k{i}" for i in range(10)], partition="one-call")
    for u in np.unique(meta.unit).tolist():
        rows_u = meta.unit == u
        got = local_stream.connection.units()[u].remote.get(
            "one-call", meta.slot[rows_u], ["x"], occupancy(meta.index, meta.generation)[rows_u])
        want = torch.tensor([float(k[1:]) for k in np.asarray(meta.keys)[rows_u]])
        assert torch.equal(got["x"][:, 0], want)


def test_a_shared_write_that_races_a_slab_move_is_written_again_by_the_unit(
        local_stream, calls, monkeypatch):  # noqa: F811
    w = local_stream.writer("race")
    for i in range(40):
        w.put([f"warm{i}"], {"x": torch.zeros(1, 4)})
    moved = []

    def move_then_fence():
        # The unit moves a slab / drops stores after this process stored the rows and
        # before its final check of the epochs (one-row and many-row writes alike).
        for unit in local_stream.connection.units():
            for layout in unit._writes.values():
                layout.epoch_view[1] += 1
                moved.append(1)
        real_fence()

    real_fence = shm_layout.fence
    monkeypatch.setattr(shm_layout, "fence", move_then_fence)
    calls.clear()
    for i in range(6):
        w.put([f"k{i}"], {"x": torch.full((1, 4), float(i))})
    w.put(["k6", "k7"], {"x": torch.full((2, 4), 6.0)})
    monkeypatch.undo()
    assert moved and calls["put"] == 7  # every write was found racing, and redone
    for i in range(6):
        assert local_stream.kv.get(f"k{i}", partition="race")["x"].eq(i).all()
    assert local_stream.kv.get_batch(["k6", "k7"], partition="race")["x"].eq(6).all()


def test_a_one_row_put_the_shared_write_cannot_take_goes_to_the_unit(local_stream, calls):  # noqa: F811
    """A row that is not one contiguous block (a strided view), or whose shape differs from
    the field's slab, is written by the unit, never copied wrongly here."""
    w = local_stream.writer("odd")
    for i in range(40):
        w.put([f"warm{i}"], {"x": torch.zeros(1, 4)})
    calls.clear()
    strided = torch.arange(8.0).reshape(1, 8)[:, ::2]  # values 0, 2, 4, 6
    w.put(["strided"], {"x": strided})
    assert calls["put"] == 1
    assert local_stream.kv.get("strided", partition="odd")["x"].tolist() == [0.0, 2.0, 4.0, 6.0]
    with pytest.raises(SchemaError):
        w.put(["wide"], {"x": torch.zeros(1, 5)})
    assert local_stream.kv.get("warm3", partition="odd")["x"].eq(0).all()


def test_a_one_row_put_of_a_lazy_conjugate_or_negation_stores_its_values(local_stream):  # noqa: F811
    """A ``conj()`` (or negated) view's memory holds the values before the conjugation:
    the raw one-row copy must not take it (it stored 1+2j for a put of 1-2j)."""
    w = local_stream.writer("lazy")
    for i in range(40):  # the fields' writable layouts are cached by now
        w.put([f"warm{i}"], {"c": torch.zeros(1, 2, dtype=torch.complex64),
                             "f": torch.zeros(1, 2)})
    v = torch.tensor([[1 + 2j, 3 + 4j]], dtype=torch.complex64)
    f = torch.tensor([[1.5, -2.5]])
    w.put(["lazy"], {"c": v.conj(), "f": torch._neg_view(f)})
    got = local_stream.kv.get("lazy", partition="lazy")
    assert got["c"].tolist() == [1 - 2j, 3 - 4j] and got["f"].tolist() == [-1.5, 2.5]


def test_the_one_row_writer_refuses_what_it_cannot_copy_raw(local_stream):  # noqa: F811
    w = local_stream.writer("refuse")
    for i in range(40):
        w.put([f"warm{i}"], {"x": torch.zeros(1, 4)})
    layout = next(lay for unit in local_stream.connection.units()
                  for key, lay in unit._writes.items() if key[0] == "refuse")
    tokens = bytes(layout.tokens.tobytes())
    row = {"x": torch.ones(1, 4)}
    assert not layout.rows.write(-1, row, 7)  # a slot before the segment
    assert not layout.rows.write(len(layout.tokens), row, 7)  # past its end
    assert not layout.rows.write(0, {"x": torch.empty(1, 4, device="meta")}, 7)  # no memory
    assert not layout.rows.write(0, {"x": torch.ones(1, 4, dtype=torch.float64)}, 7)
    assert not layout.rows.write(0, {"x": torch.ones(1, 5)}, 7)
    assert not layout.rows.write(0, {"x": [1.0, 2.0]}, 7)
    assert bytes(layout.tokens.tobytes()) == tokens  # nothing was written


def test_shared_writes_into_a_partition_that_emptied_and_filled_again(local_stream, calls):  # noqa: F811
    """A consumer that keeps up empties the partition after every step: the units keep
    its stores (warm), so the next rows are written here with no call to a unit."""
    local_stream.create_partition("refill", consumers=["t"])
    w = local_stream.writer("refill")
    c = local_stream.client()
    c.register_task("refill", "t", ["x"], batch_size=4)
    unit_calls = []
    for step in range(6):
        before = calls["put"] + calls["layout"]
        keys = [f"s{step}_{i}" for i in range(4)]
        for i, k in enumerate(keys):
            w.put([k], {"x": torch.full((1, 3), float(10 * step + i))})
        unit_calls.append(calls["put"] + calls["layout"] - before)
        meta = c.get_meta("refill", "t", step, timeout=10)
        assert sorted(meta.keys) == keys
        data = c.get_data(meta)
        want = {k: 10 * step + i for i, k in enumerate(keys)}
        assert [float(v) for v in data["x"][:, 0]] == [want[k] for k in meta.keys]
        c.ack(meta)  # every row consumed: the partition is empty again
        assert local_stream.stats()["refill"]["rows"] == 0
    # The first steps make the stores (a put through the unit, a layout); once both
    # units hold the field's stores, emptying the partition keeps them.
    assert unit_calls[-3:] == [0, 0, 0], unit_calls
    assert calls["commit_new"] + calls["commit"] == 24  # the first put goes through reserve


def test_puts_a_spare_row_cannot_take_fall_back_and_leave_nothing():
    stream = start_local(storage_units=1)
    try:
        p = "fallback"
        w = stream.writer(p)
        for i in range(3):
            w.put([f"k{i}"], {"x": torch.ones(1, 4)})
        w.put(["k1"], {"y": torch.zeros(1, 2)})  # an upsert: the key exists
        assert stream.kv.get("k1", partition=p, fields=["y"])["y"].eq(0).all()
        with pytest.raises(SchemaError):
            w.put(["bad"], {"x": torch.ones(1, 5)})
        assert [r["key"] for r in stream.kv.list(partition=p)] == ["k0", "k1", "k2"]
        c = stream.client()
        c.register_task(p, "t", ["x"], 3)
        meta = c.get_meta(p, "t", 0, timeout=10)
        c.put_data(meta, {"z": torch.ones(3)})  # through a meta: reserve with expect
        assert stream.kv.get("k2", partition=p, fields=["z"])["z"].item() == 1.0
        stream.kv.clear(partition=p)
        # rejected puts freed what they stored in spare slots: the unit holds nothing
        assert [u.nbytes() for u in stream.connection.units()] == [0]
    finally:
        stream.close()


def test_reads_follow_slab_growth_and_upserts(local_stream):  # noqa: F811
    p = "growth"
    w = local_stream.writer(p)
    w.put(["a"], {"x": torch.zeros(1, 8)})
    assert local_stream.kv.get("a", partition=p)["x"].eq(0).all()  # layout now cached
    keys = [f"k{i}" for i in range(300)]
    w.put(keys, {"x": torch.ones(300, 8)})  # slabs grow: new segments, a new epoch
    w.put(["a"], {"x": torch.full((1, 8), 5.0)})  # written to the grown slab
    assert local_stream.kv.get("a", partition=p)["x"].eq(5).all()
    assert local_stream.kv.get_batch(keys[-3:], partition=p)["x"].eq(1).all()


def test_a_forked_writer_has_its_own_spare_rows(local_stream):  # noqa: F811
    p = "forked"
    w = local_stream.writer(p)
    w.put(["parent0"], {"x": torch.zeros(1, 2)})
    pid = os.fork()
    if pid == 0:  # the child writes with spare rows of its own, never the parent's
        code = 1
        try:
            child = local_stream.writer(p)
            for i in range(5):
                child.put([f"child{i}"], {"x": torch.full((1, 2), 7.0)})
            code = 0
        finally:
            os._exit(code)
    for i in range(5):
        w.put([f"parent{i + 1}"], {"x": torch.full((1, 2), 3.0)})
    assert os.waitpid(pid, 0)[1] == 0
    got = local_stream.kv.get_batch([*(f"child{i}" for i in range(5)),
                                     *(f"parent{i + 1}" for i in range(5))], partition=p)
    assert got["x"][:5].eq(7).all() and got["x"][5:].eq(3).all()


def test_closing_returns_spare_rows(local_stream):  # noqa: F811
    backend = local_stream.connection.backend
    local_stream.writer("returned").put(["a"], {"x": torch.ones(1, 2)})
    pools = [pool for (part, _), pool in backend._spares.items() if part == "returned"]
    rows = spares._joined(list(pools[0]._rows))  # a copy of the pool's rows
    assert len(rows["index"])
    backend.release_spares()
    assert all(len(pool) == 0 for pool in pools)
    ctrl = backend.controller()
    assert ctrl.release_spares("returned", rows["index"], rows["generation"]) == 0  # gone


# ------------------------------------------------------------- kept segments


@pytest.mark.skipif(not shm_available(), reason="needs a writable /dev/shm")
def test_kept_segments_serve_a_partition_that_empties_and_fills_again():
    before = set(segments_of([ME]))
    unit = ShmUnit(keep_bytes=1 << 20)

    class Local:  # SameHostUnit over an in-process unit, as a reader in another process
        def layout(self, partition, fields, writable=False):
            return unit.layout(partition, fields, writable)

        def get(self, partition, slots, fields, generations=None):
            return unit.get(partition, slots, fields, generations)

        def spans(self, partition, slots, fields, generations=None):
            return unit.spans(partition, slots, fields, generations)

    reader = SameHostUnit(Local())
    try:
        def put(slot, token, value):
            unit.put("p", np.array([slot]), {"x": torch.full((1, 4), value)},
                     np.array([token]))

        def read(slot, token):
            return reader.get("p", np.array([slot]), ["x"], np.array([token]))["x"]

        put(0, 1, 1.0)
        assert read(0, 1).eq(1).all()
        segments = set(segments_of([ME])) - before
        epoch = int(unit._epoch[0])
        unit.free("p", np.array([0]))  # the partition is empty: its segments are kept
        assert set(segments_of([ME])) - before == segments
        assert unit.nbytes() == 0
        with pytest.raises(StateError):  # the kept token array says: nothing there
            read(0, 1)
        put(0, 2, 2.0)  # the same segments again, no new epoch: cached layouts stay right
        assert set(segments_of([ME])) - before == segments
        assert int(unit._epoch[0]) == epoch
        assert read(0, 2).eq(2).all()
        put(100, 3, 3.0)  # growth: new segments and a new epoch
        assert int(unit._epoch[0]) > epoch
        assert read(100, 3).eq(3).all() and read(0, 2).eq(2).all()
        unit.drop("p")  # a dropped partition keeps nothing
        assert len(set(segments_of([ME])) - before) == 1  # the epoch segment
    finally:
        unit.close()
    assert set(segments_of([ME])) <= before


@pytest.mark.skipif(not shm_available(), reason="needs a writable /dev/shm")
def test_kept_segments_are_bounded_and_never_reused_by_another_field():
    before = set(segments_of([ME]))
    unit = ShmUnit(keep_bytes=4096)
    try:
        # 2 x 3.75 KiB slabs: too large to keep the emptied partition's stores (warm),
        # so single segments are kept
        unit.put("p", np.array([0]), {"a": torch.ones(1, 60), "b": torch.ones(1, 60)},
                 np.array([1]))
        unit.free("p", np.array([0]))
        assert "p" not in unit.stores
        kept = dict(unit._idle)
        assert kept and sum(s.nbytes for s in kept.values()) <= 4096
        unit.put("p", np.array([0]), {"b": torch.ones(1, 60)}, np.array([2]))
        b = unit._segments[unit.stores["p"].fields["b"].data.data_ptr()]
        assert all(b is not seg for key, seg in kept.items() if key != ("p", "b"))
        assert unit.get("p", np.array([0]), ["b"], np.array([2]))["b"].eq(1).all()
    finally:
        unit.close()
    assert set(segments_of([ME])) <= before
