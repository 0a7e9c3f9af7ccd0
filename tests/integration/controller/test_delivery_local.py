"""The delivery traps replayed across processes (local mode): late registration, leases
kept alive by the heartbeat of DataLoader workers, a dead consumer process replaced by a
fresh loader, tags that arrive after the fields, cancelled waits, bad puts refused before
bytes move. Embedded versions: tests/controller/test_delivery_traps.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import tq_stream as tq
from tests.helpers.tq_fixtures import killed_consumer, local_stream
from tests.helpers.tq_workers import values
from tq_stream.errors import SchemaError, WaitTimeout

__all__ = ["local_stream"]  # the module-scoped fixture, imported for pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


def keys(prefix: str, n: int) -> list[str]:
    return [f"{prefix}_{i}" for i in range(n)]


def test_late_registration_loses_nothing(local_stream):
    part = "late"
    local_stream.create_partition(part, consumers=["old_logp", "update_actor"])
    ks = keys("l", 6)
    local_stream.writer(part).put(ks, {"x": values(ks)})
    c = local_stream.client()
    c.register_task(part, "old_logp", ["x"], batch_size=6)
    c.ack(c.get_meta(part, "old_logp", 0))
    c.register_task(part, "update_actor", ["x"], batch_size=6)
    meta = c.get_meta(part, "update_actor", 0, timeout=10)
    assert sorted(meta.keys) == sorted(ks)
    assert torch.equal(c.get_data(meta)["x"], values(list(meta.keys)))
    c.ack(meta)
    assert local_stream.stats()[part]["rows"] == 0


def test_workers_keep_leases_alive_through_slow_steps(local_stream):
    """DataLoader workers fetch ahead under a 0.5 s lease while each step "trains" for
    1.2 s: nothing expires, nothing is handed out twice."""
    part = "slow"
    local_stream.create_partition(part, consumers=["actor"])
    ks = keys("s", 12)
    local_stream.writer(part).put(ks, {"x": values(ks)})
    local_stream.close_partition(part)
    ds = tq.StreamingDataset(local_stream, part, "actor", ["x"], batch_size=2,
                             lease_timeout=0.5, timeout=30)
    seen = []
    for batch in tq.StreamingDataLoader(ds, num_workers=2, multiprocessing_context="fork"):
        seen += tq.batch_meta(batch).keys
        threading.Event().wait(1.2)
    assert sorted(seen) == sorted(ks)
    st = local_stream.stats()[part]["tasks"]["actor"]
    assert st["expired"] == 0 and st["redelivered"] == 0 and st["renewed"] > 0
    assert local_stream.stats()[part]["rows"] == 0


def test_a_fresh_loader_takes_over_a_killed_consumer(local_stream):
    part = "takeover"
    ks = keys("t", 8)
    local_stream.writer(part).put(ks, {"x": values(ks)})
    local_stream.close_partition(part)
    local_stream.client().register_task(part, "t", ["x"], batch_size=4, lease_timeout=1.0)
    held = killed_consumer(local_stream, part)
    ds = tq.StreamingDataset(local_stream, part, "t", ["x"], batch_size=4, timeout=30,
                             lease_timeout=1.0)
    batches = [tq.batch_meta(b) for b in tq.StreamingDataLoader(ds)]
    assert sorted(batches[0].keys) == sorted(held)  # step 0 first: no step bookkeeping
    assert sorted(k for b in batches for k in b.keys) == sorted(ks)


def test_a_reward_tag_set_later_is_waited_for(local_stream):
    part = "tags"
    local_stream.create_partition(part, consumers=["actor"])
    ks = keys("g", 4)
    local_stream.writer(part).put(ks, {"x": values(ks)},
                                  tags=[{"uid": "a"}] * 2 + [{"uid": "b"}] * 2)
    sampler = tq.samplers.DynamicFilterSampler(tq.samplers.GroupSampler(2), reward_tag="reward")
    c = local_stream.client()
    c.register_task(part, "actor", ["x"], batch_size=2, sampler=sampler)
    with pytest.raises(WaitTimeout, match="reward"):
        c.get_meta(part, "actor", 0, timeout=0.2)
    local_stream.set_tags(part, ks, [{"reward": r} for r in (0.0, 1.0, 2.0, 2.0)])
    assert sorted(c.get_meta(part, "actor", 0, timeout=10).keys) == ks[:2]
    assert local_stream.stats()[part]["tasks"]["actor"]["discarded"] == {"zero_variance": 2}


def test_a_cancelled_wait_returns_at_once(local_stream):
    part = "cancel"
    local_stream.create_partition(part)
    c = local_stream.client()
    c.register_task(part, "t", ["x"], batch_size=1)
    got: list = []
    th = threading.Thread(target=lambda: got.append(c.get_meta(part, "t", 0, timeout=60)))
    th.start()
    time.sleep(0.3)  # inside its one long-poll
    c.cancel()
    th.join(20)  # bounded: a cancel that did not reach the wait fails here, not in 60 s
    assert not th.is_alive() and got == [None]


def test_a_bad_put_is_refused_before_bytes_move(local_stream, capfd):
    part = "badput"
    w = local_stream.writer(part)
    w.put(["a", "b"], {"x": torch.zeros(2, 3)})
    capfd.readouterr()
    with pytest.raises(SchemaError, match=r"dense float32\[3\].*got dense float32\[4\]"):
        w.put(["c", "d"], {"x": torch.zeros(2, 4)})
    time.sleep(0.2)  # a unit would print its traceback to the shared stderr
    assert "Traceback" not in capfd.readouterr().err
    assert [r["key"] for r in local_stream.kv.list(part)] == ["a", "b"]
