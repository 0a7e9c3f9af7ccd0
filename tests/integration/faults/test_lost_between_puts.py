"""A storage unit SIGKILLed between the two puts of a row (``x``, then ``r``), in local
mode (issue 20, item 7): the ``r`` put, retried until a live unit takes it, must not
make the lost rows again with ``r`` only. It writes the rows that still exist and
returns the lost ones; the closed partition ends and counts them lost."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

import tq_stream as tq
from tests.helpers.fault_kit import (
    CONFIG,
    UNIT_TIMEOUT,
    alive,
    check_no_leftovers,
    faulty_local,
    kill,
    wait_until,
)
from tests.helpers.fault_workers import values

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]
P = "p"


def _keys(prefix: str, n: int) -> list[str]:
    return [f"{prefix}_{i}" for i in range(n)]


def _register(stream: tq.Stream, dp_size: int) -> None:
    stream.client().register_task(P, "t", ["x", "r"], batch_size=4, dp_size=dp_size,
                                  lease_timeout=CONFIG.lease_timeout)


def _drain(stream: tq.Stream, dp_size: int = 1) -> list[list[str]]:
    """Keys each rank of task "t" gets until the closed partition ends (in threads)."""
    got: list[list[str]] = [[] for _ in range(dp_size)]
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            ds = tq.StreamingDataset(stream, P, "t", ["x", "r"], batch_size=4, dp_rank=r,
                                     dp_size=dp_size, timeout=15.0)
            for batch in tq.StreamingDataLoader(ds):
                got[r].extend(tq.batch_meta(batch).keys)
        except BaseException as exc:  # noqa: BLE001 — reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(dp_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60.0)
    assert not any(t.is_alive() for t in threads), "a consumer never ended"
    assert errors == [], errors
    return got


@pytest.mark.parametrize("restart_units", [False, True], ids=["lost", "restarted"])
def test_a_unit_killed_between_the_two_puts_of_rows_loses_them_once(restart_units):
    stream = faulty_local(restart_units=restart_units)
    old = list(stream.owner.pids)
    try:
        stream.create_partition(P, consumers=["t"])
        _register(stream, 1)
        w = stream.writer(P)
        keys = _keys("a", 32)
        for i in range(0, 32, 8):  # each put spreads over both units
            w.put(keys[i : i + 8], {"x": values(keys[i : i + 8])})
        unit_of = dict(zip(keys, stream.kv.meta(keys, partition=P).unit.tolist(),
                           strict=True))
        kill(old[1])  # the r puts go out at once: placed on the dead unit, put again
        skipped = []
        for i in range(0, 32, 8):
            skipped += w.put(keys[i : i + 8], {"r": torch.ones(8)})
        lost = {k for k, u in unit_of.items() if u == 1}
        assert set(skipped) == lost and lost
        stream.close_partition(P)
        got = _drain(stream)[0]
        assert sorted(got) == sorted(set(keys) - lost)
        stats = stream.stats()[P]
        assert stats["tasks"]["t"]["discarded"] == {"unit_lost": len(lost)}
        assert stats["rows_lost"] == len(lost) and stats["rows"] == 0
    finally:
        check_no_leftovers(stream, old)


def test_random_unit_kills_while_two_producers_write_rows_in_two_puts():
    """Random SIGKILLs of units (restarted) while 2 producers write each row in two
    puts and 2 ranks consume: both ranks end after the close, every row is delivered
    once or counted lost, and every skipped key is a lost row."""
    rng = random.Random(20)
    stream = faulty_local(restart_units=True)
    old = list(stream.owner.pids)
    pids = list(old)
    try:
        stream.create_partition(P, consumers=["t"])
        _register(stream, 2)
        written: list[str] = []
        skipped: list[str] = []
        stop = threading.Event()

        def produce(p: int) -> None:
            w = stream.writer(P)
            for b in range(40):
                keys = [f"p{p}b{b}_{i}" for i in range(8)]
                w.put(keys, {"x": values(keys)})
                time.sleep(rng.uniform(0.0, 0.05))  # the "reward" computed between
                skipped.extend(w.put(keys, {"r": torch.ones(8)}) or [])
                written.extend(keys)
            stop.set()

        producers = [threading.Thread(target=produce, args=(p,)) for p in range(2)]
        drained: list[list[str]] = []
        consumers = threading.Thread(target=lambda: drained.extend(_drain(stream, 2)))
        for t in producers:
            t.start()
        consumers.start()
        kills = 0
        while any(t.is_alive() for t in producers) and kills < 3:
            time.sleep(rng.uniform(0.3, 1.0))
            unit = rng.randrange(2)
            pid = stream.owner.pids[unit]
            if alive(pid):
                kill(pid)
                pids.append(pid)
                kills += 1
                assert wait_until(lambda u=unit, q=pid: stream.owner.pids[u] != q,
                                  20 * UNIT_TIMEOUT)
        for t in producers:
            t.join(90.0)
        assert not any(t.is_alive() for t in producers), "a producer never finished"
        stream.close_partition(P)
        consumers.join(90.0)
        assert not consumers.is_alive(), "a consumer never ended after the close"
        got = [k for keys in drained for k in keys]
        assert len(got) == len(set(got)), "a row was delivered twice"
        stats = stream.stats()[P]
        task = stats["tasks"]["t"]
        lost = task["discarded"].get("unit_lost", 0)
        assert set(skipped) <= set(written) - set(got)
        assert task["acked"] + lost == len(written)  # nothing lost but with a unit
        # A batch read, then lost with its unit before its ack, is delivered and
        # counted lost (not finished): neither of its rows is acked.
        assert task["acked"] <= len(got) <= task["acked"] + lost
        assert stats["rows"] == 0  # no half row left behind
    finally:
        pids += stream.owner.pids
        check_no_leftovers(stream, pids)


def _unit_pid(stream: tq.Stream, unit: int) -> int:
    return [p.pid for p in stream.processes() if p.role == "unit"][unit]


def _writer(stream: tq.Stream) -> tq.Writer:
    """Partition P, read by task "t" (one rank), and a writer of it."""
    stream.create_partition(P, consumers=["t"])
    _register(stream, 1)
    return stream.writer(P)


def test_a_put_made_again_counts_the_lost_rows_it_names_once():
    """A put of ``r`` names rows lost before (unit 1, restarted) and rows of unit 0,
    killed just before it: its first try skips the lost rows and fails on unit 0; the
    put again named them again, so ``lost_writes_skipped`` counted them twice."""
    stream = faulty_local()
    pids = [p.pid for p in stream.processes()]
    try:
        w = _writer(stream)
        keys = _keys("a", 16)
        for i in (0, 8):
            w.put(keys[i : i + 8], {"x": values(keys[i : i + 8])})
        stream.owner.restart_unit(1)  # its rows are lost, their keys remembered
        pids.append(_unit_pid(stream, 1))
        kill(pids[1])  # unit 0: its rows are lost while the put below runs
        assert sorted(w.put(keys, {"r": torch.ones(16)})) == sorted(keys)
        stats = stream.stats()[P]
        assert stats["rows_lost"] == 16 and stats["lost_writes_skipped"] == 16
        stream.owner.restart_unit(0)
    finally:
        check_no_leftovers(stream, pids)


def test_rows_placed_on_a_unit_that_dies_before_their_bytes_come_are_not_lost():
    """A put of new rows placed on a unit that dies before it took their bytes puts
    them again on the live unit: they were never lost (they were counted lost, and
    delivered: ``unit_lost`` said more rows were lost than were). Without shared memory
    (a same-host put writes a unit's segment directly, dead or not) and more rows than
    the writer's spare rows: the put calls the dead unit, which fails once the
    controller declared it lost, while the rows are still placed there."""
    stream = faulty_local(storage="memory")
    pids = [p.pid for p in stream.processes()]
    try:
        w = _writer(stream)
        first = _keys("a", 8)
        w.put(first, {"x": values(first)})
        lost = {k for k, u in zip(first, stream.kv.meta(first, partition=P).unit.tolist(),
                                  strict=True) if u == 1}
        kill(_unit_pid(stream, 1))
        keys = _keys("b", 24)  # placed on both units: unit 1 never takes its bytes
        assert w.put(keys, {"x": values(keys)}) == []
        assert set(stream.kv.meta(keys, partition=P).unit.tolist()) == {0}
        assert sorted(w.put(first + keys, {"r": torch.ones(32)})) == sorted(lost)
        stream.close_partition(P)
        assert sorted(_drain(stream)[0]) == sorted(set(first + keys) - lost)
        stats = stream.stats()[P]
        assert stats["rows_lost"] == len(lost)
        assert stats["tasks"]["t"]["discarded"] == {"unit_lost": len(lost)}
        stream.owner.restart_unit(1)
    finally:
        check_no_leftovers(stream, pids + [p.pid for p in stream.processes()])


def test_a_unit_that_dies_as_it_restarts_is_restarted_again(monkeypatch):
    """The random kills above may hit a unit while the owner restarts it: that restart
    failed ("exited during start"), and every later one too (its address was read from
    the failed process's start message, None), each closing the lifeline fd again (by
    then another socket of this process): the unit never came back."""
    from tq_stream.deploy import local

    real = local.await_ready
    dying: list[int] = []

    def dies_once(children, timeout):  # the first new process is killed as it starts
        if not dying:
            dying.extend(c.pid for c in children)
            kill(dying[0])
        return real(children, timeout)

    stream = faulty_local(restart_units=True)
    pids = list(stream.owner.pids)
    try:
        w = _writer(stream)
        monkeypatch.setattr(local, "await_ready", dies_once)
        kill(pids[1])
        assert wait_until(lambda: len(dying) == 1 and stream.owner.pids[1] not in
                          (pids[1], dying[0]) and alive(stream.owner.pids[1]), 30.0)
        ctrl = stream.connection.controller()
        assert wait_until(lambda: ctrl.dead_units() == [], 10 * UNIT_TIMEOUT)
        keys = _keys("a", 8)
        stream.writer(P, unit=1).put(keys, {"x": values(keys)})
        w.put(keys, {"r": torch.ones(8)})
        stream.close_partition(P)
        assert sorted(_drain(stream)[0]) == sorted(keys)
    finally:
        check_no_leftovers(stream, pids + dying + [stream.owner.pids[1]])
