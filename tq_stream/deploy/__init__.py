"""Starting a deployment (``init``) and joining one (``connect``)."""

from __future__ import annotations

import inspect
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from tq_stream.config import DEFAULT_LEASE_TIMEOUT, StreamConfig, check_units
from tq_stream.errors import ConfigError, check_timeout

if TYPE_CHECKING:  # imported when used: a server process never needs it (nor tensordict)
    from tq_stream.connection.connection import Connection
    from tq_stream.connection.protocols import Owner
    from tq_stream.connection.remote import RemoteBackend
    from tq_stream.metrics.server import MetricsServer
    from tq_stream.stream import Stream

MODES = ("embedded", "local", "ray")
logger = logging.getLogger(__name__)


def init(mode: str = "embedded", storage_units: int = 1, restore: str | None = None,
         config: StreamConfig | None = None, metrics_port: int | None = None,
         metrics_host: str = "127.0.0.1", lease_timeout: float | None = None,
         **options: Any) -> Stream:
    """Start a deployment and return a Stream handle that owns it.

    Args:
        mode: "embedded" (this process), "local" (child processes) or "ray".
        storage_units: how many storage units rows are spread over.
        restore: a checkpoint folder written by ``stream.save`` to start from (every
            file is checked first: a damaged one raises ``CheckpointError``).
        config: timeouts and lease defaults (``StreamConfig``).
        metrics_port: serve Prometheus metrics of the deployment from this process on
            this port (0: a free one; ``stream.metrics_endpoint`` tells which). Needs
            the ``metrics`` extra.
        metrics_host: the address the metrics endpoint binds (loopback by default).
        lease_timeout: seconds after which the share of a consumer that died (its
            heartbeat went silent) goes to the next reader, and a dead producer's
            reserved rows are aborted (default ``StreamConfig.lease_timeout``, 300 s;
            lower it for faster takeover). The same as
            ``config=StreamConfig(lease_timeout=...)``; every mode.
        options: mode-specific settings (see the mode's module); every mode takes
            ``storage``, the storage units' kind (``tq_stream.backends.kinds.KINDS``:
            "memory", the embedded default, or "shm", the local and Ray default), and
            ``spill_dir``, the folder storage units spill rows under (see
            ``Stream.create_partition(memory_budget=, cold=)``).

    Example:
        >>> stream = tq.init(mode="local", storage_units=2, lease_timeout=30)  # doctest: +SKIP
    """
    config = with_lease_timeout(config, lease_timeout)
    if metrics_port is not None:
        from tq_stream.metrics import check_port, require_prometheus

        require_prometheus()  # fail before starting anything
        check_port(metrics_port)
    started = time.monotonic()
    conn, owner = _start(mode, storage_units, restore, config, options)
    logger.info("started a deployment (%s mode, %d storage units%s) in %.2f s", mode,
                storage_units, f" at {conn.address}" if conn.address else "",
                time.monotonic() - started)
    from tq_stream.stream import Stream

    metrics: MetricsServer | None = None
    if metrics_port is not None:
        from tq_stream.metrics import serve

        try:
            metrics = serve(conn, metrics_port, metrics_host)
        except BaseException:
            Stream(conn, owner).close()
            raise
    return Stream(conn, owner, metrics)


def with_lease_timeout(config: StreamConfig | None,
                       lease_timeout: float | None) -> StreamConfig:
    """``config`` (default: ``StreamConfig()``) with ``lease_timeout`` if given; a config
    that sets another lease_timeout is refused (which one was meant is unknown)."""
    if lease_timeout is None:
        return config or StreamConfig()
    lease_timeout = check_timeout("lease_timeout", lease_timeout)
    if config is not None and config.lease_timeout not in (DEFAULT_LEASE_TIMEOUT,
                                                           lease_timeout):
        raise ConfigError(f"lease_timeout must agree with config.lease_timeout when both are "
                          f"given, got lease_timeout={lease_timeout:g} and "
                          f"config.lease_timeout={config.lease_timeout:g}")
    return replace(config or StreamConfig(), lease_timeout=lease_timeout)


def _start(mode: str, storage_units: int, restore: str | None, config: StreamConfig,
           options: dict[str, Any]) -> tuple[Connection, Owner]:
    n = check_units(storage_units)
    from tq_stream.connection.connection import Connection

    if mode == "embedded":
        from tq_stream.deploy.embedded import EmbeddedBackend

        _check_options(mode, EmbeddedBackend, options)
        backend = EmbeddedBackend(n, restore, **options)
        return Connection(backend, config, mode), backend
    if mode in ("local", "ray"):
        return _start_servers(mode, n, restore, config, options)
    raise ConfigError(f"mode must be one of {MODES}, got {mode!r}")


def _start_servers(mode: str, n_units: int, restore: str | None, config: StreamConfig,
                   options: dict[str, Any]) -> tuple[Connection, Owner]:
    """Start a local or Ray deployment: its connection, and the deployment as its owner."""
    from tq_stream.connection.connection import Connection
    from tq_stream.connection.remote import RemoteBackend

    if mode == "local":
        from tq_stream.deploy.local import LocalDeployment as cls
    else:
        from tq_stream.deploy.ray_deploy import RayDeployment as cls  # type: ignore[assignment]
    _check_options(mode, cls, options)
    owner = cls(n_units, lease_timeout=config.lease_timeout, **options)
    try:
        backend = RemoteBackend(owner.address, config, owner.curve_server_key,
                                owner.owner_token, owner.owner)
        owner.attach(backend)
        if restore is not None:
            from tq_stream.deploy import snapshot

            snapshot.restore(restore, backend.controller(), backend.units())
    except BaseException:
        owner.close()
        raise
    return Connection(backend, config, mode), owner


def _check_options(mode: str, cls: type, options: dict[str, Any]) -> None:
    """Options ``cls`` (the mode's deployment) does not take are refused before anything
    starts, naming what the mode takes."""
    known = set(inspect.signature(cls).parameters) - {"n_units", "restore", "lease_timeout"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(f"options of mode {mode!r} must be among {sorted(known)}, got "
                          f"{unknown} (storage_units, restore, config and metrics_port "
                          f"are tq.init's own)")


def connect(address: str | None = None, config: StreamConfig | None = None,
            curve_server_key: bytes | None = None, name: str = "tq_stream",
            namespace: str = "tq_stream", lease_timeout: float | None = None) -> Stream:
    """Join a running local or Ray deployment from any process.

    Args:
        address: the controller's zmq address (``stream.address``); None looks up the
            Ray deployment ``name`` in ``namespace`` (inside a Ray job).
        curve_server_key: the deployment's public key when it requires CURVE (by name:
            the deployment tells it; one given must be the same).
        lease_timeout: as in ``init``, for the consumers and producers of this handle;
            by default the deployment's own (the ``lease_timeout`` its owner started
            it with), so every joining worker's leases expire alike.
    """
    own_lease = lease_timeout is not None or (
        config is not None and config.lease_timeout != DEFAULT_LEASE_TIMEOUT)
    config = with_lease_timeout(config, lease_timeout)
    from tq_stream.connection.connection import Connection
    from tq_stream.connection.remote import open_backend
    from tq_stream.stream import Stream

    if address is None:
        address, curve_server_key = _by_name(name, namespace, curve_server_key)
    elif address.startswith("embedded://"):  # a MediaRef's address of an embedded deployment
        raise ConfigError(f"address must be a local or Ray deployment's, got {address!r}: an "
                          "embedded deployment lives inside that process and no other can "
                          "join it; start it with mode='local' or 'ray' to share it")
    backend = open_backend(address, config, curve_server_key)
    lease = (backend.owner_watch.owner or {}).get("lease_timeout")
    if not own_lease and isinstance(lease, int | float) and lease > 0:
        config = replace(config, lease_timeout=float(lease))
    return Stream(Connection(backend, config, "remote"), _SocketsOwner(backend))


class _SocketsOwner:
    """Closing a connected handle closes its sockets only, never the deployment."""

    def __init__(self, backend: RemoteBackend) -> None:
        self._backend = backend

    def save(self, path: str) -> None:
        from tq_stream.deploy import snapshot

        snapshot.save(path, self._backend.controller(), self._backend.units())

    def close(self) -> None:
        self._backend.close()


def _by_name(name: str, namespace: str, key: bytes | None) -> tuple[str, bytes | None]:
    """The address and CURVE public key of the Ray deployment ``name``."""
    from tq_stream.deploy.ray_actor import controller_info

    info = controller_info(name, namespace)
    known = (info.get("curve_server_key") or "").encode() or None
    key = key.encode() if isinstance(key, str) else key
    if key is not None and key != known:
        raise ConfigError(f"curve_server_key must be the public key of the Ray deployment "
                          f"{name!r} ({known!r}), or None to use it, got {key!r}")
    return info["address"], known
