"""Starting a deployment (``init``) and joining one (``connect``)."""

from __future__ import annotations

from tq_stream.config import StreamConfig, check_units
from tq_stream.errors import ConfigError
from tq_stream.stream import Stream

MODES = ("embedded", "local", "ray")


def init(mode: str = "embedded", storage_units: int = 1, restore: str | None = None,
         config: StreamConfig | None = None, **options: object) -> Stream:
    """Start a deployment and return a Stream handle that owns it.

    Args:
        mode: "embedded" (this process), "local" (child processes) or "ray".
        storage_units: how many storage units rows are spread over.
        restore: a checkpoint written by ``stream.save`` to start from.
        config: timeouts and lease defaults (``StreamConfig``).
        options: mode-specific settings (see the mode's module).
    """
    config = config or StreamConfig()
    n = check_units(storage_units)
    if mode == "embedded":
        from tq_stream.deploy.embedded import EmbeddedBackend

        if options:
            raise ConfigError(f"embedded mode takes no options, got {sorted(options)}")
        backend = EmbeddedBackend(n, restore)
        return Stream(backend, config, mode, owner=backend)
    if mode in ("local", "ray"):
        from tq_stream.deploy import remote

        return remote.start(mode, n, restore, config, **options)
    raise ConfigError(f"mode must be one of {MODES}, got {mode!r}")


def connect(address: str, config: StreamConfig | None = None) -> Stream:
    """Join a running local or Ray deployment at ``address`` from any process."""
    from tq_stream.deploy import remote

    return remote.connect(address, config or StreamConfig())
