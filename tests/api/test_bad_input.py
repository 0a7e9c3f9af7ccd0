"""Every bad input: the error type, a message naming the argument and value, and
stored data left exactly as it was."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch

import tq_stream as tq
from tests.conftest import (
    assert_same_snapshot,
    dense_batch,
    keys_of,
    nested,
    put_rows,
    snapshot,
)
from tests.helpers.bad_input_cases import (
    CASES,
    fill,
    rejected_unchanged,
    restore_of_missing_path_fails,
    round_trip_odd_columns,
)
from tq_stream.errors import (
    ClosedError,
    ConfigError,
    KeyConflictError,
    LeaseError,
    SchemaError,
    WaitTimeout,
)


@pytest.fixture
def filled(stream):
    """A stream whose "train" partition holds 4 rows: dense x, ragged r, object s, tags."""
    keys = keys_of("k", 4)
    stream.writer("train").put(keys, {
        "x": dense_batch(keys)["x"],
        "r": nested([torch.arange(n) for n in (1, 3, 2, 5)]),
        "s": ["a", "b", "c", "d"],
    }, tags=[{"uid": f"g{i // 2}", "v": i} for i in range(4)])
    return stream


def rejects(stream, error, match, fn, partition="train"):
    """``fn()`` raises ``error`` matching ``match``; the partition's data is unchanged."""
    before = snapshot(stream, partition)
    with pytest.raises(error, match=match):
        fn()
    assert_same_snapshot(before, snapshot(stream, partition))


W = "train"


# ------------------------------------------------------------------ schema mismatch
@pytest.mark.parametrize("field, value, match", [
    ("x", torch.zeros(2, 4, dtype=torch.float64), r"'x'.*dense float32\[4\].*float64"),
    ("x", torch.zeros(2, 5), r"'x'.*float32\[4\].*float32\[5\]"),
    ("x", [torch.zeros(1), torch.zeros(3)], r"'x'.*dense.*ragged"),
    ("r", torch.zeros(2, 3, 2, dtype=torch.int64), r"'r'.*ragged int64\[\*\].*dense"),
    ("r", nested([torch.ones(2), torch.ones(1)]), r"'r'.*int64.*float32"),
    ("s", torch.zeros(2), r"'s'.*object.*dense"),
    ("x", ["a", "b"], r"'x'.*dense.*object"),
])
def test_schema_mismatch_on_later_put(filled, field, value, match):
    # one existing key and one new key: neither is written, no row is created
    rejects(filled, SchemaError, match,
            lambda: filled.writer(W).put(["k0", "new"], {field: value}))


def test_schema_mismatch_in_one_field_writes_no_other_field(filled):
    rejects(filled, SchemaError, "'x'", lambda: filled.writer(W).put(
        ["k1", "k2"], {"reward": torch.ones(2), "x": torch.zeros(2, 9)}))
    assert "reward" not in filled.stats()[W]["fields"]


# ---------------------------------------------------------------------- keys
def test_wrong_batch_size_vs_keys(filled):
    rejects(filled, SchemaError, r"batch size \[3\].*got \[2\]",
            lambda: filled.writer(W).put(["k0", "k1", "z"], dense_batch(["a", "b"])))
    rejects(filled, SchemaError, "'y' must have 3 rows.*got 2",
            lambda: filled.writer(W).put(["k0", "k1", "z"], {"y": torch.ones(2)}))


def test_duplicate_keys(filled):
    rejects(filled, KeyConflictError, r"distinct.*\['k1'\]",
            lambda: filled.writer(W).put(["k1", "z", "k1"], {"x": torch.ones(3, 4)}))


def test_empty_keys(filled):
    rejects(filled, ConfigError, r"at least one row, got \[\]",
            lambda: filled.writer(W).put([], {"x": torch.ones(0, 4)}))
    rejects(filled, ConfigError, r"non-empty str, got \[''\]",
            lambda: filled.writer(W).put(["k0", ""], {"x": torch.ones(2, 4)}))


def test_non_str_keys(filled):
    rejects(filled, ConfigError, r"non-empty str, got \[1, None\]",
            lambda: filled.writer(W).put(["k0", 1, None], {"x": torch.ones(3, 4)}))
    rejects(filled, ConfigError, "keys must be a list of str, got int",
            lambda: filled.writer(W).put(5, {"x": torch.ones(1, 4)}))


def test_bad_field_name_and_empty_data(filled):
    rejects(filled, ConfigError, "field name must be a non-empty str, got ''",
            lambda: filled.writer(W).put(["k0"], {"": torch.ones(1)}))
    rejects(filled, ConfigError, "at least one field",
            lambda: filled.writer(W).put(["k0"], {}))
    rejects(filled, ConfigError, "at least one field",
            lambda: filled.kv.put("k0", {}, partition=W))
    rejects(filled, SchemaError, "'o'.*plain values.*set",
            lambda: filled.writer(W).put(["k0"], {"o": [{1, 2}]}))


def test_a_huge_value_in_the_wrong_argument_is_shown_cut(filled):
    """kv.clear(partition, keys) for kv.clear(keys, partition): the message names the
    argument and shows the start of the value, not 2,000 keys."""
    keys = [f"k{i}" for i in range(2000)]
    with pytest.raises(ConfigError, match=r"partition must be a non-empty str, got \['k0', "
                                          r"'k1'.*\.\.\. \(\d+ characters\)$") as got:
        filled.kv.clear(W, keys)  # type: ignore[arg-type]
    assert len(str(got.value)) < 200
    assert filled.kv.get("k0", partition=W) is not None  # nothing cleared


# --------------------------------------------------------------- partitions
def test_unknown_partition_for_reads(filled):
    with pytest.raises(KeyConflictError, match="partition must exist, got 'nope'"):
        filled.kv.get("k0", partition="nope")
    with pytest.raises(KeyConflictError, match="'nope'"):
        filled.kv.list(partition="nope")
    with pytest.raises(KeyConflictError, match="'nope'"):
        filled.client().get_meta("nope", "t", step=0, timeout=0.05)
    assert "nope" not in filled.connection.controller().partitions()


def test_put_of_new_rows_to_closed_partition(filled):
    filled.close_partition(W)
    rejects(filled, ClosedError, r"'train' is closed to new rows.*\['new'\]",
            lambda: filled.writer(W).put(["k0", "new"], {"x": torch.ones(2, 4)}))
    # fields of existing rows may still be written (later stages drain the partition)
    filled.writer(W).put(["k0", "k1"], {"reward": torch.ones(2)})
    assert filled.kv.get("k1", ["reward"], partition=W)["reward"].item() == 1.0


# ---------------------------------------------------------------------- tags
@pytest.mark.parametrize("tags, match", [
    ([{"uid": "a"}], r"tags must be a list of 2 dicts.*got 1"),
    ({"uid": "a"}, "tags must be a list of 2 dicts.*got one dict"),
    ("uid", "tags must be a list of 2 dicts.*got str"),
    ([{"uid": "a"}, {"uid": [1, 2]}], r"tags\[1\]\['uid'\].*got \[1, 2\]"),
    ([{"uid": "a"}, {"v": float("nan")}], r"tags\[1\]\['v'\].*NaN.*got nan"),
    ([{"uid": "a"}, {"v": torch.tensor(1)}], r"tags\[1\]\['v'\]"),
    ([{"uid": "a"}, {"": 1}], r"tags\[1\] keys must be non-empty str"),
    ([{"uid": "a"}, "b"], r"tags\[1\] must be a dict, got str"),
    ([{"v": 2**70}, {}], r"tags\[0\]\['v'\] must fit in int64"),
])
def test_bad_tags(filled, tags, match):
    rejects(filled, ConfigError, match,
            lambda: filled.writer(W).put(["k0", "new"], {"x": torch.ones(2, 4)}, tags=tags))



@pytest.mark.parametrize("tag, match", [
    (5, "tag must be a dict, got int"),
    ({"v": [1]}, r"tag\['v'\] must be a str, int, float, bool or None.*got \[1\]"),
    ({"": 1}, "tag keys must be non-empty str"),
])
def test_bad_kv_tag_is_named_tag(filled, tag, match):
    """``KV.put`` takes one row's ``tag=``: its error names that argument, not ``tags[0]``."""
    rejects(filled, ConfigError, match,
            lambda: filled.kv.put("k0", {"x": torch.ones(4)}, tag=tag, partition=W))

# ------------------------------------------------------------------ capacity
def test_put_exceeding_capacity(stream):
    stream.create_partition(W, capacity=3)
    put_rows(stream, ["a"])
    rejects(stream, ConfigError, r"capacity 3 of partition 'train', got 4 new rows",
            lambda: put_rows(stream, keys_of("n", 4)))


def test_capacity_blocks_then_succeeds_after_ack(stream):
    stream.create_partition(W, capacity=4, consumers=["t"])
    put_rows(stream, keys_of("a", 4))
    rejects(stream, WaitTimeout, r"'train' stayed full \(4/4 rows\) for timeout=0.1 s",
            lambda: stream.writer(W).put(["b0"], dense_batch(["b0"]), timeout=0.1))
    put_rows(stream, ["a0", "a1"])  # existing rows take no capacity
    client = stream.client()
    client.register_task(W, "t", ["x"], batch_size=2)
    done = threading.Event()

    def blocked_put():
        stream.writer(W).put(["b0", "b1"], dense_batch(["b0", "b1"]), timeout=5.0)
        done.set()

    th = threading.Thread(target=blocked_put)
    th.start()
    assert not done.wait(0.1)  # still blocked: the partition is full
    meta = client.get_meta(W, "t", step=0)
    client.ack(meta)  # frees 2 rows: the writer wakes
    th.join(5.0)
    assert done.is_set()
    assert {r["key"] for r in stream.kv.list(W)} == {"a2", "a3", "b0", "b1"}


def test_bad_capacity(stream):
    with pytest.raises(ConfigError, match="capacity must be an int >= 1, got 0"):
        stream.create_partition(W, capacity=0)
    put_rows(stream, keys_of("a", 3))
    with pytest.raises(ConfigError, match="capacity must be >= the 3 rows.*got 2"):
        stream.create_partition(W, capacity=2)


# ----------------------------------------------------------- dataset arguments
@pytest.mark.parametrize("kwargs, match", [
    ({"batch_size": 0}, "batch_size must be an int >= 1, got 0"),
    ({"batch_size": 2.5}, "batch_size must be an int >= 1, got 2.5"),
    ({"dp_size": 0}, "dp_size must be an int >= 1, got 0"),
    ({"dp_size": 2, "dp_rank": 2}, r"dp_rank must be an int in \[0, 2\), got 2"),
    ({"dp_rank": -1}, r"dp_rank must be an int in \[0, 1\), got -1"),
    ({"replicas": 0}, "replicas must be an int >= 1, got 0"),
    ({"fields": []}, r"fields must be a non-empty list.*got \[\]"),
    ({"fields": "x"}, "fields must be a non-empty list.*got 'x'"),
    ({"timeout": 0}, "timeout must be a number of seconds > 0, got 0"),
    ({"ragged": "jagged"}, r"ragged must be one of \['nested', 'padded', 'list'\], got 'jagged'"),
    ({"prefetch": 0}, "prefetch must be an int >= 1, got 0"),
])
def test_bad_dataset_arguments(stream, kwargs, match):
    args = {"partition": W, "task": "t", "fields": ["x"], "batch_size": 2, **kwargs}
    with pytest.raises(ConfigError, match=match):
        tq.StreamingDataset(stream, **args)


def test_task_registered_with_different_settings(stream):
    client = stream.client()
    client.register_task(W, "actor", ["x"], batch_size=2, dp_size=2)
    client.register_task(W, "actor", ["x"], batch_size=2, dp_size=2)  # same: fine
    with pytest.raises(ConfigError, match=r"task 'actor'.*same settings.*batch_size=4"):
        client.register_task(W, "actor", ["x"], batch_size=4, dp_size=2)
    with pytest.raises(ConfigError, match="sampler of task 'actor'.*GroupSampler"):
        client.register_task(W, "actor", ["x"], batch_size=2, dp_size=2,
                             sampler=tq.samplers.GroupSampler(group_size=2))
    ds = tq.StreamingDataset(stream, W, "actor", ["x", "y"], batch_size=2, dp_size=2)
    with pytest.raises(ConfigError, match="task 'actor'"):
        next(iter(tq.StreamingDataLoader(ds)))


# --------------------------------------------------------------- leases, waits
def test_get_meta_timeout_names_partition_and_task(stream):
    put_rows(stream, ["a"])
    client = stream.client()
    client.register_task(W, "actor", ["x"], batch_size=2)
    with pytest.raises(WaitTimeout, match=r"timeout=0.05 s on partition 'train' for task 'actor' "
                                          r"step 0.*1 rows ready, 2 needed"):
        client.get_meta(W, "actor", step=0, timeout=0.05)
    ds = tq.StreamingDataset(stream, W, "actor", ["x"], batch_size=2, timeout=0.3)
    with pytest.raises(WaitTimeout, match="timeout=0.3 s on partition 'train' for task 'actor'"):
        next(iter(tq.StreamingDataLoader(ds)))


def test_ack_of_rows_not_held(stream):
    put_rows(stream, keys_of("a", 4))
    client = stream.client()
    client.register_task(W, "t", ["x"], batch_size=2)
    m0 = client.get_meta(W, "t", step=0)
    m1 = client.get_meta(W, "t", step=1)
    with pytest.raises(LeaseError, match="rows outside that share"):
        client.ack(replace(m1.select([0]), step=0))
    with pytest.raises(LeaseError, match="step 5 of task 't'"):
        client.ack(replace(m0, step=5))
    kv_meta = stream.kv.meta(["a0"], partition=W)
    with pytest.raises(ConfigError, match="ack needs a meta from get_meta"):
        client.ack(kv_meta)
    assert client.ack(m0) == 2
    assert client.ack(m0) == 0  # twice (its first reply lost): nothing to do
    with pytest.raises(LeaseError):
        client.release(m0)


def test_ack_after_lease_expiry(stream, clock):
    put_rows(stream, keys_of("a", 2))
    client = stream.client()
    client.register_task(W, "t", ["x"], batch_size=2, lease_timeout=10.0)
    meta = stream.client().get_meta(W, "t", step=0)  # a client that is gone: no heartbeat
    clock.advance(11.0)
    with pytest.raises(WaitTimeout):  # a request runs the expiry; no rows for step 1
        client.get_meta(W, "t", step=1, timeout=0.01)
    assert stream.stats()[W]["tasks"]["t"]["expired"] == 2  # rows
    again = client.get_meta(W, "t", step=None)  # the unclaimed share goes to the next asker
    assert again.keys == meta.keys and again.step == 0
    assert stream.stats()[W]["tasks"]["t"]["redelivered"] == 2
    clock.advance(5.0)
    client.renew(again)
    clock.advance(6.0)  # 11 s after the hand-out, 6 s after the renewal: still held
    with pytest.raises(WaitTimeout):
        client.get_meta(W, "t", step=1, timeout=0.01)
    assert client.ack(again) == 2


# ------------------------------------------------------------------- closing
def test_use_after_stream_close(stream):
    put_rows(stream, ["a"])
    writer, client, kv = stream.writer(W), stream.client(), stream.kv
    ds = tq.StreamingDataset(stream, W, "t", ["x"], batch_size=1)
    stream.close()
    stream.close()  # idempotent
    for call in (lambda: writer.put(["b"], dense_batch(["b"])),
                 lambda: kv.get("a", partition=W),
                 lambda: kv.list(W),
                 lambda: client.get_meta(W, "t", 0),
                 lambda: stream.stats(),
                 lambda: next(iter(tq.StreamingDataLoader(ds)))):
        with pytest.raises(ClosedError, match="closed"):
            call()


def test_close_wakes_blocked_calls(stream):
    stream.create_partition(W, capacity=1)
    put_rows(stream, ["a"])
    stream.client().register_task(W, "t", ["x"], batch_size=2)
    errors = []

    def run(fn):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - collected and checked below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(f,)) for f in (
        lambda: stream.client().get_meta(W, "t", step=0, timeout=30),
        lambda: stream.writer(W).put(["b"], dense_batch(["b"]), timeout=30))]
    for t in threads:
        t.start()
    threading.Event().wait(0.2)
    stream.close()
    for t in threads:
        t.join(5.0)
    assert len(errors) == 2 and all(isinstance(e, ClosedError) for e in errors), errors


# ---------------------------------------------------- the last gaps (issue 11, item 7)
@pytest.mark.parametrize("call, error, match", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_last_gaps_are_tq_errors_that_change_nothing(stream, call, error, match):
    fill(stream)
    rejected_unchanged(stream, call, error, match)


def test_float8_uint_and_zero_width_fields_round_trip(stream):
    round_trip_odd_columns(stream)


def test_restore_of_a_missing_path_is_a_tq_error(tmp_path):
    restore_of_missing_path_fails(str(tmp_path / "missing"))


def test_a_first_put_that_fails_leaves_no_partition(stream, monkeypatch):
    from tq_stream.backends.memory import MemoryUnit

    def broken(*args, **kwargs):
        raise tq.errors.StateError("unit refuses the write")

    monkeypatch.setattr(MemoryUnit, "put", broken)
    with pytest.raises(tq.errors.StateError, match="refuses"):
        stream.writer("new").put(["a"], {"x": torch.ones(1, 2)})
    assert stream.connection.controller().partitions() == []
    assert stream.stats() == {}
    monkeypatch.undo()
    stream.writer("new").put(["a"], {"x": torch.ones(1, 2)})
    assert [r["key"] for r in stream.kv.list("new")] == ["a"]


def test_a_partition_goes_only_when_its_last_failed_put_has_freed_its_slots():
    from tq_stream.controller import Controller

    freeing = []

    def free(unit, partition, slots):
        # while a slot is being freed, the partition (and its slot pools) must stay
        freeing.append(partition in ctrl.partitions())

    ctrl = Controller(1, free=free)
    schema = {"x": {"kind": "dense", "dtype": "float32", "shape": [2]}}
    a = ctrl.reserve("p", ["a"], schema)
    b = ctrl.reserve("p", ["b"], schema)
    ctrl.abort("p", a.index, a.generation)
    assert ctrl.partitions() == ["p"]  # b's row still lives there
    ctrl.abort("p", b.index, b.generation)
    assert ctrl.partitions() == [] and freeing == [True, True]
    ctrl.create_partition("q")
    c = ctrl.reserve("q", ["c"], schema)
    ctrl.abort("q", c.index, c.generation)
    assert ctrl.partitions() == ["q"]  # created explicitly: kept while empty


@pytest.mark.parametrize("mode", ["local", "ray"])
def test_a_misspelt_init_option_is_named_before_anything_starts(mode):
    # It was a raw TypeError from the deployment's constructor (a new user's typo).
    with pytest.raises(ConfigError, match=rf"options of mode '{mode}' must be among .*"
                                          r"'unit_timeout'.*got \['storage_unit'\]"):
        tq.init(mode=mode, storage_unit=2)
