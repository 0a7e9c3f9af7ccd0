"""Whether metrics can be served: the optional extra is installed, the port is valid."""

from __future__ import annotations

from types import ModuleType

from tq_stream.errors import ConfigError

EXTRA_HINT = "pip install 'tq_stream[metrics]'"


def require_prometheus() -> ModuleType:
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


def check_port(port: object) -> int:
    """``port`` if it is a TCP port number or 0 (any free port), else ConfigError."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
        raise ConfigError(f"metrics_port must be an int in [0, 65536), got {port!r}")
    return port
