"""When it stalls, say why (issue 20 item 13): per task, stats() shows the rows not
ready and what they lack, the leases with holder, age and last heartbeat, and a
WaitTimeout names what the rows wait for. Embedded; the local-mode run is in
tests/integration/deploy/test_soak.py."""

from __future__ import annotations

import time

import pytest
import torch

import tq_stream as tq
from tq_stream import status
from tq_stream.errors import WaitTimeout
from tq_stream.samplers import PrioritySampler

P = "stall"


def stalled(stream: tq.Stream) -> tq.Client:
    """12 rows with ``x``; 4 of them also ``reward``; task "t" needs ``x`` and
    ``reward``, task "s" ``x`` and tag ``score`` (set on 2 rows)."""
    stream.create_partition(P, consumers=["t", "s"])
    client = stream.client(consumer="worker-1")
    client.register_task(P, "t", ["x", "reward"], batch_size=8)
    client.register_task(P, "s", ["x"], batch_size=2, sampler=PrioritySampler(priority_tag="score"))
    keys = [f"k{i}" for i in range(12)]
    w = stream.writer(P)
    w.put(keys, {"x": torch.zeros(12, 2)})
    w.put(keys[:4], {"reward": torch.ones(4)})
    stream.set_tags(P, keys[:2], [{"score": 1.0}] * 2)
    return client


def check_stall_reasons(stream: tq.Stream) -> None:
    client = stalled(stream)
    t = stream.stats()[P]["tasks"]["t"]
    assert t["not_ready"] == {"rows": 8, "lack_fields": {"reward": 8}, "lack_tags": {}}
    with pytest.raises(WaitTimeout, match="8 rows not ready: 8 lack field 'reward'"):
        client.get_meta(P, "t", 0, timeout=0.2)
    held = client.get_meta(P, "s", 0, timeout=5)  # the 2 scored rows
    assert len(held) == 2
    s = stream.stats()[P]["tasks"]["s"]
    assert s["not_ready"] == {"rows": 10, "lack_fields": {}, "lack_tags": {"score": 10}}
    (lease,) = s["leases"]
    assert lease["step"] == 0 and lease["rows"] == 2 and lease["consumer"] == "worker-1"
    assert lease["session"] == client.session
    assert lease["age"] >= 0 and lease["heartbeat_age"] >= 0 and lease["expires_in"] > 0
    time.sleep(0.3)
    client.renew(held)
    later = stream.stats()[P]["tasks"]["s"]["leases"][0]
    assert later["age"] >= 0.3 > later["heartbeat_age"]  # a live holder: fresh heartbeat
    with pytest.raises(WaitTimeout, match="lack tag 'score'"):
        client.get_meta(P, "s", 1, timeout=0.2)
    text = str(status.task_table(stream.stats())) + str(status.lease_table(stream.stats()))
    assert text  # renders (the CLI test checks the printed tables)


def test_stall_reasons_embedded():
    with tq.init() as stream:
        check_stall_reasons(stream)


def test_status_and_metrics_show_what_rows_lack():
    pytest.importorskip("prometheus_client")
    from rich.console import Console

    from tq_stream.metrics.collector import StreamCollector

    with tq.init() as stream:
        client = stalled(stream)
        client.get_meta(P, "s", 0, timeout=5)
        console = Console(width=250, record=True)
        console.print(status.task_table(stream.stats()), status.lease_table(stream.stats()))
        out = console.export_text()
        assert "8 rows not ready: 8 lack field 'reward'" in out
        assert "worker-1" in out
        families = {f.name: f for f in StreamCollector(stream.connection).collect()}
        lacking = {tuple(s.labels.values()): s.value
                   for s in families["tq_stream_rows_lacking"].samples}
        assert lacking[(P, "t", "field", "reward")] == 8
        assert lacking[(P, "s", "tag", "score")] == 10
        assert any(s.value == 8 for s in families["tq_stream_rows_not_ready"].samples)


def test_a_lease_past_its_expiry_reads_expired_in_status():
    """Nobody asked for the step since its holder's heartbeat stopped: the claim is still
    listed (its share waits for the next reader of that step), as expired."""
    from rich.console import Console

    from tests.controller.test_live_claims import die

    with tq.init() as stream:
        stream.writer(P).put(["a", "b"], {"x": torch.zeros(2, 2)})
        client = stream.client(consumer="worker-1")
        client.register_task(P, "t", ["x"], batch_size=2, lease_timeout=0.2)
        client.get_meta(P, "t", 0, timeout=5)
        console = Console(width=250, record=True)
        console.print(status.lease_table(stream.stats()))
        assert "expired" not in console.export_text()
        die(client)
        deadline = time.monotonic() + 10.0
        while stream.stats()[P]["tasks"]["t"]["leases"][0]["expires_in"] > 0:
            assert time.monotonic() < deadline, "the lease never expired"
            time.sleep(0.05)
        console.print(status.lease_table(stream.stats()))
        row = next(line for line in console.export_text().splitlines() if "worker-1" in line)
        assert "expired" in row
