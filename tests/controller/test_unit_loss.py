"""A lost storage unit, in embedded mode (the controller's rules; tests/integration/faults/ kills
real unit processes): its rows are dropped and counted, shares shrink, a rank whose
whole share was lost goes on with its next step, and nothing is placed there until
the unit is back."""

from __future__ import annotations

import pytest
import torch

import tq_stream as tq
from tests.conftest import dense_batch, keys_of, put_rows
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
    ctrl = two_units.connection.controller()
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
    ctrl = two_units.connection.controller()
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
    two_units.connection.controller().unit_lost(1)
    empty = c.get_meta(P, "t", 0, timeout=1.0)
    assert len(empty) == 0 and not empty.end and empty.lost  # said at once: no wait
    c.ack(meta)  # an ack of lost rows succeeds (they are gone)
    assert c.first_unfinished(P, "t")["step"] == 1
    assert two_units.stats()[P]["tasks"]["t"]["discarded"] == {UNIT_LOST: 2}


def test_a_loader_goes_on_with_the_next_step_when_its_share_was_lost(two_units):
    c, meta, on_0 = _step0_on_unit_1(two_units)
    c.release(meta)
    two_units.connection.controller().unit_lost(1)
    two_units.close_partition(P)
    ds = tq.StreamingDataset(two_units, P, "t", ["x"], batch_size=2, timeout=2.0)
    ds.plan = (0, frozenset())  # planned before the loss: step 0 is asked for
    got = [list(tq.batch_meta(b).keys) for b in ds]  # acked as it goes
    assert sorted(k for ks in got for k in ks) == on_0 and len(got) == 2


def test_a_rank_whose_share_was_lost_after_the_other_ranks_acked_gets_an_empty_batch(
        two_units):
    """dp_size 2: rank 1's whole share of step 0 is lost, rank 0 acks its own: the
    step was forgotten as done by every rank (an empty share counts as acked), and
    rank 1 reading step 0, or acking the rows it held, got a LeaseError."""
    two_units.create_partition(P, consumers=["t"])
    c = two_units.client()
    c.register_task(P, "t", ["x"], batch_size=2, dp_size=2)
    put_rows_on(two_units, keys_of("a", 2), 0)
    put_rows_on(two_units, keys_of("b", 2), 1)
    mine = c.get_meta(P, "t", 0, dp_rank=0)
    held = c.get_meta(P, "t", 0, dp_rank=1)
    assert sorted(mine.keys) == keys_of("a", 2) and sorted(held.keys) == keys_of("b", 2)
    two_units.connection.controller().unit_lost(1)
    assert c.ack(mine) == 2
    empty = c.get_meta(P, "t", 0, dp_rank=1, timeout=1.0)
    assert len(empty) == 0 and not empty.end and empty.step == 0 and empty.lost
    assert not mine.lost
    assert c.ack(held) == 0  # its rows are gone: nothing to ack, no error
    assert c.first_unfinished(P, "t", 1)["step"] == 1
    two_units.close_partition(P)
    ds = tq.StreamingDataset(two_units, P, "t", ["x"], batch_size=2, dp_rank=1, dp_size=2,
                             timeout=2.0)
    ds.plan = (0, frozenset())  # planned before the loss: step 0 is asked for
    assert [list(tq.batch_meta(b).keys) for b in ds] == []


def put_rows_on(stream, keys, unit):
    stream.writer(P, unit=unit).put(list(keys), dense_batch(keys))


# ------------------------------------ a row lost between two puts (issue 20, item 7)


def _x_then_lost(stream, keys):
    """Rows ``keys`` with field x for task "t" (needs x and r), spread over both units;
    then unit 1 is lost (and back, empty). Returns the keys that were on unit 1."""
    stream.create_partition(P, consumers=["t"])
    stream.client().register_task(P, "t", ["x", "r"], batch_size=2)
    put_rows(stream, keys)
    lost = _on(stream, keys, 1)
    assert 0 < len(lost) < len(keys)
    ctrl = stream.connection.controller()
    ctrl.unit_lost(1)
    ctrl.unit_back(1)  # a restarted unit: rows may be placed there again
    return lost


def test_a_put_naming_fields_of_rows_lost_with_their_unit_does_not_make_them_again(
        two_units):
    """The second put of a row (``r`` after ``x``) lands after the row's unit died: it
    writes the rows that still exist, tells which were lost (returned, and a WARNING),
    and makes no half row, so the closed partition ends and counts them lost."""
    keys = keys_of("k", 8)
    lost = _x_then_lost(two_units, keys)
    w = two_units.writer(P)
    skipped = w.put(keys, {"r": torch.ones(len(keys))})
    assert sorted(skipped) == sorted(lost)
    assert sorted(r["key"] for r in two_units.kv.list(partition=P)) == \
        sorted(set(keys) - set(lost))  # no row made again with r only
    assert w.put(lost[0], {"r": torch.tensor(2.0)}) == [lost[0]]  # one row: the same
    two_units.close_partition(P)
    ds = tq.StreamingDataset(two_units, P, "t", ["x", "r"], batch_size=2, timeout=2.0)
    got = sorted(k for b in ds for k in tq.batch_meta(b).keys)  # ends, no WaitTimeout
    assert got == sorted(set(keys) - set(lost))
    stats = two_units.stats()[P]
    assert stats["tasks"]["t"]["discarded"] == {UNIT_LOST: len(lost)}
    assert stats["rows_lost"] == len(lost)


def test_a_put_that_writes_a_lost_rows_field_again_makes_the_row_afresh(two_units):
    """A put that writes a field the lost row had (the producer made it again, or the
    key is reused) creates the row: only a put of fields it lacked is refused."""
    keys = keys_of("k", 8)
    lost = _x_then_lost(two_units, keys)
    w = two_units.writer(P)
    assert w.put(lost, dense_batch(lost)) == []
    assert w.put(keys, {"r": torch.ones(len(keys))}) == []  # every row is whole again
    two_units.close_partition(P)
    ds = tq.StreamingDataset(two_units, P, "t", ["x", "r"], batch_size=2, timeout=2.0)
    assert sorted(k for b in ds for k in tq.batch_meta(b).keys) == sorted(keys)


def test_a_cleared_lost_key_may_be_written_afresh(two_units):
    keys = keys_of("k", 8)
    lost = _x_then_lost(two_units, keys)
    assert two_units.kv.clear(lost, partition=P) == 0  # no live row: it forgets the loss
    w = two_units.writer(P)
    assert w.put(lost, {"r": torch.ones(len(lost))}) == []
    assert sorted(two_units.kv.meta(lost, partition=P).keys) == sorted(lost)


def test_put_data_through_a_meta_skips_rows_lost_meanwhile(two_units):
    """A later stage reads rows (get_meta), their unit dies, it writes a new field
    through the meta: the surviving rows get it, the lost ones are skipped, told."""
    two_units.create_partition(P, consumers=["t", "u"])
    c = two_units.client()
    c.register_task(P, "t", ["x"], batch_size=8)
    c.register_task(P, "u", ["x", "r"], batch_size=2)
    keys = keys_of("k", 8)
    put_rows(two_units, keys)
    lost = _on(two_units, keys, 1)
    meta = c.get_meta(P, "t", 0)
    two_units.connection.controller().unit_lost(1)
    assert sorted(c.put_data(meta, {"r": torch.ones(8)})) == sorted(lost)
    c.ack(meta)
    two_units.close_partition(P)
    ds = tq.StreamingDataset(two_units, P, "u", ["x", "r"], batch_size=2, timeout=2.0)
    assert sorted(k for b in ds for k in tq.batch_meta(b).keys) == \
        sorted(set(keys) - set(lost))


def test_frees_that_fail_any_number_of_times_are_all_retried():
    # The retry list kept only the last 4096 failed frees: the slots of older ones were
    # never freed in their unit and never reusable (a slow leak, logged as "retried").
    from tq_stream.controller import Controller

    down, freed = [True], []

    def free(unit, partition, slots):
        if down[0]:
            raise ConnectionError("unit 0 is down")
        freed.extend(int(s) for s in slots)

    ctrl = Controller(1, free=free)
    ctrl.create_partition("p")
    schema = {"x": {"kind": "dense", "dtype": "float32", "shape": [2]}}
    failed = set()
    for i in range(5000):
        r = ctrl.reserve("p", [f"k{i}"], schema)
        failed.update(int(s) for s in r.slot)
        ctrl.abort("p", r.index, r.generation)
    down[0] = False
    r = ctrl.reserve("p", ["last"], schema)
    ctrl.abort("p", r.index, r.generation)  # the next free retries every failed one
    assert failed <= set(freed)
