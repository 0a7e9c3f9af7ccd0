"""What only the unix-socket RPC transport (local mode's default) does; the behaviours
every transport shares are in ``tests/helpers/transport_contract.py``
(``tests/integration/transport/test_transport_contract.py``)."""

from __future__ import annotations

import os
import select
import socket
import struct
import threading
import time

import pytest

from tests.helpers.rpc_handler import handler, wait_until
from tq_stream.errors import (
    ConfigError,
    RemoteError,
    WaitTimeout,
)
from tq_stream.serialization import decode, encode
from tq_stream.transport.replies import BUSY
from tq_stream.transport.rpc import rpc_client, rpc_server
from tq_stream.transport.unix_client import UnixRpcClient
from tq_stream.transport.unix_frames import (
    MAX_FRAMES,
    Reader,
    TimedOut,
    nonblocking,
    ready,
    send_message,
)
from tq_stream.transport.unix_server import UnixRpcServer

__all__ = ["handler"]  # the fixture, imported for pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture
def address(tmp_path):
    return f"unix://{tmp_path}/rpc.sock"


@pytest.fixture
def server(handler, address):
    with UnixRpcServer(handler, address) as srv:
        yield srv


@pytest.fixture
def client(server):
    with UnixRpcClient(server.address, timeout=5) as c:
        yield c


def raw_request(address, frames_bytes: bytes) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(address[len("unix://"):])
    sock.sendall(frames_bytes)
    return sock






def test_a_missing_server_is_named_and_close_removes_the_socket_file(handler, address):
    with UnixRpcClient(address, timeout=0.2) as c:
        with pytest.raises(WaitTimeout, match="no server at"):
            c.call("echo", {})
        srv = UnixRpcServer(handler, address).start()
        assert c.call("echo", {"value": 1}) == 1
        srv.close()
        assert not os.path.exists(address[len("unix://"):])


def test_bad_addresses_and_bounds_are_refused(handler, address, tmp_path):
    with pytest.raises(ConfigError, match="unix:///path"):
        UnixRpcClient("tcp://127.0.0.1:9")
    with pytest.raises(ConfigError, match="at most 100 bytes"):
        UnixRpcServer(handler, "unix://" + "/x" * 60)
    with pytest.raises(ConfigError, match="max_connections"):
        UnixRpcServer(handler, f"unix://{tmp_path}/other", max_connections=0)
    with pytest.raises(ConfigError, match="not encrypted"):
        rpc_client(address, timeout=1, curve_server_key=b"k" * 40)
    with pytest.raises(ConfigError, match="curve needs the zmq transport"):
        rpc_server(handler, address, workers=1, backlog=1, curve_secret_key=b"k" * 40)


def test_a_socket_file_left_by_a_killed_server_is_taken_over(handler, address):
    path = address[len("unix://"):]
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)  # a file no one listens on, as a SIGKILLed server leaves it
    dead.close()
    assert os.path.exists(path)
    with UnixRpcServer(handler, address), UnixRpcClient(address, timeout=5) as c:
        assert c.call("echo", {"value": 1}) == 1
        with pytest.raises(ConfigError, match="cannot be bound"):
            UnixRpcServer(handler, address)  # a live server keeps its address



def test_connections_beyond_the_bound_are_refused_busy(handler, address):
    with UnixRpcServer(handler, address, max_connections=1) as srv, \
            UnixRpcClient(address, timeout=5) as c:
        results = []
        caller = threading.Thread(target=lambda: results.append(c.call("block",
                                                                       {"timeout": 5})))
        caller.start()
        assert handler.entered.wait(5)
        with pytest.raises(RemoteError, match="connections") as info:
            c.call("echo", {"value": 1})
        assert info.value.kind == BUSY and srv.connections == 1
        handler.release.set()
        caller.join(5)
        assert results == [True] and c.call("echo", {"value": 2}) == 2


def test_malformed_input_closes_only_that_connection(server, client, address):
    bad_count = raw_request(address, struct.pack("<I", MAX_FRAMES + 1))
    assert bad_count.recv(16) == b""  # the server hung up on it
    bad_count.close()
    # A well-framed request with a bad header gets an error reply naming the problem.
    frames = encode({"id": 7, "method": 5, "args": {}})
    head = struct.pack("<I", len(frames)) + b"".join(struct.pack("<Q", len(f)) for f in frames)
    sock = raw_request(address, head + b"".join(bytes(f) for f in frames))
    size = struct.unpack("<Q", sock.recv(12)[4:])[0]
    reply = decode([sock.recv(size)])
    assert reply["id"] == 7 and reply["ok"] is False
    assert reply["error"]["kind"] == "SerializationError" and "'method'" in \
        reply["error"]["message"]
    sock.close()
    garbage = raw_request(address, struct.pack("<IQ", 1, 5) + b"\xc1\xc1\xc1\xc1\xc1")
    garbage.close()  # not msgpack and no id: dropped without an answer
    with pytest.raises(Exception, match="frames"):
        send_message(socket.socket(socket.AF_UNIX), [b""] * (MAX_FRAMES + 1), time.monotonic() + 5)
    assert client.call("echo", {"value": "alive"}) == "alive"



@pytest.mark.timeout(30)  # the call's own timeout is 120 s: only the window ends it sooner
def test_a_dead_server_fails_a_call_after_the_connect_window(tmp_path):
    path = str(tmp_path / "dead")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)  # its socket file stays, nothing listens: a killed server's
    stale.close()
    with UnixRpcClient(f"unix://{path}", timeout=120, connect_window=0.5) as c:
        with pytest.raises(WaitTimeout, match=r"no server at .* \(ConnectionRefusedError\)"):
            c.call("echo", {"value": 1})


@pytest.mark.timeout(30)
def test_an_address_whose_folder_is_gone_fails_at_once(tmp_path):
    address = f"unix://{tmp_path}/gone/controller"
    with UnixRpcClient(address, timeout=120) as c:
        with pytest.raises(WaitTimeout, match="its folder does not exist"):
            c.call("ping", {})


def test_a_pooled_connection_the_server_closed_is_replaced_unseen(handler, address,
                                                                   monkeypatch):
    """A recently used connection is taken without checking for a hang-up: if the server
    closed it (idle timeout, or room for a new connection), the call goes on a new one."""
    from tq_stream.transport import unix_client, unix_server

    monkeypatch.setattr(unix_client, "RECENT", 3600.0)  # never check
    monkeypatch.setattr(unix_server, "_SWEEP", 0.05)
    with UnixRpcServer(handler, address, idle_timeout=0.1) as srv, \
            UnixRpcClient(address, timeout=5) as c:
        assert c.call("echo", {"value": 1}) == 1
        wait_until(lambda: srv.connections == 0)  # the server closed the pooled one
        assert [c.call("echo", {"value": v}) for v in range(2, 6)] == [2, 3, 4, 5]


def test_frames_on_nonblocking_sockets_wait_for_room_and_data_within_the_deadline():
    a, b = (nonblocking(s) for s in socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM))
    try:
        reader = Reader(b)
        with pytest.raises(TimedOut) as info:  # nothing sent: an idle timeout
            reader.read(time.monotonic() + 0.05)
        assert info.value.idle
        big = os.urandom(8 << 20)  # far more than the socket buffer takes at once
        got = []
        slow = threading.Thread(target=lambda: (time.sleep(0.2),
                                                got.append(reader.read(time.monotonic() + 10))))
        slow.start()
        send_message(a, [b"head", big], time.monotonic() + 10)  # waits for the reader
        slow.join(10)
        assert bytes(got[0][0]) == b"head" and bytes(got[0][1]) == big
        with pytest.raises(TimeoutError):  # nobody reads: the send gives up at its deadline
            send_message(a, [big], time.monotonic() + 0.2)
    finally:
        a.close()
        b.close()


def test_a_call_may_wait_longer_than_a_poll_can(server, address):
    """A timeout of months (callers pass 1e7 for "no limit") is polled in bounded slices
    (it raised OverflowError: a single poll takes at most ~24.8 days)."""
    with UnixRpcClient(address, timeout=1e7) as c:
        assert c.call("sleep", {"seconds": 0.05}) == 0.05
        assert c.call("echo", {"value": 3}, timeout=1e9) == 3


def test_readiness_is_seen_on_descriptors_above_1023():
    """select() cannot watch a descriptor above 1023 (the server's wait for a caller's
    next request then saw nothing); poll can."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if max(soft, hard) < 1100:
        pytest.skip("needs more than 1,100 open files")
    if soft < 1100:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1100, hard))
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        fd = os.dup2(b.fileno(), 1050)
        high = socket.socket(fileno=fd)
        try:
            assert not ready(high, select.POLLIN, 0)
            a.sendall(b"x")
            assert ready(high, select.POLLIN, 1.0)
            with pytest.raises(ValueError):
                select.select([high], [], [], 0)  # what the server used before
        finally:
            high.close()
    finally:
        a.close()
        b.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
