"""MetricsServer: an HTTP endpoint serving one stream's metrics from their own registry."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tq_stream.metrics.collector import StreamCollector
from tq_stream.metrics.extra import check_port

if TYPE_CHECKING:
    from tq_stream.connection.connection import Connection

JOIN_TIMEOUT = 5.0  # seconds close() waits for the server thread


class MetricsServer:
    """Serves ``/metrics`` on ``host:port`` (0: a free port) in a daemon thread.

    Args:
        connection: the connection whose deployment is measured.
        port: TCP port; 0 picks a free one (read ``endpoint``).
        host: address to bind; loopback by default (a scraper elsewhere needs
            an explicit ``"0.0.0.0"``).
    """

    def __init__(self, connection: Connection, port: int = 0, host: str = "127.0.0.1") -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        check_port(port)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StreamCollector(connection))
        server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self._server: Any = server
        self.host = host
        self.port: int = self._server.server_port

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=JOIN_TIMEOUT)
        self._server = None
