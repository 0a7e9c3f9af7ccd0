"""Prometheus metrics of a deployment (the optional ``[metrics]`` extra).

``tq.init(..., metrics_port=N)`` serves them over HTTP from the process that owns
the deployment (0 picks a free port; ``stream.metrics_endpoint`` says where). Each
scrape reads ``stream.stats()`` from the controller and ``deployment_stats()`` from
every storage unit, so in local and Ray mode the figures are the servers' own.
The metric names are listed in ``tq_stream.metrics.collector``.

Nothing here imports ``prometheus_client`` until metrics are asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tq_stream.metrics.extra import EXTRA_HINT, check_port, require_prometheus

if TYPE_CHECKING:
    from tq_stream.connection.connection import Connection
    from tq_stream.metrics.server import MetricsServer


def serve(connection: Connection, port: int = 0, host: str = "127.0.0.1") -> MetricsServer:
    """Serve the metrics of ``connection``'s deployment on ``http://host:port/metrics``;
    returns the ``MetricsServer`` (``.endpoint``, ``.close()``)."""
    require_prometheus()
    from tq_stream.metrics.server import MetricsServer

    return MetricsServer(connection, port, host)


__all__ = ["EXTRA_HINT", "check_port", "require_prometheus", "serve"]
