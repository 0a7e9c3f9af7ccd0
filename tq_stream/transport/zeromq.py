"""The zmq transport: RPC server/client and CURVE keys.

Importing this module imports pyzmq; ``import tq_stream`` does not.

Usage (a handler is any object with an ``RPC_TABLE``, ``transport/handler.py``):

    server = RpcServer(handler, "tcp://127.0.0.1:0").start()
    client = RpcClient(server.address, timeout=30)
    client.call("method", {"arg": value}, timeout=10)
    client.close(); server.close()
"""

from tq_stream.transport.replies import BUSY
from tq_stream.transport.zmq_client import RpcClient
from tq_stream.transport.zmq_security import generate_keys, public_key
from tq_stream.transport.zmq_server import RpcServer

__all__ = [
    "BUSY",
    "RpcClient",
    "RpcServer",
    "generate_keys",
    "public_key",
]
