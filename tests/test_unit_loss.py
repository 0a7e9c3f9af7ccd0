"""A lost storage unit, in embedded mode (the controller's rules; tests/faults/ kills
real unit processes): its rows are dropped and counted, shares shrink, a rank whose
whole share was lost goes on with its next step, and nothing is placed there until
the unit is back."""

from __future__ import annotations

import pytest
from conftest import dense_batch, keys_of, put_rows

import tq_stream as tq
from tq_stream.controller.units import UNIT_LOST
from tq_stream.errors import ConfigError, StateError

P = "train"


@pytest.fixture
def two_units():
    s = tq.init(storage_units=2, config=tq.StreamConfig(timeout=5.0))
    try:
        yield s
    finally:
        s.close()


def _on(stream, keys, unit):
    where = stream.kv.meta(keys, partition=P)
    return [k for k, u in zip(keys, where.unit.tolist(), strict=True) if u == unit]


def test_a_lost_units_rows_are_dropped_counted_and_nothing_new_goes_there(two_units):
    ctrl = two_units._backend.controller()
    two_units.create_partition(P, consumers=["t"])
    c = two_units.client()
    c.register_task(P, "t", ["x"], batch_size=4)
    keys = keys_of("k", 8)
    put_rows(two_units, keys)
    lost = _on(two_units, keys, 1)
    assert 0 < len(lost) < len(keys)

    assert ctrl.unit_lost(1) == {P: len(lost)}
    assert ctrl.unit_lost(1) == {}  # once
    assert ctrl.dead_units() == [1]
    stats = two_units.stats()[P]
    assert stats["rows"] == len(keys) - len(lost)
    assert stats["tasks"]["t"]["discarded"] == {UNIT_LOST: len(lost)}
    fresh = keys_of("f", 6)
    put_rows(two_units, fresh)
    assert _on(two_units, fresh, 1) == []  # placement skips the lost unit
    ctrl.unit_back(1)
    again = keys_of("g", 6)
    put_rows(two_units, again)
    assert _on(two_units, again, 1)  # back: rows go there again
    with pytest.raises(ConfigError, match="unit must be < 2"):
        ctrl.unit_lost(2)


def test_no_live_unit_is_an_error_naming_the_rule(two_units):
    ctrl = two_units._backend.controller()
    ctrl.unit_lost(0)
    ctrl.unit_lost(1)
    with pytest.raises(StateError, match="must be alive"):
        put_rows(two_units, ["a"])
    assert two_units.stats().get(P, {}).get("rows", 0) == 0


def _step0_on_unit_1(stream):
    """Step 0 formed from 2 rows on unit 1 (read, not acked), 4 more rows on unit 0."""
    stream.create_partition(P, consumers=["t"])
    c = stream.client()
    c.register_task(P, "t", ["x"], batch_size=2)
    on_1, on_0 = keys_of("a", 2), keys_of("b", 4)
    put_rows_on(stream, on_1, 1)
    put_rows_on(stream, on_0, 0)
    meta = c.get_meta(P, "t", 0)
    assert sorted(meta.keys) == on_1
    return c, meta, on_0


def test_a_rank_whose_share_was_lost_gets_an_empty_batch_at_once(two_units):
    c, meta, on_0 = _step0_on_unit_1(two_units)
    two_units._backend.controller().unit_lost(1)
    empty = c.get_meta(P, "t", 0, timeout=1.0)
    assert len(empty) == 0 and not empty.end  # lost, said at once: no wait
    c.ack(meta)  # an ack of lost rows succeeds (they are gone)
    assert c.first_unfinished(P, "t")["step"] == 1
    assert two_units.stats()[P]["tasks"]["t"]["discarded"] == {UNIT_LOST: 2}


def test_a_loader_goes_on_with_the_next_step_when_its_share_was_lost(two_units):
    c, meta, on_0 = _step0_on_unit_1(two_units)
    c.release(meta)
    two_units._backend.controller().unit_lost(1)
    two_units.close_partition(P)
    ds = tq.StreamingDataset(two_units, P, "t", ["x"], batch_size=2, timeout=2.0)
    ds.plan = (0, frozenset())  # planned before the loss: step 0 is asked for
    got = [list(tq.batch_meta(b).keys) for b in ds]  # acked as it goes
    assert sorted(k for ks in got for k in ks) == on_0 and len(got) == 2


def put_rows_on(stream, keys, unit):
    stream.writer(P, unit=unit).put(list(keys), dense_batch(keys))
