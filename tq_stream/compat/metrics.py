"""A Prometheus text endpoint of ``stream.stats()`` (``metrics.enabled`` in the config).

Serves ``GET /metrics`` on loopback from a daemon thread: rows and capacity per
partition and the per-task counters, as gauges labelled by partition (and task).
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

HOST = "127.0.0.1"


def render(stats: dict[str, Any]) -> str:
    """Prometheus exposition text of a ``stream.stats()`` result."""
    lines = []
    for part, s in sorted(stats.items()):
        lines.append(f'tq_stream_rows{{partition="{part}"}} {s["rows"]}')
        if s.get("capacity") is not None:
            lines.append(f'tq_stream_capacity{{partition="{part}"}} {s["capacity"]}')
        for task, counters in sorted(s.get("tasks", {}).items()):
            for name, value in sorted(counters.items()):
                if isinstance(value, int | float) and not isinstance(value, bool):
                    lines.append(f'tq_stream_task_{name}{{partition="{part}",task="{task}"}} '
                                 f'{value}')
    return "\n".join(lines) + "\n"


class MetricsServer:
    """Serves ``render(stream.stats())`` at ``http://<endpoint>/metrics``."""

    def __init__(self, stream: Any, port: int = 0) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path.rstrip("/") != "/metrics":
                    self.send_error(404)
                    return
                body = render(stream.stats()).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer((HOST, port), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"{HOST}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.5}, daemon=True,
                                        name="tq_compat_metrics")
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
