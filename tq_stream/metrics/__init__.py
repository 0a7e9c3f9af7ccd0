"""Prometheus metrics of a deployment (the optional ``[metrics]`` extra).

``tq.init(..., metrics_port=N)`` serves them over HTTP from the process that owns
the deployment (0 picks a free port; ``stream.metrics_endpoint`` says where). Each
scrape reads ``stream.stats()`` from the controller and ``deployment_stats()`` from
every storage unit, so in local and Ray mode the figures are the servers' own.
The metric names are listed in ``tq_stream.metrics.collector``.

Nothing here imports ``prometheus_client`` until metrics are asked for.
"""

from __future__ import annotations

from typing import Any

from tq_stream.errors import ConfigError

EXTRA_HINT = "pip install 'tq_stream[metrics]'"


def require_prometheus() -> Any:
    """The ``prometheus_client`` module.

    Raises:
        ConfigError: it is not installed (names the extra that installs it).
    """
    try:
        import prometheus_client
    except ImportError:
        raise ConfigError(
            f"metrics need the 'metrics' extra (prometheus_client is not installed): "
            f"{EXTRA_HINT}") from None
    return prometheus_client


def check_port(port: Any) -> int:
    """``port`` if it is a TCP port number or 0 (any free port), else ConfigError."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
        raise ConfigError(f"metrics_port must be an int in [0, 65536), got {port!r}")
    return port


def serve(stream: Any, port: int = 0, host: str = "127.0.0.1") -> Any:
    """Serve ``stream``'s metrics on ``http://host:port/metrics``; returns the
    ``MetricsServer`` (``.endpoint``, ``.close()``)."""
    require_prometheus()
    from tq_stream.metrics.server import MetricsServer

    return MetricsServer(stream, port, host)


__all__ = ["EXTRA_HINT", "check_port", "require_prometheus", "serve"]
