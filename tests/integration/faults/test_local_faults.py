"""SIGKILL during streaming, in local mode: a storage unit, a consumer, a DataLoader
worker, a producer and the controller. Each test checks the documented rule (a unit's
rows die with it, nothing else is lost), that no acked row is delivered twice, that
the stream recovers in bounded time or fails with a clear error, and that nothing is
left behind."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

import tq_stream as tq
from tests.helpers.fault_kit import (
    CONFIG,
    UNIT_TIMEOUT,
    Ledger,
    alive,
    check_no_leftovers,
    faulty_local,
    kill,
    wait_gone,
    wait_until,
)
from tests.helpers.fault_workers import produce_forever, put_and_hang, train, values
from tq_stream.errors import KeyConflictError, StateError, WaitTimeout

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
P = "p"


def _keys(prefix: str, start: int, n: int) -> list[str]:
    return [f"{prefix}_{i}" for i in range(start, start + n)]


def _put_in_eights(ledger: Ledger, keys: list[str]) -> None:
    for i in range(0, len(keys), 8):  # each put spreads over both units
        ledger.put(keys[i : i + 8], {"x": values(keys[i : i + 8])})


@contextlib.contextmanager
def _filled(n: int, close: bool = True, **options):
    """A fault-ready local deployment with ``n`` rows ``a_*`` for task "t" (declared
    consumer); closed at the end, checked to leave nothing behind."""
    stream = faulty_local(**options)
    old = list(stream.owner.pids)
    try:
        stream.create_partition(P, consumers=["t"])
        ledger = Ledger(stream, P)
        _put_in_eights(ledger, _keys("a", 0, n))
        if close:
            stream.close_partition(P)
        yield stream, ledger, old
    finally:
        check_no_leftovers(stream, old)


def _await_checkpoint(stream: tq.Stream) -> None:
    """Wait until the controller wrote a checkpoint after this call."""
    path = stream.owner.checkpoint_path
    mark = os.stat(path).st_mtime_ns if os.path.exists(path) else 0
    assert wait_until(lambda: os.path.exists(path) and os.stat(path).st_mtime_ns != mark,
                      10.0), "no checkpoint written"


def _checked(batches):
    for batch in batches:
        keys = list(tq.batch_meta(batch).keys)
        assert torch.equal(batch["x"], values(keys)), "a row came back with wrong bytes"
        yield batch


# ------------------------------------------------------------------- a unit dies


@pytest.mark.parametrize("workers", [0, 2])
def test_a_killed_unit_is_lost_and_the_stream_goes_on(workers):
    """The controller notices the dead unit by itself (missed heartbeats), drops its
    rows (counted unit_lost), places new rows on the survivor only, and the loader —
    also with DataLoader workers — reaches the end of the stream."""
    stream = faulty_local()
    old = list(stream.owner.pids)
    try:
        stream.create_partition(P, consumers=["t"])
        ledger = Ledger(stream, P)
        _put_in_eights(ledger, _keys("a", 0, 48))
        ds = tq.StreamingDataset(stream, P, "t", ["x"], batch_size=4)
        batches = ledger.take(_checked(tq.StreamingDataLoader(
            ds, num_workers=workers, multiprocessing_context="fork" if workers else None)))
        for _ in range(3):
            next(batches)
        kill(old[1])
        ctrl = stream.connection.controller()
        assert wait_until(lambda: ctrl.dead_units() == [1], 10 * UNIT_TIMEOUT)
        after = _keys("b", 0, 16)
        _put_in_eights(ledger, after)
        assert {ledger.unit_of[k] for k in after} == {0}  # nothing placed on the dead unit
        stream.close_partition(P)
        for _ in batches:
            pass
        missing = ledger.check("t", dead_unit=1)
        assert missing and ledger.lost("t") > 0  # the unit held rows when it died
        assert not missing & set(after)
    finally:
        check_no_leftovers(stream, old)


def test_a_restarted_unit_takes_rows_again():
    """restart_units=True: the owner restarts a dead unit (empty); its rows were lost,
    rows may be placed there again, and every other row is delivered."""
    stream = faulty_local(restart_units=True)
    old = list(stream.owner.pids)
    try:
        stream.create_partition(P, consumers=["t"])
        stream.client().register_task(P, "t", ["x"], batch_size=4,
                                      lease_timeout=CONFIG.lease_timeout)
        ledger = Ledger(stream, P)
        before = _keys("a", 0, 16)
        _put_in_eights(ledger, before)
        kill(old[1])
        assert wait_until(lambda: stream.owner.pids[1] != old[1], 20.0)
        ctrl = stream.connection.controller()
        assert wait_until(lambda: ctrl.dead_units() == [], 10 * UNIT_TIMEOUT)
        after = _keys("b", 0, 8)
        stream.writer(P, unit=1).put(after, {"x": values(after)})
        assert set(stream.kv.meta(after, partition=P).unit.tolist()) == {1}  # back
        ledger.unit_of.update(dict.fromkeys(after, 1))
        stream.close_partition(P)
        ds = tq.StreamingDataset(stream, P, "t", ["x"], batch_size=4)
        for _ in ledger.take(_checked(tq.StreamingDataLoader(ds))):
            pass
        missing = ledger.check("t", dead_unit=1)
        assert missing == {k for k in before if ledger.unit_of[k] == 1}
        assert ledger.lost("t") == len(missing) > 0
    finally:
        check_no_leftovers(stream, old)


def test_an_ack_while_a_unit_is_dead_succeeds():
    """Freeing storage is the controller's business: an ack of rows on a dead unit
    (not yet noticed) succeeds, and the consumer goes on."""
    stream = faulty_local(unit_timeout=60.0)  # the death stays unnoticed here
    old = list(stream.owner.pids)
    try:
        stream.create_partition(P, consumers=["t"])
        ledger = Ledger(stream, P)
        _put_in_eights(ledger, _keys("a", 0, 16))
        client = stream.client()
        client.register_task(P, "t", ["x"], batch_size=8)
        meta = client.get_meta(P, "t", step=0)
        assert set(meta.unit.tolist()) == {0, 1}
        kill(old[1])
        assert wait_gone([old[1]], 10.0) == []
        assert client.ack(meta) is None or True  # no exception: the ack succeeded
        assert stream.stats()[P]["tasks"]["t"]["acked"] == 8
        assert client.first_unfinished(P, "t")["step"] == 1
    finally:
        check_no_leftovers(stream, old)


# ------------------------------------------------------------- a consumer dies


@pytest.mark.timeout(180)
def test_a_killed_trainer_resumes_from_an_older_state(tmp_path):
    """Save the loader state every 2 batches, SIGKILL the trainer after 5, restart it
    from the saved (older) state: it resumes at the first unfinished step, never sees
    an acked row again, and gets back what was leased and not acked."""
    stream = faulty_local()
    old = list(stream.owner.pids)
    children = []
    try:
        stream.create_partition(P, consumers=["t"])
        ledger = Ledger(stream, P)
        _put_in_eights(ledger, _keys("a", 0, 48))  # 12 batches of 4
        stream.close_partition(P)
        state = str(tmp_path / "loader.json")
        ctx = mp.get_context("spawn")

        def run(stop_after):
            recv, send = ctx.Pipe()
            child = ctx.Process(target=train, args=(stream, P, state, 2, send, stop_after))
            child.start()
            children.append(child)
            got = []
            while True:
                assert recv.poll(60), "the trainer stopped reporting"
                kind, keys, ok = recv.recv()
                assert ok, "a batch came back with wrong bytes"
                if kind != "batch":
                    return child, got, kind
                got.append(keys)

        first, got1, kind = run(stop_after=5)
        assert kind == "waiting" and len(got1) == 5
        kill(first.pid)
        first.join(10)
        assert first.exitcode == -signal.SIGKILL
        acked = {k for b in got1[:4] for k in b}  # acked before batch 5 was yielded
        assert stream.stats()[P]["tasks"]["t"]["acked"] == len(acked)
        second, got2, kind = run(stop_after=0)
        assert kind == "done"
        second.join(10)
        again = {k for b in got2 for k in b}
        assert not again & acked, "an acked row was delivered again"
        assert got2[0] == got1[4], "the leased, unacked batch must come back first"
        assert acked | again == set(ledger.unit_of)
        stats = stream.stats()[P]
        assert stats["tasks"]["t"]["acked"] == 48 and stats["rows"] == 0
    finally:
        for c in children:
            if c.is_alive():
                kill(c.pid)
                c.join(5)
        check_no_leftovers(stream, old)


def test_a_killed_dataloader_worker_is_a_clear_error_and_the_next_iteration_resumes():
    with _filled(48) as (stream, ledger, old):
        ds = tq.StreamingDataset(stream, P, "t", ["x"], batch_size=4)
        loader = tq.StreamingDataLoader(ds, num_workers=2, multiprocessing_context="fork")
        seen = []
        with pytest.raises(StateError, match="DataLoader worker of task 't'"):
            for n, batch in enumerate(loader):
                seen.append(list(tq.batch_meta(batch).keys))
                if n == 2:
                    workers = [p.pid for p in mp.active_children()
                               if p.pid not in old and alive(p.pid)]
                    assert workers
                    kill(workers[0])
        acked = {k for b in seen[:-1] for k in b}
        rest = [list(tq.batch_meta(b).keys) for b in _checked(loader)]  # a new iteration
        again = {k for b in rest for k in b}
        assert not again & (acked | set(seen[-1])), "an acked row was delivered again"
        assert acked | again | set(seen[-1]) == set(ledger.unit_of)
        assert stream.stats()[P]["tasks"]["t"]["acked"] == 48


# ------------------------------------------------------------- a producer dies


def test_a_killed_producer_loses_only_its_uncommitted_put():
    stream = faulty_local()
    old = list(stream.owner.pids)
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=produce_forever, args=(stream, P, send))
    try:
        stream.create_partition(P, consumers=["t"])
        child.start()
        send.close()
        committed = []
        while len(committed) < 40:
            assert recv.poll(60), "the producer stopped reporting"
            committed += recv.recv()
        kill(child.pid)
        child.join(10)
        while recv.poll(0.5):  # puts committed before the kill
            try:
                committed += recv.recv()
            except EOFError:
                break
        stream.writer(P).put(["z_0"], {"x": values(["z_0"])})  # another producer goes on
        stream.close_partition(P)
        ds = tq.StreamingDataset(stream, P, "t", ["x"], batch_size=4)
        got = [k for b in _checked(tq.StreamingDataLoader(ds)) for k in tq.batch_meta(b).keys]
        assert len(got) == len(set(got))
        assert set(committed) | {"z_0"} <= set(got)
        # at most the put in flight (8 rows) was committed but not yet reported
        assert len(set(got) - set(committed) - {"z_0"}) <= 8
    finally:
        if child.is_alive():
            kill(child.pid)
            child.join(5)
        check_no_leftovers(stream, old)


# ----------------------------------------------------------- the controller dies


def test_a_killed_controller_is_a_clear_error_and_leaves_nothing():
    with _filled(16, close=False) as (stream, _ledger, old):
        quick = tq.connect(stream.address, config=tq.StreamConfig(timeout=1.0))
        ds = tq.StreamingDataset(quick, P, "t", ["x"], batch_size=4, timeout=1.0)
        batches = iter(tq.StreamingDataLoader(ds))
        next(batches)
        kill(old[-1])
        assert wait_gone([old[-1]], 10.0) == []
        with pytest.raises(WaitTimeout, match="controller"):
            for _ in batches:
                pass
        quick.close()


def test_a_killed_controller_restarts_from_its_checkpoint():
    """restart_controller=True: the owner restarts a dead controller from its last
    metadata checkpoint; rows checkpointed are still served (acked ones are not handed
    out again), rows written after the checkpoint are lost and their slots freed, and
    a loader carries on through its retries."""
    stream = faulty_local(checkpoint_interval=1.0, restart_controller=True)
    old = list(stream.owner.pids)
    try:
        stream.create_partition(P, consumers=["t"])
        ledger = Ledger(stream, P)
        _put_in_eights(ledger, _keys("a", 0, 32))
        ds = tq.StreamingDataset(stream, P, "t", ["x"], batch_size=4, prefetch=1)
        loader = tq.StreamingDataLoader(ds)
        batches = ledger.take(_checked(loader))
        for _ in range(2):
            next(batches)
        loader.ack()
        _await_checkpoint(stream)
        late = _keys("b", 0, 8)  # after the checkpoint: lost with the controller
        stream.writer(P).put(late, {"x": values(late)})
        kill(old[-1])
        assert wait_until(lambda: stream.owner.restarts, 30.0), "no restart"
        info = stream.owner.restarts[0]
        assert info["recovery"]["rows_lost"] == 0 and info["recovery"]["slots_freed"] == 8
        stream.close_partition(P)
        for _ in batches:
            pass
        ledger.check("t", dead_unit=None)
        assert set(ledger.delivered) == set(ledger.unit_of)  # every checkpointed row
        with pytest.raises(KeyConflictError):
            stream.kv.meta(late, partition=P)
        print("controller restart:", info)
    finally:
        check_no_leftovers(stream, old)


def test_acks_after_the_last_checkpoint_survive_a_controller_restart():
    """Steps acked after the last checkpoint are in the ack journal: the restarted
    controller replays them, so those rows are never delivered again. A second
    declared consumer ("later") has not read them yet, so their bytes stay stored:
    without the journal the restarted controller would hand them to "t" again."""
    stream = faulty_local(checkpoint_interval=8.0, restart_controller=True)
    old = list(stream.owner.pids)
    try:
        stream.create_partition(P, consumers=["t", "later"])
        ledger = Ledger(stream, P)
        _put_in_eights(ledger, _keys("a", 0, 32))
        ds = tq.StreamingDataset(stream, P, "t", ["x"], batch_size=4, prefetch=1)
        stream.client().register_task(P, "t", ["x"], batch_size=4,  # as the loader will
                                      lease_timeout=CONFIG.lease_timeout)
        _await_checkpoint(stream)  # the next one is 8 s away
        loader = tq.StreamingDataLoader(ds)
        batches = ledger.take(_checked(loader))
        for _ in range(3):
            next(batches)
        loader.ack()  # 12 rows acked after the checkpoint
        acked = set(ledger.delivered)
        kill(old[-1])
        assert wait_until(lambda: stream.owner.restarts, 30.0), "no restart"
        info = stream.owner.restarts[0]
        assert info["recovery"]["journal"]["acked"] == 12
        assert info["recovery"]["rows_lost"] == 0
        stream.close_partition(P)
        rest = [k for b in batches for k in tq.batch_meta(b).keys]
        assert not set(rest) & acked, "an acked row was delivered again"
        ledger.check("t", dead_unit=None)
        assert set(ledger.delivered) == set(ledger.unit_of)
        print("controller restart with journal:", info)
    finally:
        check_no_leftovers(stream, old)


def test_a_loader_waiting_on_a_controller_that_restarts_carries_on():
    """The controller dies while the loader's prefetch waits for the next step (one
    long-poll in flight): the wait is asked again of the restarted controller."""
    with _filled(8, close=False, checkpoint_interval=0.5,
                 restart_controller=True) as (stream, ledger, old):
        ds = tq.StreamingDataset(stream, P, "t", ["x"], batch_size=4)
        loader = tq.StreamingDataLoader(ds)
        batches = ledger.take(_checked(loader))
        for _ in range(2):
            next(batches)
        loader.ack()
        _await_checkpoint(stream)
        kill(old[-1])  # the prefetch thread waits for step 2 meanwhile
        assert wait_until(lambda: stream.owner.restarts, 30.0), "no restart"
        _put_in_eights(ledger, _keys("b", 0, 8))
        stream.close_partition(P)
        for _ in batches:
            pass
        ledger.check("t", dead_unit=None)
        assert set(ledger.delivered) == set(ledger.unit_of)


def test_a_stopped_but_living_unit_keeps_its_rows():
    """A unit that misses its heartbeats while its process lives (SIGSTOP: a loaded
    machine) is slow, not dead: its rows stay and it serves again."""
    with _filled(16) as (stream, ledger, old):
        kill(old[1], signal.SIGSTOP)
        try:
            time.sleep(4 * UNIT_TIMEOUT)  # several missed heartbeats
            assert stream.connection.controller().dead_units() == []
        finally:
            kill(old[1], signal.SIGCONT)
        ds = tq.StreamingDataset(stream, P, "t", ["x"], batch_size=4)
        for _ in ledger.take(_checked(tq.StreamingDataLoader(ds))):
            pass
        ledger.check("t", dead_unit=None)
        assert set(ledger.delivered) == set(ledger.unit_of) and ledger.lost("t") == 0


def test_a_producer_killed_between_reserve_and_commit_does_not_block_the_end():
    """The producer's reserved rows are held under its session: once its heartbeat
    stops (lease_timeout=2 s here) they are aborted and their slots freed, and the
    closed partition ends with every committed row."""
    with _filled(8, close=False) as (stream, ledger, _old):
        ctx = mp.get_context("spawn")
        recv, send = ctx.Pipe()
        child = ctx.Process(target=put_and_hang, args=(stream, P, send))
        child.start()
        try:
            assert recv.poll(60) and recv.recv() == "reserved"
            assert len(stream.kv.list(partition=P)) == 16  # 8 committed + 8 reserved
            kill(child.pid)
            child.join(10)
        finally:
            if child.is_alive():
                kill(child.pid)
                child.join(5)
        stream.close_partition(P)
        ds = tq.StreamingDataset(stream, P, "t", ["x"], batch_size=4, timeout=15.0)
        for _ in ledger.take(_checked(tq.StreamingDataLoader(ds))):
            pass
        ledger.check("t", dead_unit=None)
        assert set(ledger.delivered) == set(ledger.unit_of)
        assert stream.stats()[P]["rows"] == 0  # all acked; the reserved rows aborted
