"""The RPC transport an address names: ``unix://`` or a zmq endpoint (``tcp://``, ``ipc://``).

Deployments build servers and clients through these two functions, so an
address alone decides the transport, in every process that receives it.
"""

from __future__ import annotations

from typing import Any

from tq_stream.errors import ConfigError
from tq_stream.transport.base import Transport

UNIX = "unix://"


def rpc_client(address: str, *, timeout: float, curve_server_key: bytes | None = None) -> Transport:
    """A client for the server at ``address``."""
    if isinstance(address, str) and address.startswith(UNIX):
        from tq_stream.transport.unix_client import UnixRpcClient

        return UnixRpcClient(address, timeout=timeout, curve_server_key=curve_server_key)
    from tq_stream.transport.zeromq import RpcClient

    return RpcClient(address, timeout=timeout, curve_server_key=curve_server_key)


def rpc_server(handler: Any, address: str, *, workers: int, backlog: int,
               curve_secret_key: bytes | None = None) -> Any:
    """A started server of ``handler`` at ``address`` (``.address``, ``.close(timeout)``).

    ``workers`` bounds the calls a zmq server runs at once; a unix server runs each
    connection's calls in its own thread, up to ``workers + backlog`` connections.
    """
    if isinstance(address, str) and address.startswith(UNIX):
        if curve_secret_key is not None:
            raise ConfigError(f"curve needs the zmq transport (tcp/ipc), got address "
                              f"{address!r}")
        from tq_stream.transport.unix_server import UnixRpcServer

        return UnixRpcServer(handler, address, max_connections=workers + backlog).start()
    from tq_stream.transport.zeromq import RpcServer

    return RpcServer(handler, address, workers=workers, backlog=backlog,
                     curve_secret_key=curve_secret_key).start()
