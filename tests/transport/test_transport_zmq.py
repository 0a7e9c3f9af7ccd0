"""What only the zmq transport does (loopback, random ports): ipc addresses, a hand-driven
server, the backlog bound, malformed frames, address checks and CURVE. The behaviours every
transport shares are in ``tests/helpers/transport_contract.py``
(``tests/integration/transport/test_transport_contract.py``)."""

from __future__ import annotations

import threading

import pytest
import zmq

from tests.helpers.rpc_handler import handler, wait_until
from tq_stream.errors import (
    ConfigError,
    RemoteError,
    SerializationError,
    WaitTimeout,
)
from tq_stream.serialization import decode, encode
from tq_stream.transport.zeromq import (
    BUSY,
    RpcClient,
    RpcServer,
    generate_keys,
    public_key,
)

__all__ = ["handler"]  # the fixture, imported for pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]


@pytest.fixture
def server(handler):
    with RpcServer(handler) as srv:
        yield srv


@pytest.fixture
def client(server):
    with RpcClient(server.address, timeout=5) as c:
        yield c


# ----------------------------------------------------------------- addresses


def test_the_default_address_is_loopback_tcp(server):
    assert server.address.startswith("tcp://127.0.0.1:")


def test_ipc_address(tmp_path, handler):
    with RpcServer(handler, f"ipc://{tmp_path}/rpc.sock") as srv:
        assert srv.address == f"ipc://{tmp_path}/rpc.sock"
        with RpcClient(srv.address, timeout=5) as c:
            assert c.call("echo", {"value": [1, 2]}) == [1, 2]


# ----------------------------------------------------------------- replies


def test_client_returns_only_the_reply_to_its_own_request():
    ctx = zmq.Context()
    fake = ctx.socket(zmq.ROUTER)  # a hand-driven server
    fake.linger = 0
    try:
        fake.bind("tcp://127.0.0.1:0")
        with RpcClient(fake.getsockopt_string(zmq.LAST_ENDPOINT), timeout=5) as c:
            result = []
            caller = threading.Thread(target=lambda: result.append(c.call("echo", {})))
            caller.start()
            assert fake.poll(5000)
            identity, _, *frames = fake.recv_multipart()
            req_id = decode(frames)["id"]
            stale = encode({"id": req_id - 1, "ok": True, "result": "stale"})
            fresh = encode({"id": req_id, "ok": True, "result": "fresh"})
            fake.send_multipart([identity, b"no delimiter"])
            fake.send_multipart([identity, b"", *stale])
            fake.send_multipart([identity, b"", *fresh])
            caller.join(5)
            assert result == ["fresh"]
            caller = threading.Thread(
                target=lambda: result.append(pytest.raises(SerializationError, c.call, "echo", {}))
            )
            caller.start()
            assert fake.poll(5000)
            identity, _, *frames = fake.recv_multipart()
            fake.send_multipart([identity, b"", b"\xc1 not a header"])
            caller.join(5)
            assert "malformed reply from tcp://127.0.0.1" in str(result[1].value)
    finally:
        fake.close()
        ctx.term()


# ----------------------------------------------------------------- bounds


def test_full_backlog_replies_busy(handler):
    with RpcServer(handler, workers=1, backlog=1) as srv, RpcClient(srv.address, timeout=5) as c:
        results = []
        callers = [
            threading.Thread(target=lambda: results.append(c.call("block", {"timeout": 5})))
            for _ in range(2)
        ]
        callers[0].start()
        assert handler.entered.wait(5)
        callers[1].start()
        wait_until(lambda: srv.pending == 1)
        with pytest.raises(RemoteError, match="busy") as info:
            c.call("echo", {"value": 1})
        assert info.value.kind == BUSY
        handler.release.set()
        for t in callers:
            t.join(5)
        assert results == [True, True]


# ----------------------------------------------------------------- robustness


def test_bad_addresses_and_bounds_are_refused(handler):
    with pytest.raises(ConfigError, match="zmq endpoint"):
        RpcClient("localhost:9")
    with pytest.raises(ConfigError, match="workers"):
        RpcServer(handler, workers=0)
    with pytest.raises(ConfigError, match="zmq endpoint"):
        RpcServer(handler, 5555)


def test_malformed_frames_do_not_kill_the_server(server, client):
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.linger = 0
    try:
        raw.connect(server.address)
        garbage = [
            [b"no delimiter"],
            [b""],
            [b"", b"not msgpack \xc1"],
            [b"", b"\x94\xa3tqs\x01\x09\xc0"],  # announces 9 frames
            [b"", *encode({"id": 1})[:1], b"extra frame"],
            [b"", *encode(["not", "a", "dict"])],
            [b"", *encode({"method": "echo", "args": {}})],  # no id: nothing to answer
            [b"x", b"y", b"z"],
        ]
        for frames in garbage:
            raw.send_multipart(frames)
        # A request with an id but bad fields gets an error reply naming the problem.
        raw.send_multipart([b"", *encode({"id": 7, "method": 5, "args": {}})])
        assert raw.poll(5000)
        reply = decode(raw.recv_multipart()[1:])
        assert reply["id"] == 7 and reply["ok"] is False
        assert reply["error"]["kind"] == "SerializationError"
        assert "'method'" in reply["error"]["message"]
        assert not raw.poll(200)  # nothing else was answered
        assert client.call("echo", {"value": "alive"}) == "alive"
    finally:
        raw.close()
        ctx.term()


# ----------------------------------------------------------------- CURVE


def test_curve_accepts_clients_with_the_server_key_and_rejects_others(handler):
    server_public, server_secret = generate_keys()
    assert public_key(server_secret) == server_public
    with RpcServer(handler, curve_secret_key=server_secret) as srv:
        with RpcClient(srv.address, timeout=5, curve_server_key=server_public) as good:
            assert good.call("echo", {"value": "secret"}) == "secret"
        with RpcClient(srv.address, timeout=0.3) as plain:
            with pytest.raises(WaitTimeout):
                plain.call("echo", {"value": 1})
        wrong_public, _ = generate_keys()
        with RpcClient(srv.address, timeout=0.3, curve_server_key=wrong_public) as wrong:
            with pytest.raises(WaitTimeout):
                wrong.call("echo", {"value": 1})


def test_curve_client_allowlist(handler):
    server_public, server_secret = generate_keys()
    allowed_public, allowed_secret = generate_keys()
    with RpcServer(
        handler, curve_secret_key=server_secret, curve_client_keys=[allowed_public]
    ) as srv:
        keys = {"curve_public_key": allowed_public, "curve_secret_key": allowed_secret}
        with RpcClient(srv.address, timeout=5, curve_server_key=server_public, **keys) as ok:
            assert ok.call("echo", {"value": 1}) == 1
        with RpcClient(srv.address, timeout=0.3, curve_server_key=server_public) as other:
            with pytest.raises(WaitTimeout):
                other.call("echo", {"value": 1})
