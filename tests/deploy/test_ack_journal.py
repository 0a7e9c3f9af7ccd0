"""The ack journal (deploy/ack_journal.py), in process: records, damage, rotation with
checkpoints, and a restarted controller that replays the acks made after its last
checkpoint, so that no acked row is handed out again (issue #11 item 3)."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

from tq_stream.backends.base import occupancy
from tq_stream.backends.memory import MemoryUnit
from tq_stream.columns import schema_of
from tq_stream.deploy.ack_journal import AckJournal, journal_files, read_records, rows_of
from tq_stream.deploy.services import ControllerService, UnitService
from tq_stream.errors import CheckpointError
from tq_stream.messages.reads import Resume
from tq_stream.transport import InprocTransport
from tq_stream.transport.dispatch import OWNER_ARG

pytestmark = pytest.mark.timeout(60)
P = "p"
SCHEMA = {"x": schema_of(torch.zeros(1, 3)).to_dict()}


TOKEN = "owner-" + "t" * 26


def _unit() -> InprocTransport:
    """A unit served in this process, called through its allow-list."""
    return InprocTransport(UnitService(MemoryUnit()), name="u0", owner_token=TOKEN)


def _controller(path: str, unit: InprocTransport | None = None, attach: bool = True,
                interval: float | None = 3600.0) -> ControllerService:
    unit = unit or _unit()
    ctrl = ControllerService(1, unit_client=lambda address: unit, unit_timeout=None,
                             owner_token=TOKEN, checkpoint_path=path,
                             checkpoint_interval=interval)
    if attach:
        ctrl.attach_units([{"address": "u0", "host": "", "pid": -1}])
    return ctrl


def _filled(path: str, n: int = 12, batch_size: int = 2) -> ControllerService:
    ctrl = _controller(path)
    ctrl.create_partition(P, consumers=["t"])
    ctrl.register_task(P, "t", ["x"], batch_size=batch_size)
    keys = [f"k{i}" for i in range(n)]
    place = ctrl.reserve(P, keys, SCHEMA)
    ctrl.commit(P, place.index, place.generation, SCHEMA)
    return ctrl


def _take(ctrl: ControllerService, step: int) -> dict:
    return ctrl.get_meta(P, "t", step=step, timeout=2.0, session="s")


def _ack(ctrl: ControllerService, meta: dict) -> None:
    ctrl.ack(P, "t", meta.step, 0, meta.index, meta.generation)


def _drain(ctrl: ControllerService, step: int) -> list[str]:
    ctrl.close_partition(P)
    keys: list[str] = []
    while True:
        meta = _take(ctrl, step)
        if meta.end:
            return keys
        keys += meta.keys
        _ack(ctrl, meta)
        step += 1


# ---------------------------------------------------------------- the file


def _journal_with_acks(tmp_path, n: int) -> tuple[str, str]:
    path = str(tmp_path / "c.tqmeta")
    j = AckJournal(path, 3)
    for i in range(n):
        j.acked(P, "t", i, 0, 0, np.array([i, i + 1]), np.array([1, 1]))
    j.close()
    return path, j.file(3)


def test_records_round_trip_in_order_and_the_file_is_private(tmp_path):
    _path, file = _journal_with_acks(tmp_path, 5)
    recs = list(read_records(file, 3))
    assert [r[3] for r in recs] == [0, 1, 2, 3, 4]
    assert rows_of(recs[2][6]).tolist() == [2, 3]
    assert os.stat(file).st_mode & 0o777 == 0o600


@pytest.mark.parametrize("cut", [1, 5, 9])
def test_a_torn_last_record_is_ignored(tmp_path, cut):
    _path, file = _journal_with_acks(tmp_path, 5)
    size = os.path.getsize(file)
    os.truncate(file, size - cut)
    assert [r[3] for r in read_records(file, 3)] == [0, 1, 2, 3]


def test_a_damaged_record_in_the_middle_is_a_checkpoint_error_naming_the_file(tmp_path):
    _path, file = _journal_with_acks(tmp_path, 5)
    raw = bytearray(open(file, "rb").read())
    raw[30] ^= 0xFF  # inside the first record
    open(file, "wb").write(bytes(raw))
    with pytest.raises(CheckpointError, match=r"c\.tqmeta\.acks\.3"):
        list(read_records(file, 3))


def test_a_damaged_header_or_wrong_epoch_is_a_checkpoint_error(tmp_path):
    _path, file = _journal_with_acks(tmp_path, 1)
    with pytest.raises(CheckpointError, match="epoch"):
        list(read_records(file, 4))
    raw = bytearray(open(file, "rb").read())
    raw[0] ^= 0xFF
    open(file, "wb").write(bytes(raw))
    with pytest.raises(CheckpointError, match="acks.3"):
        list(read_records(file, 3))


def test_a_failed_append_leaves_no_torn_record(tmp_path, monkeypatch):
    path, file = _journal_with_acks(tmp_path, 2)
    j = AckJournal.__new__(AckJournal)
    j.path, j.epoch, j.records = path, 3, 0
    j._fd = os.open(file, os.O_WRONLY | os.O_APPEND)
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, b: real_write(fd, b[:7]) if len(b) > 7
                        else (_ for _ in ()).throw(OSError(28, "No space left")))
    with pytest.raises(OSError):
        j.acked(P, "t", 9, 0, 0, np.array([1]), np.array([1]))
    monkeypatch.undo()
    j.close()
    assert [r[3] for r in read_records(file, 3)] == [0, 1]


# ------------------------------------------------------- restart and replay


def test_a_restarted_controller_replays_the_acks_made_after_its_checkpoint(tmp_path):
    path = str(tmp_path / "c.tqmeta")
    a = _filled(path)
    a.checkpoints.checkpointer.write_now()  # 12 rows, no step yet
    acked = []
    for step in range(3):  # formed and acked after the checkpoint
        meta = _take(a, step)
        _ack(a, meta)
        acked += meta.keys
    open_meta = _take(a, 3)  # leased, not acked: comes back
    # the controller process dies here (no close, no checkpoint)
    b = _controller(path, attach=False)
    assert b.recovery["journal"]["acked"] == 6 and b.recovery["journal"]["formed"] == 4
    assert b.first_unfinished(P, "t") == Resume(step=3, skip=[])
    assert b.stats()[P]["tasks"]["t"]["acked"] == 6
    again = _take(b, 3)
    assert again.keys == open_meta.keys
    rest = _drain(b, 3)
    assert not set(rest) & set(acked)
    assert sorted(rest + acked) == sorted(f"k{i}" for i in range(12))


def test_a_second_restart_still_remembers_the_first_ones_acks(tmp_path):
    path = str(tmp_path / "c.tqmeta")
    a = _filled(path)
    a.checkpoints.checkpointer.write_now()
    acked = []
    for step in range(2):
        meta = _take(a, step)
        _ack(a, meta)
        acked += meta.keys
    b = _controller(path, attach=False)  # replays, then checkpoints at once
    assert [e for e, _ in journal_files(path)] == [b.checkpoints.journal.epoch]
    meta = _take(b, 2)
    _ack(b, meta)
    acked += meta.keys
    c = _controller(path, attach=False)
    assert c.stats()[P]["tasks"]["t"]["acked"] == 6
    rest = _drain(c, 3)
    assert not set(rest) & set(acked) and len(rest) == 6


def test_a_restart_from_an_older_checkpoint_replays_every_newer_journal(tmp_path):
    """A checkpoint write failed after its rotation: the older checkpoint plus both
    journal files (before and after the rotation) hold every ack."""
    path = str(tmp_path / "c.tqmeta")
    a = _filled(path)
    a.checkpoints.checkpointer.write_now()
    meta = _take(a, 0)
    _ack(a, meta)
    a.checkpoints.snapshot()  # rotated, but the file was never written (a failed write)
    meta2 = _take(a, 1)
    _ack(a, meta2)
    assert len(journal_files(path)) == 2
    b = _controller(path, attach=False)
    assert b.stats()[P]["tasks"]["t"]["acked"] == 4
    assert not set(_drain(b, 2)) & set(meta.keys + meta2.keys)


def test_a_checkpoint_covers_exactly_the_acks_before_its_rotation(tmp_path):
    """Acks racing checkpoints: after a restart the acked count is exactly the count
    acked before the kill, and no acked row is handed out again."""
    path = str(tmp_path / "c.tqmeta")
    a = _filled(path, n=400, batch_size=2)
    acked: list[str] = []
    stop = threading.Event()

    def checkpoints():
        while not stop.is_set():
            a.checkpoints.checkpointer.write_now()

    t = threading.Thread(target=checkpoints)
    t.start()
    try:
        for step in range(150):
            meta = _take(a, step)
            _ack(a, meta)
            acked += meta.keys
            if step in (50, 100):  # let checkpoints land mid-run however threads are run
                written = a.checkpoints.checkpointer.written
                deadline = time.monotonic() + 10
                while a.checkpoints.checkpointer.written == written and time.monotonic() < deadline:
                    time.sleep(0.001)
    finally:
        stop.set()
        t.join(10)
    assert a.checkpoints.checkpointer.written > 1
    b = _controller(path, attach=False)
    assert b.stats()[P]["tasks"]["t"]["acked"] == 300
    rest = _drain(b, 150)
    assert not set(rest) & set(acked) and len(rest) == 100


def test_replayed_acks_free_rows_and_the_units_are_reconciled(tmp_path):
    path = str(tmp_path / "c.tqmeta")
    unit = _unit()
    a = _controller(path, unit)
    a.create_partition(P, consumers=["t"])
    a.register_task(P, "t", ["x"], batch_size=2)
    place = a.reserve(P, ["k0", "k1", "k2", "k3"], SCHEMA)
    tokens = occupancy(place.index, place.generation)
    unit.call("put", {"partition": P, "slots": place.slot, "columns": {"x": torch.ones(4, 3)},
                      "generations": tokens})
    a.commit(P, place.index, place.generation, SCHEMA)
    a.checkpoints.checkpointer.write_now()
    meta = _take(a, 0)
    _ack(a, meta)  # a declared consumer's ack frees the rows (in the unit too)
    assert len(unit.call("held", {OWNER_ARG: TOKEN})[P]["slots"]) == 2
    b = _controller(path, unit)
    assert b.stats()[P]["rows"] == 2 and b.recovery["rows_lost"] == 0
    assert _drain(b, 1) == ["k2", "k3"]


def test_without_checkpoint_interval_there_is_no_journal(tmp_path):
    path = str(tmp_path / "c.tqmeta")
    a = _controller(path, interval=None)
    assert a.checkpoints.journal is None and journal_files(path) == []


def test_replay_keeps_each_ranks_share_and_acks(tmp_path):
    path = str(tmp_path / "c.tqmeta")
    a = _controller(path)
    a.create_partition(P, consumers=["t"])
    a.register_task(P, "t", ["x"], batch_size=2, dp_size=2)
    place = a.reserve(P, [f"k{i}" for i in range(8)], SCHEMA)
    a.commit(P, place.index, place.generation, SCHEMA)
    a.checkpoints.checkpointer.write_now()
    r0 = a.get_meta(P, "t", step=0, dp_rank=0, timeout=2.0, session="s0")
    r1 = a.get_meta(P, "t", step=0, dp_rank=1, timeout=2.0, session="s1")
    a.ack(P, "t", 0, 0, r0.index, r0.generation)  # rank 1 has not acked
    b = _controller(path, attach=False)
    assert b.first_unfinished(P, "t", dp_rank=0).step == 1
    assert b.first_unfinished(P, "t", dp_rank=1).step == 0
    again = b.get_meta(P, "t", step=0, dp_rank=1, timeout=2.0, session="s2")
    assert again.keys == r1.keys
    b.close_partition(P)
    rest = []
    for step in range(1, 10):
        metas = [b.get_meta(P, "t", step=step, dp_rank=r, timeout=2.0, session=f"x{r}")
                 for r in range(2)]
        if metas[0].end:
            break
        rest += [k for m in metas for k in m.keys]
    assert not set(rest) & set(r0.keys + r1.keys) and len(rest) == 4


def test_replay_restores_an_end_step_and_its_tail_discard(tmp_path):
    path = str(tmp_path / "c.tqmeta")
    a = _controller(path)
    a.create_partition(P, consumers=["t"])
    a.register_task(P, "t", ["x"], batch_size=2, drop_last=True)
    place = a.reserve(P, [f"k{i}" for i in range(5)], SCHEMA)
    a.commit(P, place.index, place.generation, SCHEMA)
    a.checkpoints.checkpointer.write_now()
    acked = _drain(a, 0)  # 2 steps, the 5th row discarded as "tail", then the end
    assert len(acked) == 4
    b = _controller(path, attach=False)
    assert b.recovery["journal"]["ended"] == 1 and b.recovery["journal"]["discarded"] == 1
    assert _take(b, 2).end
    stats = b.stats()[P]["tasks"]["t"]
    assert stats["acked"] == 4 and stats["discarded"] == {"tail": 1}
    assert b.stats()[P]["rows"] == 0


def test_replay_restores_a_share_formed_again_at_its_turn(tmp_path):
    """A share formed at version 0 and formed again after the trainer set version 1
    for its step (its rows stale: discarded, replaced): a restarted controller has the
    new share and the discards (controller/turns.py, journal record share_set)."""
    from tq_stream.samplers import StalenessSampler
    from tq_stream.samplers.spec import to_spec

    path = str(tmp_path / "c.tqmeta")
    a = _controller(path)
    a.create_partition(P, consumers=["t"])
    a.register_task(P, "t", ["x"], batch_size=2,
                    sampler=to_spec(StalenessSampler(max_staleness=0)))
    a.set_version(P, "t", 0, at_step=0)
    for keys, v in ((["k0", "k1"], 0), (["k2", "k3"], 1)):
        place = a.reserve(P, keys, SCHEMA)
        a.commit(P, place.index, place.generation, SCHEMA, tags=[{"version": v}] * 2)
    a.checkpoints.checkpointer.write_now()
    assert _take(a, 0).keys == ["k0", "k1"]  # formed for version 0
    a.set_version(P, "t", 1, at_step=0)
    assert _take(a, 0).keys == ["k2", "k3"]
    b = _controller(path, attach=False)
    assert b.stats()[P]["tasks"]["t"]["discarded"] == {"stale": 2}
    assert _take(b, 0).keys == ["k2", "k3"]
    assert _drain(b, 0)[:2] == ["k2", "k3"]


def test_a_step_replayed_from_the_journal_is_checked_against_the_version_set_after_restart(
        tmp_path):
    """Step 0 is formed after the checkpoint, for version 0, and the controller dies.
    The journal does not say which version the step was formed for, so the restarted
    controller checks the replayed share when it is handed out: the trainer set version
    1 for step 0 since, and rows of version 0 are out of the bound (max_staleness=0)."""
    from tq_stream.samplers import StalenessSampler
    from tq_stream.samplers.spec import to_spec

    path = str(tmp_path / "c.tqmeta")
    spec = to_spec(StalenessSampler(max_staleness=0))
    a = _controller(path)
    a.create_partition(P, consumers=["t"])
    a.register_task(P, "t", ["x"], batch_size=2, sampler=spec)
    a.set_version(P, "t", 0, at_step=0)
    for keys, v in ((["k0", "k1"], 0), (["k2", "k3"], 1)):
        place = a.reserve(P, keys, SCHEMA)
        a.commit(P, place.index, place.generation, SCHEMA, tags=[{"version": v}] * 2)
    a.checkpoints.checkpointer.write_now()
    assert _take(a, 0).keys == ["k0", "k1"]  # formed for version 0, journaled
    b = _controller(path, attach=False)
    assert b.recovery["journal"]["formed"] == 1
    b.register_task(P, "t", ["x"], batch_size=2, sampler=spec)  # the consumer is back
    b.set_version(P, "t", 1, at_step=0)
    again = _take(b, 0)
    assert again.keys == ["k2", "k3"] and again.turn == 1
    assert b.stats()[P]["tasks"]["t"]["discarded"] == {"stale": 2}


def test_a_takeover_before_the_checkpoint_still_refuses_the_late_ack_after_a_restart(
        tmp_path):
    """Session "a" lets its lease lapse, "b" takes the share over, a checkpoint is
    written, the controller restarts: "a"'s late ack is still refused."""
    from tq_stream.errors import LeaseTakenOver

    path = str(tmp_path / "c.tqmeta")
    a = _controller(path)
    a.create_partition(P, consumers=["t"])
    a.register_task(P, "t", ["x"], batch_size=2, lease_timeout=0.2)
    place = a.reserve(P, ["k0", "k1"], SCHEMA)
    a.commit(P, place.index, place.generation, SCHEMA)
    old = a.get_meta(P, "t", step=0, timeout=2.0, session="a")
    time.sleep(0.5)  # "a" stops renewing: its claim lapses
    assert a.get_meta(P, "t", step=0, timeout=2.0, session="b").keys == old.keys
    a.checkpoints.checkpointer.write_now()
    b = _controller(path, attach=False)
    with pytest.raises(LeaseTakenOver, match="session='a'"):
        b.ack(P, "t", 0, 0, old.index, old.generation, session="a")
    assert b.ack(P, "t", 0, 0, old.index, old.generation, session="b") == 2
