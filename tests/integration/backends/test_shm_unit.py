"""ShmUnit: the backend contract, segment cleanup, and the generation (seqlock) check
that keeps same-host readers from ever trusting a slot that was reused."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

from tests.helpers.backend_contract import BackendContract
from tests.helpers.tq_fixtures import segments_of, start_local, unit, wait_until
from tq_stream.backends.segments import ShmReader
from tq_stream.backends.shm import SHM_DIR, ShmUnit, shm_available, sweep_stale
from tq_stream.columns import Ragged
from tq_stream.errors import KeyConflictError, StateError

__all__ = ["unit"]  # the fixture, imported for pytest

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(60),
    pytest.mark.skipif(not shm_available(), reason="needs a writable /dev/shm"),
]

ME = os.getpid()


def one(*s: int) -> np.ndarray:
    return np.asarray(s, dtype=np.int64)


class TestShmContract(BackendContract):
    pass


def test_segments_live_while_used_and_go_on_close(unit):
    before = set(segments_of([ME]))
    for lo in range(0, 400, 100):  # growth moves slabs to new segments
        s = np.arange(lo, lo + 100, dtype=np.int64)
        unit.put("p", s, {"x": torch.ones(100, 8),
                          "r": Ragged.from_list([torch.ones(3)] * 100)})
    live = set(segments_of([ME])) - before
    # one segment per dense slab and its written flags, ragged arena, token array and
    # live flags of the partition; grown-out ones are gone
    assert len(live) == 5, live
    unit.free("p", np.arange(400, dtype=np.int64))  # every row freed: memory returned
    assert set(segments_of([ME])) - before == set()
    unit.put("q", one(0), {"x": torch.ones(1, 2)})
    unit.close()
    assert set(segments_of([ME])) - before == set()


def test_a_store_made_again_from_a_kept_flags_segment_grows_with_its_slab():
    """A slab too large to keep comes back small while its written flags (small enough
    to keep) come back at their old size: the two must still grow as one."""
    unit = ShmUnit(keep_bytes=4096)
    try:
        unit.put("p", np.arange(100, dtype=np.int64), {"x": torch.ones(100, 64)})
        unit.free("p", np.arange(100, dtype=np.int64))  # emptied: the flags are kept
        slots = np.arange(40, dtype=np.int64)
        unit.put("p", slots, {"x": torch.arange(40.0).repeat_interleave(64).view(40, 64)})
        got = unit.get("p", slots, ["x"])["x"]
        assert torch.equal(got[:, 0], torch.arange(40.0))
        store = unit.stores["p"].fields["x"]
        assert store.flags.shape[0] == store.data.shape[0]
        with pytest.raises(KeyConflictError):
            unit.get("p", one(41), ["x"])  # the kept flags were cleared: never written
    finally:
        unit.close()


def test_sweep_removes_segments_of_a_killed_owner():
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: make segments, report them, die without cleanup
        try:
            os.close(read)
            u = ShmUnit()
            u.put("p", one(0, 1), {"x": torch.ones(2, 4)})
            os.write(write, json.dumps(segments_of([os.getpid()])).encode())
            os.close(write)
        finally:
            os.kill(os.getpid(), signal.SIGKILL)
    os.close(write)
    with os.fdopen(read) as f:
        names = json.loads(f.read())
    assert os.waitpid(pid, 0)[1] & 0x7F == signal.SIGKILL
    assert names and all(os.path.exists(os.path.join(SHM_DIR, n)) for n in names)
    assert sweep_stale() >= len(names)
    assert segments_of([pid]) == []


def test_deployment_close_removes_segments_of_a_killed_unit():
    stream = start_local(storage_units=1)
    try:
        unit_pid = stream.processes()[1].pid  # unit 0
        stream.writer("p").put(["a", "b"], {"x": torch.ones(2, 4)})
        assert segments_of([unit_pid])
        os.kill(unit_pid, signal.SIGKILL)
        assert wait_until(lambda: stream.owner._children[0].proc.poll() is not None, 10)
        assert segments_of([unit_pid]), "a SIGKILLed unit cannot clean up by itself"
    finally:
        stream.close()
    assert segments_of([unit_pid]) == []


# ------------------------------------------------------------- generation check


def test_reader_detects_a_reused_slot(unit):
    unit.put("p", one(0, 1), {"x": torch.tensor([[1.0], [2.0]])}, generations=one(10, 11))
    layout = unit.layout("p", ["x"])
    unit.free("p", one(0))
    unit.put("p", one(0), {"x": torch.tensor([[9.0]])}, generations=one(20))
    reader = ShmReader()
    lay = layout["fields"]["x"]
    view = reader.view(lay["shm"], torch.float32, tuple(lay["shape"]))
    assert view[0].item() == 9.0  # the bytes a careless reader would return
    assert not reader.current(layout["generations"], one(0), one(10))
    assert reader.current(layout["generations"], one(0, 1), one(20, 11))
    with pytest.raises(StateError, match="cleared"):
        unit.get("p", one(0), ["x"], generations=one(10))
    assert unit.get("p", one(0, 1), ["x"], generations=one(20, 11))["x"].flatten().tolist() \
        == [9.0, 2.0]


def test_freed_grown_and_dropped_token_arrays_are_never_trusted(unit):
    reader = ShmReader()
    unit.put("p", one(0), {"x": torch.ones(1, 1)}, generations=one(5))
    old = unit.layout("p", ["x"])["generations"]
    assert reader.current(old, one(0), one(5))
    unit.put("p", one(100), {"x": torch.ones(1, 1)}, generations=one(6))  # tokens grow
    assert not reader.current(old, one(0), one(5)), "a moved token array must be retired"
    new = unit.layout("p", ["x"])["generations"]
    assert reader.current(new, one(0), one(5))
    unit.free("p", one(0))
    assert not reader.current(new, one(0), one(5))
    unit.drop("p")
    assert not reader.current(new, one(100), one(6))
    with pytest.raises(StateError):
        unit.get("p", one(100), ["x"], generations=one(6))


def test_put_without_generations_is_unreadable_with_one(unit):
    unit.put("p", one(0), {"x": torch.ones(1, 1)})
    assert unit.get("p", one(0), ["x"])["x"].item() == 1.0
    with pytest.raises(StateError):
        unit.get("p", one(0), ["x"], generations=one(0))


@pytest.mark.timeout(30)
def test_concurrent_reader_never_accepts_a_torn_or_reused_row(unit):
    """Seqlock: a writer rewrites slot 0 under new tokens; a reader that peeks the token,
    copies the row straight from shared memory and then finds the token unchanged must
    have copied exactly that token's values."""
    width, stop = 1 << 15, threading.Event()
    # slot 1 is never freed, so the partition (and its slabs) stay: slot 0 is rewritten
    unit.put("p", one(0, 1), {"x": torch.zeros(2, width, dtype=torch.float64)},
             generations=one(1, 0))

    def write() -> None:
        g = 1
        while not stop.is_set():
            g += 1
            unit.free("p", one(0))
            unit.put("p", one(0), {"x": torch.full((1, width), float(g), dtype=torch.float64)},
                     generations=one(g))
            time.sleep(0.0005)  # leave the reader windows with a stable slot, too

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    reader, accepted, rejected, torn = ShmReader(), 0, 0, 0
    deadline = time.monotonic() + 2.0
    try:
        while time.monotonic() < deadline and accepted < 300:
            layout = unit.layout("p", ["x"])
            lay = layout["fields"].get("x")
            if lay is None:
                continue
            tokens = reader.view(layout["generations"]["shm"], torch.int64,
                                 tuple(layout["generations"]["shape"]))
            expect = int(tokens[0])
            if expect < 0:
                rejected += 1
                continue
            row = reader.view(lay["shm"], torch.float64, tuple(lay["shape"]))[0].clone()
            ok = bool((row == float(expect)).all())
            if reader.current(layout["generations"], one(0), one(expect)):
                accepted += 1
                assert ok, f"accepted a row that does not hold token {expect}"
            else:
                rejected += 1
                torn += not ok
    finally:
        stop.set()
        writer.join(5)
    assert accepted > 0, (accepted, rejected, torn)


def test_an_emptied_partition_keeps_its_stores_within_the_budget():
    """Stores of a partition whose rows were all freed stay for its next rows (a
    same-host writer's layout stays valid) while they fit in keep_bytes; the oldest
    such partition goes when another needs the room, and a drop keeps nothing."""
    before = set(segments_of([ME]))
    u = ShmUnit(keep_bytes=48 << 10)  # slabs hold 16 rows at least: "a" takes 4 KiB
    try:
        u.put("a", one(0), {"x": torch.ones(1, 64)}, one(1))
        stores = int(u._epoch[1])
        segs_a = set(segments_of([ME])) - before
        u.free("a", one(0))
        assert "a" in u.stores and set(segments_of([ME])) - before == segs_a
        assert int(u._epoch[1]) == stores  # writers' layouts of "a" stay writable
        assert u.nbytes() == 0 and u.stats()["partitions"] == {}
        with pytest.raises(StateError):  # its freed slot holds nothing
            u.get("a", one(0), ["x"], one(1))
        u.put("a", one(0), {"x": torch.full((1, 64), 2.0)}, one(2))
        assert u.get("a", one(0), ["x"], one(2))["x"].eq(2).all()
        assert u.nbytes() > 0 and "a" not in u._warm
        u.free("a", one(0))
        # A larger partition (44 KiB) empties: both do not fit, the older one goes.
        u.put("b", one(0), {"y": torch.ones(1, 700)}, one(3))
        u.free("b", one(0))
        assert "b" in u.stores and "a" not in u.stores
        assert not set(segments_of([ME])) & segs_a or u._idle  # a's slabs: kept or gone
        u.drop("b")
        assert "b" not in u.stores and not u._warm
        # A partition too large for the budget never stays.
        u.put("c", one(0), {"z": torch.ones(1, 40000)}, one(4))
        u.free("c", one(0))
        assert "c" not in u.stores
    finally:
        u.close()
    assert set(segments_of([ME])) <= before


def test_a_store_made_from_a_kept_segment_stays_within_the_budget():
    """A kept segment is handed whole to the store made again from it, which asked for
    16 rows: it must fit the partition's budget like any allocation (else a fresh one)."""
    budget, kib = 1 << 20, 1 << 10
    u = ShmUnit(keep_bytes=600 * kib)
    try:
        u.set_memory("p", memory_budget=budget)
        wide = 5 * kib  # float32: 20 KiB a row, 16 rows 320 KiB
        u.put("p", one(0), {"a": torch.ones(1, wide),
                            "r": Ragged.from_list([torch.ones(512 * kib, dtype=torch.uint8)])})
        u.free("p", one(0))  # 832 KiB do not stay: "r"'s 512 KiB segment is kept
        assert "p" not in u.stores and u._idle_bytes >= 512 * kib
        slots = np.arange(32, dtype=np.int64)  # "a" grows to 640 KiB, within the budget
        u.put("p", slots, {"a": torch.ones(32, wide),
                           "r": Ragged.from_list([torch.ones(1, dtype=torch.uint8)] * 32)})
        assert u.nbytes() <= budget, u.stats()["partitions"]["p"]["fields"]
        assert u.get("p", slots, ["r"])["r"].values.sum() == 32
    finally:
        u.close()
