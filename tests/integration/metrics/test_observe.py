"""Watching a local deployment: the Prometheus endpoint, ``tq-stream status`` and
``Stream.processes()`` against live servers."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
import torch

import tq_stream as tq
from tests.helpers.tq_fixtures import CONFIG, local_stream, wait_gone

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

GROUPS = 20  # groups of 2 rows; every odd group has equal rewards (discarded)
ROOT = Path(__file__).resolve().parents[3]
__all__ = ["local_stream"]  # the module-scoped fixture, imported for pytest


def _scrape(stream: tq.Stream) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://{stream.metrics_endpoint}/metrics",
                                  timeout=30).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _value(samples: dict, name: str, **labels: str) -> float:
    return samples[name, tuple(sorted(labels.items()))]


def _produce(stream: tq.Stream) -> None:
    w = stream.writer("obs")
    for g in range(GROUPS):
        keys = [f"g{g}_{i}" for i in range(2)]
        rewards = [1.0, 1.0] if g % 2 else [0.0, 1.0]
        w.put(keys, {"x": torch.full((2, 8), float(g))},
              tags=[{"uid": f"g{g}", "reward": r} for r in rewards])
    stream.close_partition("obs")


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_metrics_endpoint_counts_what_a_local_deployment_streams() -> None:
    stream = tq.init(mode="local", storage_units=2, config=CONFIG, metrics_port=0)
    try:
        host, port = stream.metrics_endpoint.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        producer = threading.Thread(target=_produce, args=(stream,))
        producer.start()
        sampler = tq.samplers.DynamicFilterSampler(tq.samplers.GroupSampler(2))
        ds = tq.StreamingDataset(stream, "obs", "actor", ["x"], batch_size=2,
                                 sampler=sampler, timeout=60)
        seen: list[str] = []
        mid = None
        for batch in tq.StreamingDataLoader(ds):
            seen += tq.batch_meta(batch).keys
            if mid is None:
                mid = _scrape(stream)  # while the producer still streams
        producer.join(timeout=60)
        after = _scrape(stream)
        stats = stream.stats()["obs"]
    finally:
        stream.close()
    task = stats["tasks"]["actor"]
    # what the test did: 40 rows written, 10 passing groups delivered, 10 discarded
    assert len(seen) == len(set(seen)) == GROUPS
    assert _value(after, "tq_stream_rows_created_total", partition="obs") == 2 * GROUPS
    assert stats["rows_created"] == 2 * GROUPS
    pt = {"partition": "obs", "task": "actor"}
    assert _value(after, "tq_stream_rows_acked_total", **pt) == task["acked"] == len(seen)
    assert _value(after, "tq_stream_rows_handed_out_total", **pt) == task["handed_out"]
    assert _value(after, "tq_stream_rows_discarded_total", reason="zero_variance",
                  **pt) == task["discarded"]["zero_variance"] == GROUPS
    assert _value(after, "tq_stream_rows_ready", **pt) == task["available"] == 0
    assert _value(after, "tq_stream_get_meta_wait_seconds_count", **pt) \
        == task["get_meta_wait"]["count"] > 0
    assert _value(after, "tq_stream_write_to_handout_seconds_count", **pt) == len(seen)
    assert _value(after, "tq_stream_lease_expiries_total", **pt) == task.get("expired", 0)
    # counters never go back between the two scrapes
    assert mid is not None
    assert _value(mid, "tq_stream_rows_handed_out_total", **pt) \
        <= _value(after, "tq_stream_rows_handed_out_total", **pt)
    # the figures come from the servers: both units, their RPC counts, the controller's
    for unit in ("0", "1"):
        assert _value(after, "tq_stream_unit_up", unit=unit) == 1
        assert _value(after, "tq_stream_rpc_calls_total", server=f"unit{unit}",
                      method="stats") >= 1
    assert _value(after, "tq_stream_rpc_calls_total", server="controller",
                  method="get_meta") >= len(seen) // 2
    assert _value(after, "tq_stream_info", version=tq.__version__, mode="local") == 1


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_metrics_report_a_dead_unit_down() -> None:
    stream = tq.init(mode="local", storage_units=2, config=CONFIG, metrics_port=0)
    try:
        stream.writer("d").put(["a", "b"], {"x": torch.ones(2, 4)})
        unit1 = stream.processes()[2]
        os.kill(unit1.pid, 9)
        assert wait_gone([unit1.pid], 10) == []
        samples = _scrape(stream)
        assert _value(samples, "tq_stream_unit_up", unit="0") == 1
        assert _value(samples, "tq_stream_unit_up", unit="1") == 0
        assert not stream.deployment_stats()["units"][1]["up"]
    finally:
        stream.close()


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_processes_lists_the_servers_of_a_local_deployment(local_stream: tq.Stream) -> None:
    procs = local_stream.processes()
    assert [(p.role, p.index) for p in procs] == [("controller", 0), ("unit", 0), ("unit", 1)]
    assert sorted(p.pid for p in procs) == sorted(local_stream.owner.pids)
    folders = {p.folder for p in procs}
    assert len(folders) == 1 and os.path.isdir(folders.pop())
    other = tq.connect(local_stream.address, config=CONFIG)  # any handle sees the same
    assert other.processes() == procs
    other.close()


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_status_once_shows_a_live_local_deployment(local_stream: tq.Stream) -> None:
    stream = local_stream
    stream.writer("sts").put([f"k{i}" for i in range(6)], {"x": torch.ones(6, 4)})
    client = stream.client()
    client.register_task("sts", "critic", ["x"], batch_size=2)
    meta = client.get_meta("sts", "critic", step=0)
    client.ack(meta)
    before = stream.stats()["sts"]["tasks"]["critic"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    out = subprocess.run([sys.executable, "-m", "tq_stream", "status", stream.address,
                          "--once"], capture_output=True, text=True, env=env,
                         timeout=60, check=True).stdout
    after = stream.stats()["sts"]["tasks"]["critic"]
    assert "sts" in out and "critic" in out
    row = next(line for line in out.splitlines() if "critic" in line)
    cells = [c.strip() for c in row.replace("│", "|").split("|") if c.strip()]
    # partition, task, ready, leased, acked, discarded, ...
    assert cells[:6] == ["sts", "critic", "4", "0", "2", "0"]
    units = [line for line in out.splitlines() if line.strip().startswith(("│ 0", "| 0",
                                                                             "│ 1", "| 1"))]
    assert len(units) == 2 and all("up" in line for line in units)
    assert before == {**after, "at": before["at"], "oldest_ready_age": before[
        "oldest_ready_age"], "rates": before["rates"]}, "status must not change the stream"


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_status_reaches_a_curve_deployment_with_its_key() -> None:
    import io

    from rich.console import Console

    from tq_stream import status

    stream = tq.init(mode="local", storage_units=1, config=CONFIG, curve=True)
    try:
        stream.writer("cv").put(["a"], {"x": torch.ones(1, 2)})
        console = Console(file=io.StringIO(), width=120, color_system=None)
        code = status.main(stream.address, console=console,
                           curve_server_key=stream.curve_server_key)
    finally:
        stream.close()
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert code == 0 and "cv" in out and "up" in out
