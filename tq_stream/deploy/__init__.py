"""Starting a deployment (``init``) and joining one (``connect``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tq_stream.config import StreamConfig, check_units
from tq_stream.errors import ConfigError

if TYPE_CHECKING:  # imported when used: a server process never needs it (nor tensordict)
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
        from tq_stream.stream import Stream

        if options:
            raise ConfigError(f"embedded mode takes no options, got {sorted(options)}")
        backend = EmbeddedBackend(n, restore)
        return Stream(backend, config, mode, owner=backend)
    if mode in ("local", "ray"):
        from tq_stream.deploy import remote

        return remote.start(mode, n, restore, config, **options)
    raise ConfigError(f"mode must be one of {MODES}, got {mode!r}")


def connect(address: str | None = None, config: StreamConfig | None = None,
            curve_server_key: bytes | None = None, name: str = "tq_stream",
            namespace: str = "tq_stream") -> Stream:
    """Join a running local or Ray deployment from any process.

    Args:
        address: the controller's zmq address (``stream.address``); None looks up the
            Ray deployment ``name`` in ``namespace`` (inside a Ray job).
        curve_server_key: the deployment's public key when it requires CURVE.
    """
    from tq_stream.deploy import remote

    if address is None:
        from tq_stream.deploy.ray_deploy import controller_address

        address = controller_address(name, namespace)
    return remote.connect(address, config or StreamConfig(), curve_server_key)
