"""StreamCollector: on every scrape, turns ``stats()`` and ``deployment_stats()`` into
Prometheus metric families.

Metrics (labels in braces; no label ever carries a row key):

- ``tq_stream_info{version, mode}`` — always 1
- ``tq_stream_rows{partition}`` — live rows (gauge)
- ``tq_stream_capacity_rows{partition}`` — bound of a bounded partition (gauge)
- ``tq_stream_rows_created_total{partition}`` — rows written (created)
- ``tq_stream_writer_blocked_seconds_total{partition, reason}`` — writers blocked at
  ``capacity`` (reserve), by ``admission`` (Writer.reserve) or by a unit's
  ``memory_budget`` (the writer's pauses between its puts again)
- ``tq_stream_rows_ready{partition, task}`` — rows available to the task (gauge)
- ``tq_stream_rows_leased{partition, task}`` — rows handed out, not acked (gauge)
- ``tq_stream_rows_handed_out_total{partition, task}``
- ``tq_stream_rows_acked_total{partition, task}``
- ``tq_stream_rows_discarded_total{partition, task, reason}``
- ``tq_stream_oldest_ready_age_seconds{partition, task}`` — the lag a consumer waits behind
- ``tq_stream_rows_not_ready{partition, task}`` — rows not handed out that are not ready;
  ``tq_stream_rows_lacking{partition, task, kind, name}`` — of those, the rows lacking
  field or tag ``name`` (``kind`` "field" / "tag") (gauges)
- ``tq_stream_lease_heartbeat_age_seconds{partition, task}`` — the longest a claim on a
  share has gone without a heartbeat (a dead consumer's grows; gauge)
- ``tq_stream_lease_renewals_total``, ``tq_stream_lease_expiries_total``,
  ``tq_stream_rows_redelivered_total{partition, task}``
- ``tq_stream_get_meta_wait_seconds{partition, task}`` — histogram
- ``tq_stream_write_to_handout_seconds{partition, task}`` — histogram
- ``tq_stream_unit_up{unit}`` — 1 when the unit answered the scrape
- ``tq_stream_unit_bytes{unit}``, ``tq_stream_unit_field_bytes{unit, partition, field}``,
  ``tq_stream_unit_rows{unit, partition}`` — storage held (gauges)
- ``tq_stream_rpc_calls_total{server, method}``,
  ``tq_stream_rpc_errors_total{server, method, error}`` — per server process
  (``controller``, ``unit0``, ...; none in embedded mode)
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from tq_stream._version import __version__
from tq_stream.connection.connection import Connection
from tq_stream.connection.observe import deployment_stats
from tq_stream.stats import DeploymentStats, HistogramStats, PartitionStats, RpcStats

logger = logging.getLogger(__name__)
P = "tq_stream_"
PT = ["partition", "task"]


def _hist_buckets(h: HistogramStats) -> list[tuple[str, float]]:
    """Cumulative ``(le, count)`` pairs of a ``HistogramStats``, ending with +Inf."""
    out: list[tuple[str, float]] = []
    total = 0
    for bound, n in zip([*h["buckets"], float("inf")], h["counts"], strict=True):
        total += n
        out.append(("+Inf" if bound == float("inf") else repr(float(bound)), float(total)))
    return out


class StreamCollector(Collector):
    """A custom collector over one deployment's connection (see module docstring)."""

    def __init__(self, connection: Connection) -> None:
        self._conn = connection

    def collect(self) -> Iterator[Metric]:
        try:
            stats: dict[str, PartitionStats] = self._conn.controller().stats()
            servers = deployment_stats(self._conn)
        except Exception as exc:  # the controller is gone: a scrape shows only info
            logger.warning("metrics scrape could not read the deployment: %s", exc)
            stats, servers = {}, None
        info = GaugeMetricFamily(P + "info", "tq_stream version and deployment mode",
                                 labels=["version", "mode"])
        info.add_metric([__version__, self._conn.mode], 1)
        yield info
        yield from _partition_metrics(stats)
        yield from _task_metrics(stats)
        if servers is not None:
            yield from _unit_metrics(servers["units"])
            yield from _rpc_metrics(servers)


def _partition_metrics(stats: dict[str, PartitionStats]) -> Iterator[Metric]:
    rows = GaugeMetricFamily(P + "rows", "Live rows of a partition", labels=["partition"])
    cap = GaugeMetricFamily(P + "capacity_rows", "Row bound of a bounded partition",
                            labels=["partition"])
    created = CounterMetricFamily(P + "rows_created", "Rows written (created) in a partition",
                                  labels=["partition"])
    blocked = CounterMetricFamily(P + "writer_blocked_seconds",
                                  "Seconds writers waited at capacity or for admission",
                                  labels=["partition", "reason"])
    shared = {k: GaugeMetricFamily(P + "shared_" + k, d, labels=["partition"]) for k, d in (
        ("entries", "Shared entries of a partition (put once, named by rows)"),
        ("bytes", "Bytes put into a partition's shared entries"),
        ("refs", "Live rows naming a shared entry"))}
    media = {k: GaugeMetricFamily(P + "media_" + k, d, labels=["partition"]) for k, d in (
        ("entries", "Shared entries media handles pin (Media.put, Media.pin)"),
        ("bytes", "Bytes put into the entries media handles pin"))}
    for name, p in stats.items():
        rows.add_metric([name], p["rows"])
        counts = p["shared"]
        shared["entries"].add_metric([name], counts["entries"])
        shared["bytes"].add_metric([name], counts["bytes"])
        shared["refs"].add_metric([name], counts["refs"])
        media["entries"].add_metric([name], p["media"]["entries"])
        media["bytes"].add_metric([name], p["media"]["bytes"])
        if p["capacity"] is not None:
            cap.add_metric([name], p["capacity"])
        created.add_metric([name], p["rows_created"])
        waits = p["blocked_seconds"]
        blocked.add_metric([name, "capacity"], waits["capacity"])
        blocked.add_metric([name, "admission"], waits["admission"])
        blocked.add_metric([name, "memory_budget"], waits["memory_budget"])
    yield from (rows, cap, created, blocked, *shared.values(), *media.values())


def _task_metrics(stats: dict[str, PartitionStats]) -> Iterator[Metric]:
    gauges = {k: GaugeMetricFamily(P + n, d, labels=PT) for k, n, d in (
        ("available", "rows_ready", "Rows ready for a task and not handed out"),
        ("leased", "rows_leased", "Rows handed out to a task and not acked"),
        ("oldest_ready_age", "oldest_ready_age_seconds",
         "Seconds the oldest ready row of a task has waited"))}
    counters = {k: CounterMetricFamily(P + n, d, labels=PT) for k, n, d in (
        ("handed_out", "rows_handed_out", "Rows handed out to a task (redeliveries too)"),
        ("acked", "rows_acked", "Rows acked by every replica of a task"),
        ("renewed", "lease_renewals", "Lease renewals"),
        ("expired", "lease_expiries", "Leases that ran out"),
        ("redelivered", "rows_redelivered", "Rows handed out again after expiry/release"))}
    discarded = CounterMetricFamily(P + "rows_discarded", "Rows a task dropped, by reason",
                                    labels=[*PT, "reason"])
    hists = {k: HistogramMetricFamily(P + n, d, labels=PT) for k, n, d in (
        ("get_meta_wait", "get_meta_wait_seconds", "Seconds a get_meta call waited for rows"),
        ("write_to_handout", "write_to_handout_seconds",
         "Seconds from a row's last write to its hand-out"))}
    not_ready = GaugeMetricFamily(P + "rows_not_ready", "Rows not handed out to a task "
                                  "and not ready for it", labels=PT)
    lacking = GaugeMetricFamily(P + "rows_lacking", "Rows not ready for a task that lack a "
                                "field or tag", labels=[*PT, "kind", "name"])
    heartbeat = GaugeMetricFamily(P + "lease_heartbeat_age_seconds", "Longest time a claim "
                                  "on a task's share has gone without a heartbeat", labels=PT)
    for pname, p in stats.items():
        for tname, t in p["tasks"].items():
            labels = [pname, tname]
            row: dict[str, Any] = dict(t)
            not_ready.add_metric(labels, t["not_ready"]["rows"])
            for kind, names in (("field", t["not_ready"]["lack_fields"]),
                                ("tag", t["not_ready"]["lack_tags"])):
                for name, n in names.items():
                    lacking.add_metric([*labels, kind, name], n)
            heartbeat.add_metric(labels, max(
                (lease["heartbeat_age"] or 0.0 for lease in t["leases"]), default=0.0))
            for key, gauge in gauges.items():
                gauge.add_metric(labels, float(row[key]))
            for key, counter in counters.items():
                counter.add_metric(labels, float(row.get(key, 0)))
            for reason, n in t["discarded"].items():
                discarded.add_metric([*labels, reason], n)
            for key, hist in hists.items():
                h: HistogramStats = row[key]
                hist.add_metric(labels, _hist_buckets(h), h["sum"])
    yield from gauges.values()
    yield from counters.values()
    yield discarded
    yield from hists.values()
    yield from (not_ready, lacking, heartbeat)


def _unit_metrics(units: list[Any]) -> Iterator[Metric]:
    up = GaugeMetricFamily(P + "unit_up", "1 when the storage unit answered", labels=["unit"])
    nbytes = GaugeMetricFamily(P + "unit_bytes", "Bytes a storage unit holds for rows",
                               labels=["unit"])
    fields = GaugeMetricFamily(P + "unit_field_bytes", "Bytes a unit holds per field",
                               labels=["unit", "partition", "field"])
    rows = GaugeMetricFamily(P + "unit_rows", "Rows a unit holds per partition",
                             labels=["unit", "partition"])
    for u in units:
        unit = str(u["unit"])
        up.add_metric([unit], 1 if u["up"] else 0)
        if not u["up"]:
            continue
        nbytes.add_metric([unit], u["nbytes"])
        for pname, part in u["partitions"].items():
            rows.add_metric([unit, pname], part["rows"])
            for field, b in part["fields"].items():
                fields.add_metric([unit, pname, field], b)
    yield from (up, nbytes, fields, rows)


def _rpc_metrics(servers: DeploymentStats) -> Iterator[Metric]:
    calls = CounterMetricFamily(P + "rpc_calls", "RPC calls a server ran, by method",
                                labels=["server", "method"])
    errors = CounterMetricFamily(P + "rpc_errors", "RPC calls that raised, by error",
                                 labels=["server", "method", "error"])
    sources: list[tuple[str, RpcStats]] = [("controller", servers["controller"]["rpc"])]
    sources += [(f"unit{u['unit']}", u["rpc"]) for u in servers["units"] if u["up"]]
    for server, rpc in sources:
        for method, n in rpc["calls"].items():
            calls.add_metric([server, method.rpartition(".")[2]], n)
        for method, kinds in rpc["errors"].items():
            for kind, n in kinds.items():
                errors.add_metric([server, method.rpartition(".")[2], kind], n)
    yield from (calls, errors)
