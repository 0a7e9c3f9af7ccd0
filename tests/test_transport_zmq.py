"""Integration tests of the zmq transport over real sockets (loopback, random ports)."""

from __future__ import annotations

import multiprocessing
import pickle
import threading
import time

import numpy as np
import pytest
import torch
import zmq
from rpc_handler import Handler, wait_until

from tq_stream.columns import Ragged
from tq_stream.errors import (
    ClosedError,
    ConfigError,
    KeyConflictError,
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

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]


@pytest.fixture
def handler():
    h = Handler()
    yield h
    h.release.set()


@pytest.fixture
def server(handler):
    with RpcServer(handler) as srv:
        yield srv


@pytest.fixture
def client(server):
    with RpcClient(server.address, timeout=5) as c:
        yield c


# ----------------------------------------------------------------- basic calls


def test_roundtrip_with_tensors(client, server):
    assert server.address.startswith("tcp://127.0.0.1:")
    value = {
        "t": torch.randn(256, 128).to(torch.bfloat16),
        "mask": torch.rand(64) > 0.5,
        "ids": torch.arange(10, dtype=torch.int8),
        "empty": torch.zeros(0, 4),
        "r": Ragged.from_list([torch.ones(3), torch.ones(1)]),
        "a": np.arange(5),
        "meta": ("k", [1, None, b"x"]),
    }
    out = client.call("echo", {"value": value})
    assert out.keys() == value.keys()
    for name in ("t", "mask", "ids", "empty"):
        assert out[name].dtype == value[name].dtype and torch.equal(out[name], value[name])
    assert torch.equal(out["r"].values, value["r"].values)
    assert np.array_equal(out["a"], value["a"])
    assert out["meta"] == ("k", [1, None, b"x"])


def test_large_tensor_roundtrip(client):
    t = torch.randn(1024, 4096)  # 16 MB in one frame
    assert torch.equal(client.call("echo", {"value": t}), t)


def test_ipc_address(tmp_path, handler):
    with RpcServer(handler, f"ipc://{tmp_path}/rpc.sock") as srv:
        assert srv.address == f"ipc://{tmp_path}/rpc.sock"
        with RpcClient(srv.address, timeout=5) as c:
            assert c.call("echo", {"value": [1, 2]}) == [1, 2]


def test_handler_errors_keep_their_class(client, server):
    with pytest.raises(KeyConflictError, match="duplicate key 'k'") as info:
        client.call("fail", {"message": "duplicate key 'k'"})
    assert server.address in info.value.__notes__[0]
    with pytest.raises(RemoteError) as info:
        client.call("crash")
    assert info.value.kind == "ZeroDivisionError"
    assert info.value.where == server.address
    assert "1 / 0" in info.value.__notes__[-1]  # remote traceback


def test_allowlist_is_enforced(client):
    for method in ("secret", "__init__", "_dispatch", "missing"):
        with pytest.raises(ConfigError, match="method must be one of"):
            client.call(method, {})
    with pytest.raises(ConfigError, match="unexpected keyword argument 'x'"):
        client.call("echo", {"x": 1})


def test_unserializable_args_and_results():
    class Odd:
        RPC_METHODS = frozenset({"odd", "ok"})

        def odd(self, x=None):
            return object()

        def ok(self):
            return "ok"

    with RpcServer(Odd()) as srv, RpcClient(srv.address, timeout=5) as c:
        with pytest.raises(SerializationError, match="cannot serialize object"):
            c.call("odd")  # the server could not encode its result
        with pytest.raises(SerializationError, match="cannot serialize set"):
            c.call("odd", {"x": {1}})  # refused before sending
        assert c.call("ok") == "ok"  # both sides still usable


# ----------------------------------------------------------------- timeouts


def test_timeout_names_address_and_method_and_late_reply_is_discarded(client, server):
    with pytest.raises(WaitTimeout) as info:
        client.call("sleep", {"seconds": 0.4}, timeout=0.1)
    assert server.address in str(info.value) and "'sleep'" in str(info.value)
    assert client.call("echo", {"value": 1}) == 1
    time.sleep(0.4)  # the late reply to "sleep" has been sent by now
    assert client.call("echo", {"value": 2}) == 2
    assert client.call("echo", {"value": 3}) == 3


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


def test_no_server_times_out():
    with RpcClient("tcp://127.0.0.1:1", timeout=0.2) as c:
        with pytest.raises(WaitTimeout, match="tcp://127.0.0.1:1"):
            c.call("echo", {})


# ----------------------------------------------------------------- concurrency


def test_concurrent_calls_from_eight_threads(client):
    errors, results = [], {}

    def worker(n):
        try:
            results[n] = [client.call("echo", {"value": (n, i)}) for i in range(25)]
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors
    assert results == {n: [(n, i) for i in range(25)] for n in range(8)}


def test_blocking_handler_does_not_block_other_calls(client, handler):
    result = []
    blocker = threading.Thread(target=lambda: result.append(client.call("block", {"timeout": 10})))
    blocker.start()
    assert handler.entered.wait(5)
    t0 = time.monotonic()
    assert client.call("echo", {"value": "fast"}) == "fast"
    assert time.monotonic() - t0 < 1.0
    handler.release.set()
    blocker.join(5)
    assert result == [True]


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


def test_client_reconnects_after_server_restart(handler):
    first = RpcServer(handler).start()
    address = first.address
    with RpcClient(address, timeout=5) as c:
        assert c.call("echo", {"value": 1}) == 1
        first.close()
        with pytest.raises(WaitTimeout):
            c.call("echo", {"value": 2}, timeout=0.2)
        with RpcServer(handler, address):
            assert c.call("echo", {"value": 3}) == 3


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


def test_lifecycle_errors(handler):
    srv = RpcServer(handler)
    with pytest.raises(ConfigError, match="cannot be bound"):
        RpcServer(handler, srv.address)
    srv.close()  # never started: releases its sockets
    srv.close()
    with pytest.raises(ClosedError):
        srv.start()
    c = RpcClient("tcp://127.0.0.1:9")
    c.close()
    with pytest.raises(ClosedError, match="closed"):
        c.call("echo")
    with pytest.raises(ConfigError, match="zmq endpoint"):
        RpcClient("localhost:9")
    with pytest.raises(ConfigError, match="workers"):
        RpcServer(handler, workers=0)
    with pytest.raises(ConfigError, match="zmq endpoint"):
        RpcServer(handler, 5555)


def test_close_does_not_wait_for_a_blocked_handler_beyond_its_timeout(handler):
    srv = RpcServer(handler).start()
    c = RpcClient(srv.address)
    outcome = []

    def blocked_call():
        try:
            outcome.append(c.call("block", {"timeout": 5}, timeout=1.0))
        except WaitTimeout as exc:
            outcome.append(exc)

    caller = threading.Thread(target=blocked_call)
    caller.start()
    assert handler.entered.wait(5)
    t0 = time.monotonic()
    srv.close(timeout=0.2)
    assert time.monotonic() - t0 < 1.0
    handler.release.set()  # the handler returns, but its reply has no way out any more
    caller.join(5)
    assert len(outcome) == 1 and isinstance(outcome[0], WaitTimeout)
    c.close()
    wait_until(lambda: not [t for t in threading.enumerate() if srv.address in t.name])


# ----------------------------------------------------------------- fork and pickle


def _child_call(client, value):
    assert client.call("echo", {"value": value}) == value


def test_client_works_in_a_forked_child_and_after_pickling(client):
    assert client.call("echo", {"value": "parent"}) == "parent"  # sockets exist before fork
    child = multiprocessing.get_context("fork").Process(target=_child_call, args=(client, "kid"))
    child.start()
    child.join(15)
    assert child.exitcode == 0
    assert client.call("echo", {"value": "parent again"}) == "parent again"
    with pickle.loads(pickle.dumps(client)) as copy:
        assert copy.call("echo", {"value": 5}) == 5


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
