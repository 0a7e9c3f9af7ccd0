"""The transport contract (``tests/helpers/transport_contract.py``) on both socket transports:
unix stream sockets (local mode's default) and zmq (tcp, loopback, random ports). What
only one of them does is in ``test_transport_unix.py`` / ``test_transport_zmq.py``."""

from __future__ import annotations

import pytest

from tests.helpers.rpc_handler import handler
from tests.helpers.transport_contract import SocketContract
from tq_stream.transport.unix_client import UnixRpcClient
from tq_stream.transport.unix_server import UnixRpcServer
from tq_stream.transport.zeromq import RpcClient, RpcServer

__all__ = ["handler"]  # the fixture, imported for pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture
def server(handler, make_server):
    with make_server(handler) as srv:
        yield srv


@pytest.fixture
def client(server, make_client):
    with make_client(server.address, timeout=5) as c:
        yield c


@pytest.fixture
def where(server):
    return server.address


class TestUnix(SocketContract):
    @pytest.fixture
    def make_server(self, tmp_path):
        def make(handler, address=None):
            return UnixRpcServer(handler, address or f"unix://{tmp_path}/rpc.sock")
        return make

    @pytest.fixture
    def make_client(self):
        return UnixRpcClient

    @pytest.fixture
    def free_address(self, tmp_path):
        return f"unix://{tmp_path}/nobody.sock"


class TestZmq(SocketContract):
    @pytest.fixture
    def make_server(self):
        def make(handler, address=None):
            return RpcServer(handler) if address is None else RpcServer(handler, address)
        return make

    @pytest.fixture
    def make_client(self):
        return RpcClient

    @pytest.fixture
    def free_address(self):
        return "tcp://127.0.0.1:1"
