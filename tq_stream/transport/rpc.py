"""The RPC transport an address names: ``unix://`` or a zmq endpoint (``tcp://``, ``ipc://``).

Deployments build servers and clients through these two functions, so an
address alone decides the transport, in every process that receives it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from tq_stream.errors import ConfigError
from tq_stream.transport.base import Transport
from tq_stream.transport.handler import Handler

UNIX = "unix://"


def rpc_client(address: str, *, timeout: float, curve_server_key: bytes | None = None,
               connect_window: float | None = None,
               check_alive: Callable[[], None] | None = None) -> Transport:
    """A client for the server at ``address``; ``connect_window`` bounds how long a call
    retries a unix server that does not accept (zmq reconnects in the background);
    ``check_alive`` raises when nothing will serve at ``address`` again (a waiting call
    then stops, see ``tq_stream.connection.owner_watch``)."""
    if isinstance(address, str) and address.startswith(UNIX):
        from tq_stream.transport.unix_client import UnixRpcClient

        return UnixRpcClient(address, timeout=timeout, curve_server_key=curve_server_key,
                             connect_window=connect_window, check_alive=check_alive)
    from tq_stream.transport.zeromq import RpcClient

    return RpcClient(address, timeout=timeout, curve_server_key=curve_server_key,
                     check_alive=check_alive)


def rpc_server(handler: Handler, address: str, *, workers: int, backlog: int,
               curve_secret_key: bytes | None = None, owner_token: str | None = None,
               max_message: int | None = None, allow_insecure: bool = False,
               wait_caps: Mapping[str, int] | None = None) -> Any:
    """A started server of ``handler`` at ``address`` (``.address``, ``.close(timeout)``).

    ``workers`` bounds the calls either server runs at once, ``backlog`` the calls
    that may wait for a worker; ``owner_token`` authorizes admin calls
    (``tq_stream.transport.dispatch``; None: no admin call is served);
    ``max_message`` bounds the bytes of one request (None: the server's default);
    ``allow_insecure`` lets a zmq server bind a non-loopback tcp address without CURVE;
    ``wait_caps`` bounds the calls of each wait class that run at once (the others are
    parked, see ``tq_stream.transport.wait_slots``).
    """
    bound: dict[str, Any] = {"wait_caps": wait_caps}
    if max_message is not None:
        bound["max_message"] = max_message
    if isinstance(address, str) and address.startswith(UNIX):
        if curve_secret_key is not None:
            raise ConfigError(f"curve needs the zmq transport (tcp/ipc), got address "
                              f"{address!r}")
        from tq_stream.transport.unix_server import UnixRpcServer

        return UnixRpcServer(handler, address, workers=workers, owner_token=owner_token,
                             **bound).start()
    from tq_stream.transport.zeromq import RpcServer

    return RpcServer(handler, address, workers=workers, backlog=backlog,
                     curve_secret_key=curve_secret_key, owner_token=owner_token,
                     allow_insecure=allow_insecure, **bound).start()
