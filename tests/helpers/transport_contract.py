"""The contract every RPC transport keeps (see ``tq_stream.transport.base.Transport``).

Two levels, mixed into a test class that provides the fixtures:

- ``CallContract``: what any transport does with a call, in process or over a socket:
  values come back, errors keep their class, the allow-list and the signature hold, a
  closed client refuses, concurrent callers and a blocked call do not disturb each
  other. Needs ``handler`` (``rpc_handler.handler``), ``client`` (a Transport to it)
  and ``where`` (the address errors name). ``tests/transport/test_transport_inproc.py`` runs it.
- ``SocketContract``: adds what a socket transport does: encoding refused before
  sending, timeouts whose late replies are never taken for another call's, a server
  restarted at the same address, bounded close, fork and pickle of a client, server
  lifecycle. Also needs ``make_server(handler, address=None)`` (an unstarted server),
  ``make_client(address, timeout=...)`` and ``free_address`` (where nothing serves).
  ``tests/integration/transport/test_transport_contract.py`` runs it on unix and zmq.
"""

from __future__ import annotations

import multiprocessing
import pickle
import threading
import time

import numpy as np
import pytest
import torch

from tests.helpers.rpc_handler import wait_until
from tq_stream.columns import Ragged
from tq_stream.errors import (
    ClosedError,
    ConfigError,
    KeyConflictError,
    RemoteError,
    SerializationError,
    WaitTimeout,
)
from tq_stream.transport.handler import Methods


class CallContract:
    """Tests every transport passes; needs fixtures ``handler``, ``client``, ``where``."""

    def test_roundtrip_of_tensors_ragged_arrays_and_plain_values(self, client):
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
        assert client.call("echo") is None

    def test_handler_errors_keep_their_class_and_others_arrive_as_remote_error(
            self, client, where):
        with pytest.raises(KeyConflictError, match="duplicate key 'k'"):
            client.call("fail", {"message": "duplicate key 'k'"})
        with pytest.raises(RemoteError) as info:
            client.call("crash")
        assert info.value.kind == "ZeroDivisionError" and info.value.where == where
        assert client.call("echo", {"value": "ok"}) == "ok"

    @pytest.mark.parametrize("method", ["secret", "__init__", "_dispatch", "missing"])
    def test_only_allowlisted_methods_are_called(self, client, method):
        with pytest.raises(ConfigError, match="method must be one of"):
            client.call(method, {})

    def test_arguments_must_bind_to_the_signature(self, client):
        with pytest.raises(ConfigError, match="bad arguments.*unexpected keyword argument 'x'"):
            client.call("echo", {"x": 1})

    @pytest.mark.parametrize("timeout", [0, -1, "5", True])
    def test_bad_timeouts_are_refused(self, client, timeout):
        with pytest.raises(ConfigError, match="timeout"):
            client.call("echo", {}, timeout=timeout)

    def test_a_closed_client_refuses_calls(self, client):
        client.close()
        with pytest.raises(ClosedError, match="closed"):
            client.call("echo")
        client.close()  # idempotent

    def test_concurrent_calls_and_a_blocked_call_delays_no_other(self, client, handler):
        results, errors, blocked = {}, [], []

        def worker(n):
            try:
                results[n] = [client.call("echo", {"value": (n, i)}) for i in range(25)]
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)

        blocker = threading.Thread(
            target=lambda: blocked.append(client.call("block", {"timeout": 10})))
        blocker.start()
        assert handler.entered.wait(5)
        threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert not errors and results == {n: [(n, i) for i in range(25)] for n in range(8)}
        assert blocked == []  # still blocked while the others were answered
        handler.release.set()
        blocker.join(5)
        assert blocked == [True]


class _Odd:
    RPC_TABLE = Methods({"odd", "ok"})

    def odd(self, x=None):
        return object()

    def ok(self):
        return "ok"


def _child_call(client, value):
    assert client.call("echo", {"value": value}) == value


class SocketContract(CallContract):
    """Tests every socket transport passes; also needs ``make_server``, ``make_client``
    and ``free_address``."""

    def test_a_large_frame_arrives_as_the_caller_s_own_writable_memory(self, client):
        big = torch.randn(1024, 4096)  # 16 MB in one frame
        out = client.call("echo", {"value": {"big": big}})["big"]
        assert torch.equal(out, big)
        out[0, 0] = 7.0
        assert client.call("echo", {"value": 3}) == 3 and out[0, 0] == 7.0

    def test_errors_name_the_server_and_carry_the_remote_traceback(self, client, where):
        with pytest.raises(KeyConflictError) as info:
            client.call("fail", {"message": "taken"})
        assert where in info.value.__notes__[0]
        with pytest.raises(RemoteError) as crash:
            client.call("crash")
        assert where in str(crash.value)
        assert "1 / 0" in crash.value.__notes__[-1]

    def test_what_cannot_be_encoded_is_refused_and_both_sides_stay_usable(self, make_server,
                                                                          make_client):
        with make_server(_Odd()) as srv, make_client(srv.address, timeout=5) as c:
            with pytest.raises(SerializationError, match="cannot serialize object"):
                c.call("odd")  # the server could not encode its result
            with pytest.raises(SerializationError, match="cannot serialize set"):
                c.call("odd", {"x": {1}})  # refused before sending
            assert c.call("ok") == "ok"

    def test_timeout_names_address_and_method_and_the_late_reply_is_discarded(self, client,
                                                                              where):
        with pytest.raises(WaitTimeout) as info:
            client.call("sleep", {"seconds": 0.4}, timeout=0.1)
        assert where in str(info.value) and "'sleep'" in str(info.value)
        assert client.call("echo", {"value": 1}) == 1
        time.sleep(0.4)  # the late reply to "sleep" has been sent by now
        assert [client.call("echo", {"value": i}) for i in (2, 3)] == [2, 3]

    def test_no_server_times_out_naming_the_address(self, make_client, free_address):
        with make_client(free_address, timeout=0.2) as c:
            with pytest.raises(WaitTimeout) as info:
                c.call("echo", {})
            assert free_address in str(info.value)

    def test_a_restarted_server_at_the_same_address_is_reached(self, handler, make_server,
                                                              make_client):
        first = make_server(handler).start()
        address = first.address
        with make_client(address, timeout=5) as c:
            assert c.call("echo", {"value": 1}) == 1  # its connection is pooled
            first.close()
            with pytest.raises(WaitTimeout):
                c.call("echo", {"value": 2}, timeout=0.2)
            with make_server(handler, address):
                assert c.call("echo", {"value": 3}) == 3

    def test_server_lifecycle(self, handler, make_server):
        srv = make_server(handler)
        with pytest.raises(ConfigError, match="cannot be bound"):
            make_server(handler, srv.address)  # an address is served once
        srv.close()  # never started: releases its socket
        srv.close()
        with pytest.raises(ClosedError):
            srv.start()
        with make_server(handler, srv.address) as again:  # and is free again
            assert again.address == srv.address

    def test_close_is_bounded_while_a_handler_blocks(self, handler, make_server, make_client):
        srv = make_server(handler).start()
        c = make_client(srv.address, timeout=5)
        outcome = []

        def blocked_call():
            try:
                outcome.append(c.call("block", {"timeout": 5}, timeout=2.0))
            except WaitTimeout as exc:
                outcome.append(exc)

        caller = threading.Thread(target=blocked_call)
        caller.start()
        assert handler.entered.wait(5)
        srv.close(timeout=0.2)  # returns although the handler still runs
        handler.release.set()  # it returns, but its reply has no way out any more
        caller.join(5)
        assert len(outcome) == 1 and isinstance(outcome[0], WaitTimeout)
        c.close()
        wait_until(lambda: not [t for t in threading.enumerate() if srv.address in t.name])

    def test_client_works_in_a_forked_child_and_after_pickling(self, client):
        assert client.call("echo", {"value": "parent"}) == "parent"  # a socket exists
        child = multiprocessing.get_context("fork").Process(target=_child_call,
                                                            args=(client, "kid"))
        child.start()
        child.join(15)
        assert child.exitcode == 0
        assert client.call("echo", {"value": "parent again"}) == "parent again"
        with pickle.loads(pickle.dumps(client)) as copy:
            assert copy.call("echo", {"value": 5}) == 5


