"""Transports: how a request reaches a handler and its reply comes back.

``Transport`` is the one-method contract; ``InprocTransport`` calls a handler in
process (unit tests drive services through it, allow-list and admin calls as over a
socket). The socket transports are imported
explicitly, so that importing this package imports neither: unix stream sockets
(``unix_server``/``unix_client``, same host only, local mode's default) and zmq
(``tq_stream.transport.zeromq``: tcp/ipc, CURVE, across hosts).
``tq_stream.transport.rpc`` picks one from an address's scheme.
"""

from tq_stream.transport.base import InprocTransport, Transport
from tq_stream.transport.dispatch import Dispatcher
from tq_stream.transport.handler import Handler, Methods, RpcDeclaration

__all__ = ["Dispatcher", "Handler", "InprocTransport", "Methods", "RpcDeclaration", "Transport"]
