"""Transports: how a request reaches a handler and its reply comes back.

``Transport`` is the one-method contract; ``InprocTransport`` calls a handler in
process (unit tests, embedded mode). The zmq transport lives in
``tq_stream.transport.zeromq`` and is imported explicitly, so that importing
this package does not import pyzmq.
"""

from tq_stream.transport.base import InprocTransport, Transport
from tq_stream.transport.dispatch import Dispatcher

__all__ = ["Dispatcher", "InprocTransport", "Transport"]
