"""The transport contract without sockets: ``CallContract``
(``tests/helpers/transport_contract.py``) on InprocTransport, what only it does (objects
pass through, admin calls), the Dispatcher's allow-list, and errors as values."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.rpc_handler import handler
from tests.helpers.transport_contract import CallContract
from tq_stream import errors
from tq_stream.errors import (
    AuthError,
    ClosedError,
    ConfigError,
    KeyConflictError,
    RemoteError,
    SerializationError,
    TQError,
    WaitTimeout,
)
from tq_stream.transport import Dispatcher, InprocTransport, Transport
from tq_stream.transport.dispatch import OWNER_ARG
from tq_stream.transport.handler import Methods
from tq_stream.transport.remote_errors import error_from_value, error_to_value

__all__ = ["handler"]  # the fixture, imported for pytest

pytestmark = pytest.mark.timeout(60)
TOKEN = "t" * 32


class Handler:
    RPC_TABLE = Methods({"echo", "add", "fail", "crash"})

    def __init__(self) -> None:
        self.calls = 0

    def echo(self, value=None):
        self.calls += 1
        return value

    def add(self, a, b=0):
        return a + b

    def fail(self, message):
        raise KeyConflictError(message)

    def crash(self):
        return {}["missing"]

    def secret(self):  # public, but not in the allowlist
        return "secret"


class TestInprocContract(CallContract):
    @pytest.fixture
    def client(self, handler):
        with InprocTransport(handler, name="inproc-test") as transport:
            yield transport

    @pytest.fixture
    def where(self):
        return "inproc-test"


def test_inproc_passes_objects_through_unchanged():
    transport = InprocTransport(Handler())
    value = {"t": torch.ones(3), "items": [object()]}  # not even serializable: no encoding
    assert transport.call("echo", {"value": value}) is value
    assert transport.call("add", {"a": 2, "b": 3}, timeout=1.0) == 5
    assert transport.call("echo") is None


def test_inproc_is_a_transport_and_a_context_manager():
    with InprocTransport(Handler(), name="unit") as transport:
        assert isinstance(transport, Transport)
        assert transport.call("add", {"a": 1}) == 1
    with pytest.raises(ClosedError, match="unit is closed"):
        transport.call("add", {"a": 1})
    transport.close()  # idempotent


@pytest.mark.parametrize("method", ["secret", "__init__", "_private", "nope", "", None, 3])
def test_only_allowlisted_methods_can_be_called(method):
    handler = Handler()
    with pytest.raises(ConfigError, match="method must be one of"):
        InprocTransport(handler).call(method, {})
    assert handler.calls == 0


@pytest.mark.parametrize(
    "args, words",
    [
        ({"b": 1}, "missing a required argument: 'a'"),
        ({"a": 1, "c": 2}, "unexpected keyword argument 'c'"),
        ([1, 2], "must be a dict"),
        ({1: 2}, "must be a dict with str keys"),
    ],
)
def test_arguments_must_bind_to_the_signature(args, words):
    with pytest.raises(ConfigError, match=words):
        InprocTransport(Handler()).call("add", args)


@pytest.mark.parametrize(
    "allowlist, words",
    [
        ({"echo", "missing"}, "'missing'"),
        ({"_hidden"}, "public methods"),
        ({"__init__"}, "public methods"),
        ({"value"}, "'value'"),  # an attribute, not a method
    ],
)
def test_bad_allowlists_fail_at_construction(allowlist, words):
    class Bad:
        value = 3

        def _hidden(self):
            return 1

        def echo(self):
            return 1

        RPC_TABLE = Methods(allowlist)

    with pytest.raises(ConfigError, match=words):
        Dispatcher(Bad())


def test_a_handler_without_an_rpc_table_is_not_served():
    class Bare:
        def echo(self):
            return 1

    with pytest.raises(AttributeError, match="RPC_TABLE"):
        Dispatcher(Bare())  # the Handler protocol rules it out for a type checker


def test_a_method_in_rpc_replies_gets_its_reply_handle_from_the_server_only():
    class Waits:
        RPC_TABLE = Methods({"wait", "echo"}, replies={"wait"})

        def wait(self, reply=None):
            return reply

        def echo(self, value):
            return value

    handle = object()
    d = Dispatcher(Waits())
    assert d("wait", {}, handle) is handle and d.call_inline("wait", {}) is None
    assert d("echo", {"value": 1}, handle) == 1  # not in its replies: no handle
    with pytest.raises(ConfigError, match="must not carry 'reply'"):
        d("wait", {"reply": "forged"})  # a caller cannot send one
    Waits.RPC_TABLE = Methods({"wait", "echo"}, replies={"echo"})  # echo takes no reply
    with pytest.raises(ConfigError, match="RPC_TABLE.replies must be names in its methods"):
        Dispatcher(Waits())


def test_dispatcher_lists_its_methods():
    assert Dispatcher(Handler()).methods == ["add", "crash", "echo", "fail"]


def test_a_handler_bug_arrives_as_remote_error_caused_by_the_exception_itself():
    with pytest.raises(RemoteError) as info:
        InprocTransport(Handler(), name="unit").call("crash")
    assert info.value.kind == "KeyError" and info.value.where == "unit"
    assert isinstance(info.value.__cause__, KeyError)


def test_admin_methods_need_the_owner_token_as_over_a_socket():
    class Service:
        RPC_TABLE = Methods({"wipe", "echo"}, admin={"wipe"})

        def wipe(self):
            return "wiped"

        def echo(self, value):
            return value

    owned = InprocTransport(Service(), owner_token=TOKEN)
    assert owned.call("wipe", {OWNER_ARG: TOKEN}) == "wiped"
    assert owned.call("echo", {"value": 1}) == 1
    for args in ({}, {OWNER_ARG: "x" * 32}):
        with pytest.raises(AuthError, match="admin call"):
            owned.call("wipe", args)
    with pytest.raises(AuthError, match="without an owner token"):
        InprocTransport(Service()).call("wipe", {OWNER_ARG: TOKEN})


# ------------------------------------------------------------- errors as values

TREE = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, TQError)]


# Said by a client of its own call; from a server (which could not reach another
# server while running the caller's request) they mean a plain timeout to the caller.
LOCAL_ONLY = (errors.Unreachable, errors.ConnectionLost)


@pytest.mark.parametrize("cls", [c for c in TREE if c is not RemoteError
                                 and c not in LOCAL_ONLY], ids=lambda c: c.__name__)
def test_every_tq_error_crosses_as_the_same_class(cls):
    value = error_to_value(cls("the message"), "tcp://server:1")
    again = error_from_value(value, "ignored")
    assert type(again) is cls
    assert str(again) == "the message"
    assert "raised at tcp://server:1" in again.__notes__[0]


@pytest.mark.parametrize("cls", LOCAL_ONLY, ids=lambda c: c.__name__)
def test_a_server_s_not_sent_or_lost_call_crosses_as_a_plain_timeout(cls):
    again = error_from_value(error_to_value(cls("unit 1 gone"), "unix:///c"), "ignored")
    assert type(again) is errors.WaitTimeout and str(again) == "unit 1 gone"


def test_remote_and_foreign_errors_become_remote_error():
    again = error_from_value(error_to_value(ValueError("bad"), "srv"), "fallback")
    assert type(again) is RemoteError and again.kind == "ValueError" and again.where == "srv"
    assert "ValueError: bad" in again.__notes__[0]  # the remote traceback
    nested = error_from_value(error_to_value(RemoteError("OSError", "disk", "a"), "b"), "c")
    assert (nested.kind, nested.where) == ("OSError", "b")
    # a received class name never selects a class outside the tq_stream tree
    value = {"kind": "SystemExit", "message": "bye", "where": ""}
    assert type(error_from_value(value, "srv")) is RemoteError


def test_expected_errors_travel_without_traceback():
    assert error_to_value(WaitTimeout("late"), "srv")["traceback"] == ""


@pytest.mark.parametrize("value", [None, "boom", {"kind": 1}, {"kind": "X", "message": "m"}])
def test_malformed_error_values_raise_serialization_error(value):
    with pytest.raises(SerializationError, match="malformed error reply from srv"):
        error_from_value(value, "srv")
