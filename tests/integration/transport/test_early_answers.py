"""Early answers (``transport/answers.py``) on both socket servers: a waiting request
answered by the thread of the request that ended its wait."""

from __future__ import annotations

import threading

import pytest

from tests.helpers.rpc_handler import wait_until
from tq_stream.errors import WaitTimeout
from tq_stream.handling import ANSWERED
from tq_stream.transport.answers import send_given
from tq_stream.transport.handler import Methods
from tq_stream.transport.rpc import rpc_client, rpc_server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


class Mailbox:
    """``wait(name)`` waits until ``put(name, value)``; the putting thread answers."""

    RPC_TABLE = Methods({"wait", "put", "put_all", "put_then_block", "echo"},
                        inline={"put"},  # the zmq server runs it on its IO thread
                        replies={"wait"})  # called with reply= its request's handle

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.waiting: dict[str, list] = {}  # name -> [pending, value, given]
        self.returned: list = []  # what each wait returned to its server
        self.calls_after_sent = 0
        self.blocking = threading.Event()  # put_then_block is blocked
        self.go = threading.Event()  # ... until this is set

    def wait(self, name: str, timeout: float, reply=None):
        with self.cond:
            rec = self.waiting[name] = [reply, None, False]
            self.cond.notify_all()
            self.cond.wait_for(lambda: rec[1] is not None, timeout)
            out = ANSWERED if rec[2] else rec[1]
            self.returned.append(out)
            return out

    def put(self, name: str, value):
        with self.cond:
            rec = self.waiting.pop(name)
            rec[1] = value
            rec[2] = rec[0] is not None and rec[0].give(value, self.after_sent)
            self.cond.notify_all()
            return rec[2]

    def put_all(self, values: dict):
        """Several puts in one request (not inline: a zmq worker thread runs it)."""
        return [self.put(name, value) for name, value in values.items()]

    def put_then_block(self, name: str, value):
        """A put, then a long call to another process (its given reply goes first)."""
        given = self.put(name, value)
        send_given()
        self.blocking.set()
        self.go.wait(20)
        return given

    def after_sent(self):
        self.calls_after_sent += 1

    def echo(self, value):
        return value


@pytest.fixture(params=["unix", "zmq"])
def address(request, tmp_path):
    return f"unix://{tmp_path}/mb.sock" if request.param == "unix" else "tcp://127.0.0.1:0"


@pytest.fixture
def mailbox():
    return Mailbox()


@pytest.fixture
def server(mailbox, address):
    srv = rpc_server(mailbox, address, workers=4, backlog=8)
    yield srv
    srv.close()


def _start_wait(server, mailbox, name, out, timeout=20.0, client_timeout=30.0):
    client = rpc_client(server.address, timeout=client_timeout)

    def run():
        try:
            out.append(client.call("wait", {"name": name, "timeout": timeout}))
        except Exception as exc:  # noqa: BLE001 — the test asserts on it
            out.append(exc)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    wait_until(lambda: name in mailbox.waiting)
    return client, th


def test_the_putting_request_answers_the_waiting_one_once(server, mailbox):
    got: list = []
    waiter, th = _start_wait(server, mailbox, "a", got)
    with rpc_client(server.address, timeout=10) as putter:
        assert putter.call("put", {"name": "a", "value": [1, "x"]}) is True  # given
    th.join(10)
    assert got == [[1, "x"]]
    wait_until(lambda: mailbox.returned == [ANSWERED])  # its server sent nothing more
    # The waiter's connection carries no stray second reply: the next call on it gets
    # its own answer (a reply with another id would fail the call).
    assert waiter.call("echo", {"value": 5}) == 5
    waiter.close()


def test_many_waiters_answered_by_one_request(server, mailbox):
    got: dict[str, list] = {n: [] for n in "abc"}
    clients = [_start_wait(server, mailbox, n, got[n]) for n in "abc"]
    with rpc_client(server.address, timeout=10) as putter:
        given = putter.call("put_all", {"values": {n: n * 2 for n in "abc"}})
        assert given == [True, True, True]
        assert mailbox.calls_after_sent == 1  # once for the request, after its sends
    for client, th in clients:
        th.join(10)
        client.close()
    assert got == {"a": ["aa"], "b": ["bb"], "c": ["cc"]}


def test_a_request_of_another_server_cannot_give(mailbox, server, tmp_path):
    """``give`` only works from a thread serving the same server: here the put comes
    through a second server, so the waiter forms its reply itself."""
    other = rpc_server(mailbox, f"unix://{tmp_path}/other.sock", workers=2, backlog=2)
    try:
        got: list = []
        waiter, th = _start_wait(server, mailbox, "a", got)
        with rpc_client(other.address, timeout=10) as putter:
            assert putter.call("put", {"name": "a", "value": 7}) is False
        th.join(10)
        assert got == [7] and mailbox.returned == [7]
        waiter.close()
    finally:
        other.close()


def test_outside_a_server_give_is_refused_and_the_waiter_replies(server, mailbox):
    got: list = []
    waiter, th = _start_wait(server, mailbox, "a", got)
    assert mailbox.put("a", 3) is False  # a direct call: no server thread to send it
    th.join(10)
    assert got == [3]
    waiter.close()


def test_a_given_reply_to_a_caller_that_gave_up_is_dropped_and_the_server_goes_on(
        server, mailbox):
    got: list = []
    waiter, th = _start_wait(server, mailbox, "gone", got, client_timeout=0.5)
    th.join(10)
    assert len(got) == 1 and isinstance(got[0], WaitTimeout)  # it gave up (and hung up)
    with rpc_client(server.address, timeout=10) as putter:
        putter.call("put", {"name": "gone", "value": 1})  # its send fails, quietly
        assert putter.call("echo", {"value": "still serving"}) == "still serving"
    assert waiter.call("echo", {"value": 2}) == 2  # a new connection, a clean reply
    waiter.close()


def test_a_handler_that_blocks_after_giving_sends_the_given_replies_first(server, mailbox):
    got: list = []
    waiter, th = _start_wait(server, mailbox, "a", got)
    with rpc_client(server.address, timeout=30) as putter:
        put = threading.Thread(target=putter.call, daemon=True,
                               args=("put_then_block", {"name": "a", "value": 9}))
        put.start()
        try:
            mailbox.blocking.wait(10)
            wait_until(lambda: got == [9], timeout=10)  # while the putting call blocks
            assert mailbox.calls_after_sent == 1
        finally:
            mailbox.go.set()
        put.join(10)
    th.join(10)
    assert mailbox.returned == [ANSWERED]
    waiter.close()
