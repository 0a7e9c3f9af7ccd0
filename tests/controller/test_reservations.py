"""Rows a producer reserved and never committed (embedded): they are held under the
producer's session, and aborted, with their slots freed, when the session stops its
heartbeat, is cancelled, or the put outlives ``timeout + lease`` (a stuck producer).
So a producer killed between ``reserve`` and ``commit`` does not keep a closed
partition from ending (issue #11)."""

from __future__ import annotations

import pytest

import tq_stream as tq
from tests.conftest import dense_batch, keys_of, put_rows
from tq_stream.connection import placement
from tq_stream.controller import Controller
from tq_stream.controller.reservations import RESTORED_LEASE
from tq_stream.convert import schemas_of
from tq_stream.errors import ConfigError, KeyConflictError, StateError

pytestmark = pytest.mark.timeout(60)
P = "train"


def _reserve(stream: tq.Stream, keys: list[str], session: str = "dead", lease: float = 5.0,
             timeout: float = 10.0) -> dict:
    """A producer's reserve (what ``Writer.put`` does before storing the bytes)."""
    ctrl = stream.connection.controller()
    return ctrl.reserve(partition=P, keys=keys, schemas=schemas_of(dense_batch(keys)),
                        timeout=timeout, session=session, lease=lease)


def _commit(stream: tq.Stream, place: dict, keys: list[str]) -> None:
    stream.connection.controller().commit(partition=P, index=place.index,
                                        generation=place.generation,
                                        schemas=schemas_of(dense_batch(keys)))


def _expiry_checked(stream: tq.Stream) -> None:
    """Make the controller check reservations for expiry, as any blocking reserve or
    get_meta wait does (here: a put to another partition)."""
    ctrl = stream.connection.controller()
    n = len(ctrl.list_rows("other")) if "other" in ctrl.partitions() else 0
    put_rows(stream, [f"o{n}"], "other")


def _drain(stream: tq.Stream, timeout: float = 5.0) -> list[str]:
    ds = tq.StreamingDataset(stream, P, "t", ["x"], batch_size=4, timeout=timeout)
    return [k for b in tq.StreamingDataLoader(ds) for k in tq.batch_meta(b).keys]


def test_a_producer_whose_session_expired_does_not_block_the_end(stream, clock):
    stream.create_partition(P, consumers=["t"])
    put_rows(stream, keys_of("a", 8), P)
    place = _reserve(stream, ["dead_0", "dead_1"], lease=5.0)  # ... and the producer died
    stream.close_partition(P)
    clock.advance(6)  # no heartbeat for longer than the lease
    assert sorted(_drain(stream)) == sorted(keys_of("a", 8))
    with pytest.raises(KeyConflictError):
        stream.kv.meta(["dead_0"], partition=P)
    assert stream.stats()[P]["rows"] == 0  # every row acked, the reserved ones aborted
    with pytest.raises(StateError, match="cleared meanwhile"):  # a late commit
        _commit(stream, place, ["dead_0", "dead_1"])


def test_aborted_slots_are_freed_in_the_unit_and_placed_again(stream, clock):
    stream.create_partition(P)
    freed = []
    unit = stream.connection.units()[0]
    real_free = unit.free
    unit.free = lambda partition, slots: (freed.append(list(slots)), real_free(partition, slots))
    place = _reserve(stream, ["dead_0", "dead_1"], lease=1.0)
    clock.advance(2)
    ctrl = stream.connection.controller()
    assert ctrl.renew(partition=P, task="", session="dead") == 0
    ctrl.stats()  # nothing expires on a read...
    assert freed == []
    _expiry_checked(stream)  # ... the next wait or put does
    assert sorted(sum(freed, [])) == sorted(place.slot.tolist())
    put_rows(stream, ["b_0", "b_1"], P)
    assert sorted(sum(freed, [])) == sorted(place.slot.tolist())
    again = stream.kv.meta(["b_0", "b_1"], partition=P)
    assert sorted(again.slot.tolist()) == sorted(place.slot.tolist())


def test_the_heartbeat_keeps_a_slow_put_alive(stream, clock):
    stream.create_partition(P)
    place = _reserve(stream, ["slow_0"], session="live", lease=5.0, timeout=60.0)
    ctrl = stream.connection.controller()
    for _ in range(4):  # 16 s in all, renewed every 4 s
        clock.advance(4)
        assert ctrl.renew(partition=P, task="", session="live") == 1
        _expiry_checked(stream)
    _commit(stream, place, ["slow_0"])
    assert [r["key"] for r in stream.kv.list(partition=P)] == ["slow_0"]
    assert ctrl.renew(partition=P, task="", session="live") == 0  # committed: not held


def test_a_live_but_stuck_producer_loses_its_reservation_after_timeout_plus_lease(stream,
                                                                                  clock):
    stream.create_partition(P, consumers=["t"])
    place = _reserve(stream, ["stuck_0"], session="stuck", lease=5.0, timeout=10.0)
    ctrl = stream.connection.controller()
    for _ in range(4):  # renewed every 4 s: past timeout + lease = 15 s
        clock.advance(4)
        ctrl.renew(partition=P, task="", session="stuck")
    stream.close_partition(P)
    assert _drain(stream) == []
    with pytest.raises(StateError):
        _commit(stream, place, ["stuck_0"])


def test_cancel_aborts_the_sessions_reservations_at_once(stream):
    stream.create_partition(P)
    place = _reserve(stream, ["c_0", "c_1"], session="w-1")
    keep = _reserve(stream, ["k_0"], session="w-2")
    stream.connection.controller().cancel(session="w-1")
    assert [r["key"] for r in stream.kv.list(partition=P)] == ["k_0"]  # still reserved
    with pytest.raises(StateError):
        _commit(stream, place, ["c_0", "c_1"])
    _commit(stream, keep, ["k_0"])  # another session's put is untouched
    assert [r["key"] for r in stream.kv.list(partition=P)] == ["k_0"]


def test_a_dead_producers_rows_free_capacity_for_a_waiting_writer(stream, clock):
    stream.create_partition(P, capacity=2)
    _reserve(stream, ["dead_0", "dead_1"], lease=1.0)
    clock.advance(2)
    put_rows(stream, ["b_0", "b_1"], P)  # would wait for capacity for good otherwise
    assert sorted(r["key"] for r in stream.kv.list(partition=P)) == ["b_0", "b_1"]


def test_a_writer_holds_its_rows_under_its_process_producer_session(stream, monkeypatch):
    ctrl = stream.connection.controller()
    seen = []
    real_store = placement.store

    def store(*args, **kwargs):
        seen.append([(p, r.session, r.lease, len(r.index))
                     for p, held in ctrl._reservations._parts.items() for r in held])
        return real_store(*args, **kwargs)

    monkeypatch.setattr(placement, "store", store)
    put_rows(stream, keys_of("a", 3), P)
    session = stream.connection.keeper().producer_session(P, stream.config.lease_timeout)
    assert seen == [[(P, session, stream.config.lease_timeout, 3)]]
    assert len(ctrl._reservations) == 0  # committed
    assert ctrl.renew(partition=P, task="", session=session) == 0


def test_bad_session_or_lease_is_rejected_before_anything_changes(stream):
    with pytest.raises(ConfigError, match="lease"):
        _reserve(stream, ["x_0"], lease=-1.0)
    with pytest.raises(ConfigError, match="session"):
        _reserve(stream, ["x_0"], session="s" * 300)
    assert stream.connection.controller().partitions() == []


def test_rows_reserved_when_a_checkpoint_was_taken_are_held_after_a_restore(stream, clock):
    stream.create_partition(P)
    put_rows(stream, keys_of("a", 4), P)
    _reserve(stream, ["mid_0"])  # a put in flight when the state is taken
    state = stream.connection.controller().state_dict()
    ctrl = Controller(clock=clock.time)  # the restarted controller (metadata only)
    ctrl.load_state_dict(state)
    clock.advance(RESTORED_LEASE - 1)
    ctrl.reserve(partition=P, keys=["b_0"], schemas=schemas_of(dense_batch(["b_0"])))
    assert len(ctrl.list_rows(P)) == 6  # a commit may still land
    clock.advance(2)  # its producer's session is unknown: held RESTORED_LEASE seconds
    ctrl.reserve(partition=P, keys=["b_1"], schemas=schemas_of(dense_batch(["b_1"])))
    assert "mid_0" not in [r["key"] for r in ctrl.list_rows(P)]
    assert len(ctrl.list_rows(P)) == 6
