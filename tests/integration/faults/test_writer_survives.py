"""A writer goes on through a storage unit's death: a put placed on the dead unit (its
calls are never sent) or on the process that replaced it (it refuses the slots) is
made again until the controller places it elsewhere or grants the new process. Found
by a new user: the first put after a unit was killed failed (after 60 s without a
restart: "no server at .../unit1"; at once with restart_units: "slots must be ones the
controller placed")."""

from __future__ import annotations

import time

import pytest
import torch

from tests.helpers.fault_kit import check_no_leftovers, faulty_local, kill

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.mark.parametrize("restart_units", [False, True], ids=["lost", "restarted"])
def test_every_put_after_a_unit_dies_succeeds(restart_units):
    stream = faulty_local(restart_units=restart_units)
    old = list(stream.owner.pids)
    try:
        stream.create_partition("p", consumers=["t"])
        w = stream.writer("p")
        w.put([f"a{i}" for i in range(64)], {"x": torch.zeros(64, 3)})  # on both units
        kill(old[1])
        after = []
        for k in range(6):  # placed by reserve, some on the dead unit at first
            keys = [f"b{k}_{i}" for i in range(10)]
            w.put(keys, {"x": torch.full((10, 3), float(k))})
            after += keys
        meta = stream.kv.meta(after, partition="p")
        assert list(meta.keys) == after  # every row put after the kill is there
        got = stream.kv.get_batch(after, partition="p")["x"][:, 0]
        assert got.tolist() == [float(k) for k in range(6) for _ in range(10)]
    finally:
        check_no_leftovers(stream, old)


def test_a_put_to_a_new_partition_after_a_unit_died_does_not_wait_for_it():
    """A new partition's first put needs a grant from every unit it is placed on. With
    a dead unit the controller does not declare lost yet (unit_timeout 30 s), that
    grant failed at once (a broken connection: the put failed, its rows left reserved)
    or waited the whole call timeout (a refused one: 20 s, then failed); now it is
    undone and the rows go to the unit that answers."""
    stream = faulty_local(unit_timeout=30.0)
    pids = [p.pid for p in stream.processes()]
    try:
        stream.writer("a").put(["a0", "a1"], {"x": torch.zeros(2, 3)})  # on both units
        kill(pids[2])  # unit 1
        for name in ("b", "c"):
            started = time.monotonic()
            assert stream.writer(name).put(["k0", "k1", "k2"], {"x": torch.ones(3, 3)}) == []
            assert time.monotonic() - started < 6.0
            assert stream.kv.meta(["k0", "k1", "k2"], partition=name).unit.tolist() == [0] * 3
            assert [r["fields"] for r in stream.kv.list(partition=name)] == [["x"]] * 3
    finally:
        check_no_leftovers(stream, pids)
