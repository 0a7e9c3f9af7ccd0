"""assert_state_roundtrip on every core stateful object: Controller, TagTable,
SequentialSampler, StreamingDataLoader."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tq_stream as tq
from tests.conftest import keys_of, put_rows
from tests.helpers.state_roundtrip import assert_state_roundtrip
from tq_stream.controller import Controller
from tq_stream.controller.tags import TagTable
from tq_stream.errors import ConfigError, KeyConflictError, StateError
from tq_stream.samplers import Candidates, SequentialSampler


def _busy_controller(stream: tq.Stream) -> Controller:
    """A controller with two partitions, typed tags, two tasks, leases, acks and frees."""
    ctrl = stream.connection.controller()
    stream.create_partition("train", capacity=64, consumers=["old_logp", "actor"])
    keys = keys_of("k", 12)
    tags = [{"uid": f"g{i // 2}", "v": i, "score": i / 3, "ok": i % 2 == 0} for i in range(12)]
    put_rows(stream, keys, tags=tags)
    stream.writer("train").put(keys[:6], {"reward": torch.arange(6.0)})
    put_rows(stream, ["other"], partition="val")
    c = stream.client()
    c.register_task("train", "old_logp", ["x"], batch_size=2, dp_size=2)
    c.register_task("train", "actor", ["x", "reward"], batch_size=3)
    m0 = c.get_meta("train", "old_logp", 0, dp_rank=0)
    c.get_meta("train", "old_logp", 0, dp_rank=1)
    c.ack(m0)
    c.get_meta("train", "old_logp", 1, dp_rank=1)   # step 1 leased, rank 0 not asked yet
    a0 = c.get_meta("train", "actor", 0)
    c.ack(a0)
    c.clear(["k11"], partition="train")
    stream.close_partition("val")
    return ctrl


def _probe_controller(ctrl: Controller) -> list:
    out = []
    for task, fields, bs, dp in (("old_logp", ["x"], 2, 2), ("actor", ["x", "reward"], 3, 1)):
        ctrl.register_task("train", task, fields, batch_size=bs, dp_size=dp,
                           sampler=SequentialSampler())
        for rank in range(dp):
            m = ctrl.get_meta("train", task, step=1, dp_rank=rank, timeout=0.05)
            out.append((task, rank, m.keys, m.tags))
    out.append(ctrl.list_rows("train"))
    st = ctrl.stats()
    for part in st.values():  # measurements of this process, not checkpointed state
        part.pop("blocked_seconds")
        for t in part["tasks"].values():
            for key in ("at", "oldest_ready_age", "rates", "get_meta_wait", "write_to_handout",
                        "leases"):  # claim ages and heartbeats: clock readings
                t.pop(key)
    out.append(st)
    return out


def test_controller_roundtrip(stream):
    ctrl = _busy_controller(stream)
    assert_state_roundtrip(ctrl, Controller(n_units=1), probe=_probe_controller)


def test_controller_restored_task_keeps_its_state_until_registered(stream):
    """A restored task, not yet registered again, survives a second state_dict, blocks
    its consumers until registered, and keeps its rows from being freed by other tasks."""
    ctrl = _busy_controller(stream)
    fresh = Controller(n_units=1)
    fresh.load_state_dict(ctrl.state_dict())
    with pytest.raises(KeyConflictError, match="again after the restore"):
        fresh.get_meta("train", "actor", 1, timeout=0.05)
    again = Controller(n_units=1)
    assert_state_roundtrip(fresh, again, probe=_probe_controller)
    # old_logp acks every row; "actor" (restored, unregistered) has not: nothing is freed
    fresh.register_task("train", "old_logp", ["x"], batch_size=2, dp_size=2)
    live = fresh.stats()["train"]["rows"]
    fresh.close_partition("train")  # the last 3 rows form a short tail step
    for step, rank in ((0, 1), (1, 0), (1, 1), (2, 0), (2, 1)):
        m = fresh.get_meta("train", "old_logp", step, rank, timeout=0.05)
        fresh.ack("train", "old_logp", step, rank, m.index, m.generation)
    assert fresh.stats()["train"]["tasks"]["old_logp"]["acked"] == 11
    # of the rows "actor" acked before the checkpoint (k0-k2), k0 and k1 were freed then;
    # now k2 is; every other row waits for "actor"
    assert live == 9
    assert [r["key"] for r in fresh.list_rows("train")] == keys_of("k", 8, start=3)


def test_controller_restored_task_settings_checked(stream):
    ctrl = _busy_controller(stream)
    fresh = Controller(n_units=1)
    fresh.load_state_dict(ctrl.state_dict())
    with pytest.raises(ConfigError, match="checkpointed settings"):
        fresh.register_task("train", "actor", ["x", "reward"], batch_size=4)
    with pytest.raises(ConfigError, match="SequentialSampler"):
        fresh.register_task("train", "actor", ["x", "reward"], batch_size=3,
                            sampler=tq.samplers.GroupSampler(group_size=1))


def test_controller_load_errors(stream):
    ctrl = _busy_controller(stream)
    state = ctrl.state_dict()
    with pytest.raises(StateError, match="empty controller"):
        ctrl.load_state_dict(state)
    with pytest.raises(ConfigError, match="storage_units must be 1"):
        Controller(n_units=2).load_state_dict(state)
    with pytest.raises(ConfigError, match="format must be 2"):
        Controller(n_units=1).load_state_dict({**state, "format": 99})


def test_tag_table_roundtrip():
    t = TagTable(8)
    rows = np.arange(5)
    t.set(rows, [{"uid": f"g{i}", "v": i, "f": i / 2, "b": i % 2 == 0} for i in range(5)])
    t.set(np.array([5]), [{"uid": None}])   # promotes v (int) -> float, b (bool) -> object
    t.clear(np.array([1]))

    def probe(table: TagTable):
        return table.kinds, table.rows_as_dicts(np.arange(8)), table.get("v", np.arange(6))

    assert_state_roundtrip(t, TagTable(8), probe=probe)


def test_sequential_sampler_roundtrip():
    cands = Candidates.from_arrays(np.arange(10), dp_size=2)
    assert_state_roundtrip(SequentialSampler(), SequentialSampler(),
                           probe=lambda s: s.sample(cands, 3).shares)


def _loader(stream: tq.Stream) -> tq.StreamingDataLoader:
    ds = tq.StreamingDataset(stream, "train", "actor", ["x"], batch_size=2, timeout=2.0)
    return tq.StreamingDataLoader(ds)


def test_dataloader_roundtrip(stream):
    put_rows(stream, keys_of("k", 12))
    loader = _loader(stream)
    seen = []
    for i, batch in enumerate(loader):
        seen.append(tq.batch_meta(batch).keys)
        if i == 1:
            break

    def probe(ld: tq.StreamingDataLoader):
        it = iter(ld)
        keys = tq.batch_meta(next(it)).keys
        it.close()
        return keys

    state = assert_state_roundtrip(loader, _loader(stream), probe=probe)
    assert state["step"] == 2
    assert probe(loader) not in seen


def test_dataloader_state_must_match_its_task(stream):
    put_rows(stream, keys_of("k", 4))
    loader = _loader(stream)
    state = loader.state_dict()
    other = tq.StreamingDataLoader(tq.StreamingDataset(stream, "train", "critic", ["x"], 2))
    with pytest.raises(ConfigError, match="critic"):
        other.load_state_dict(state)
    with pytest.raises(ConfigError, match="step"):
        loader.load_state_dict({**state, "step": -1})
