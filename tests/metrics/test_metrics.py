"""Metrics in embedded mode: the timings recorder, the collector's figures against
``stats()``, the optional extra and the endpoint's settings."""

from __future__ import annotations

import subprocess
import sys
import urllib.request

import numpy as np
import pytest
import torch

import tq_stream as tq
from tq_stream.controller.timings import BUCKETS, Histogram, Timings
from tq_stream.errors import ConfigError

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402


def test_histogram_counts_each_value_in_its_bucket() -> None:
    h = Histogram()
    h.observe(np.array([0.0005, 0.001, 0.0011, 7.0, 1e6]))
    counts = h.stats()["counts"]
    assert counts[0] == 2  # <= 0.001 (the bound is inclusive, like Prometheus' le)
    assert counts[1] == 1  # (0.001, 0.0025]
    assert counts[BUCKETS.index(10.0)] == 1
    assert counts[-1] == 1  # above the last bound: +Inf
    assert h.stats()["count"] == 5 and h.stats()["sum"] == pytest.approx(1e6 + 7.0022)


def test_rates_are_rows_per_second_between_samples() -> None:
    t = Timings()
    assert t.rates("p", "t", 0, 0, now=100.0) == {"handed_out": 0.0, "acked": 0.0}
    assert t.rates("p", "t", 50, 20, now=110.0) == {"handed_out": 5.0, "acked": 2.0}
    # samples older than the window drop out: the rate follows the recent pace
    t.rates("p", "t", 50, 20, now=175.0)
    assert t.rates("p", "t", 80, 20, now=180.0)["handed_out"] == pytest.approx(30 / 5)


def _scrape(stream: tq.Stream) -> dict:
    text = urllib.request.urlopen(f"http://{stream.metrics_endpoint}/metrics",
                                  timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_embedded_endpoint_matches_stats() -> None:
    stream = tq.init(storage_units=2, metrics_port=0)
    try:
        stream.create_partition("p", consumers=["t"])  # acked rows are freed
        stream.writer("p").put([f"k{i}" for i in range(8)], {"x": torch.ones(8, 4)})
        client = stream.client()
        client.register_task("p", "t", ["x"], batch_size=3)
        client.ack(client.get_meta("p", "t", step=0))
        meta = client.get_meta("p", "t", step=1)
        samples = _scrape(stream)
        stats = stream.stats()["p"]
        units = stream.deployment_stats()["units"]
    finally:
        stream.close()
    assert list(meta.keys) == ["k3", "k4", "k5"]
    pt = (("partition", "p"), ("task", "t"))
    assert samples["tq_stream_rows_acked_total", pt] == stats["tasks"]["t"]["acked"] == 3
    assert samples["tq_stream_rows_leased", pt] == 3
    assert samples["tq_stream_rows_ready", pt] == 2
    assert samples["tq_stream_rows", (("partition", "p"),)] == stats["rows"] == 5
    hist = stats["tasks"]["t"]["write_to_handout"]
    assert hist["count"] == 6
    buckets = [v for (name, labels), v in samples.items()
               if name == "tq_stream_write_to_handout_seconds_bucket" and ("partition", "p")
               in labels]
    assert sorted(buckets)[-1] == 6  # the +Inf bucket holds every observation
    for u in units:
        key = (("field", "x"), ("partition", "p"), ("unit", str(u["unit"])))
        assert samples["tq_stream_unit_field_bytes", key] == u["partitions"]["p"]["fields"]["x"]
    assert sum(u["partitions"]["p"]["rows"] for u in units) == 8 - 3  # acked rows freed


def test_endpoint_closes_with_the_stream() -> None:
    stream = tq.init(metrics_port=0)
    url = f"http://{stream.metrics_endpoint}/metrics"
    stream.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=5)
    assert tq.init().metrics_endpoint is None


@pytest.mark.parametrize("port", [-1, 70000, "80", True])
def test_metrics_port_must_be_a_port(port: object) -> None:
    with pytest.raises(ConfigError, match="metrics_port must be an int"):
        tq.init(metrics_port=port)  # type: ignore[arg-type]


def test_metrics_without_the_extra_name_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails
    with pytest.raises(ConfigError, match=r"tq_stream\[metrics\]"):
        tq.init(metrics_port=0)


def test_importing_tq_stream_imports_no_prometheus_client() -> None:
    code = "import sys, tq_stream; sys.exit('prometheus_client' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_the_grafana_dashboard_plots_only_exported_metrics() -> None:
    import json
    import re
    from pathlib import Path

    dash = json.loads((Path(__file__).parent.parent.parent / "docs/grafana/tq_stream.json")
                      .read_text())
    used = {m for p in dash["panels"] for t in p["targets"]
            for m in re.findall(r"tq_stream_\w+", t["expr"])}
    stream = tq.init(metrics_port=0)
    try:
        stream.writer("p").put(["a"], {"x": torch.ones(1, 2)})
        stream.client().register_task("p", "t", ["x"], batch_size=1)
        text = urllib.request.urlopen(f"http://{stream.metrics_endpoint}/metrics",
                                      timeout=10).read().decode()
    finally:
        stream.close()
    exported = set()
    for fam in text_string_to_metric_families(text):
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
        exported |= {fam.name + s for s in suffixes.get(fam.type, [""])}
    assert used and used <= exported, sorted(used - exported)


def test_rates_count_from_the_first_hand_out(stream) -> None:
    stream.writer("r").put([f"k{i}" for i in range(4)], {"x": torch.ones(4, 2)})
    client = stream.client()
    client.register_task("r", "t", ["x"], batch_size=2)
    client.ack(client.get_meta("r", "t", step=0))
    rates = stream.stats()["r"]["tasks"]["t"]["rates"]  # the first stats() call
    assert rates["handed_out"] > 0 and rates["acked"] > 0


def test_shared_entries_are_scraped() -> None:
    stream = tq.init(metrics_port=0)
    try:
        w = stream.writer("p")
        w.put_shared(["a", "b"], {"prompt": torch.ones(2, 4)})
        w.put(["a0", "a1", "b0"], {"r": torch.arange(3)}, shared=["a", "a", "b"])
        samples = _scrape(stream)
        shared = stream.stats()["p"]["shared"]
    finally:
        stream.close()
    label = (("partition", "p"),)
    assert samples["tq_stream_shared_entries", label] == shared["entries"] == 2
    assert samples["tq_stream_shared_refs", label] == shared["refs"] == 3
    assert samples["tq_stream_shared_bytes", label] == shared["bytes"] == 2 * 4 * 4
    assert samples["tq_stream_rows", label] == 3


def test_pinned_media_is_scraped() -> None:
    stream = tq.init(metrics_port=0)
    try:
        stream.media.put("p", ["a", "b"], {"image": torch.ones(2, 3, 4)})
        samples = _scrape(stream)
        media = stream.stats()["p"]["media"]
    finally:
        stream.close()
    label = (("partition", "p"),)
    assert samples["tq_stream_media_entries", label] == media["entries"] == 2
    assert samples["tq_stream_media_bytes", label] == media["bytes"] == 2 * 3 * 4 * 4
