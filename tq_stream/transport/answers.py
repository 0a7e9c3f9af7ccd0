"""Early answers: a waiting request answered by the thread that ended its wait.

A long-poll (a consumer's ``get_meta``) holds a server worker until its condition
holds. Left alone, the thread that makes the condition hold (a producer's
``commit_new``) wakes that worker, which then forms its reply and sends it. On a host
whose threads have just idled, that wake-up and the waiting worker's own run cost
more than forming the reply (``docs/design.md``, "Write→wake"), so a socket server
lets a handler answer a waiting request from the thread that ends the wait:

- the server runs each request inside ``serving(server, reply_to, req_id)``, which
  names the request and where its reply goes, and gives the thread an outbox;
- a handler method that may wait and be answered early is named in its
  table's ``replies``: the server calls it with ``reply=`` its request's ``Pending``
  (``transport.dispatch``; a ``tq_stream.handling.Reply``). A method called any other
  way (embedded mode, a direct call, a call from inside another handler) gets None,
  so it cannot answer another request with its result;
- a thread that ends that wait calls ``Pending.give(result)``. When that thread is
  itself serving a request of the same server, the result goes into its outbox and
  ``give`` returns True; the server sends the outbox's replies as soon as that
  request's handler has returned (outside every lock the handler held), before that
  request's own reply, and then calls the ``then`` callbacks given with them (a
  handler wakes its waiting threads there: woken earlier, they would compete with
  the send for the GIL and the cores). Otherwise ``give`` returns False and the
  waiting handler, woken, returns that result to its own server;
- the waiting handler, once it sees its ``Pending`` was given, returns ``ANSWERED``
  (``tq_stream.handling``), and its server sends nothing for it;
- a handler that gave replies and then has to block (a call to another process)
  calls ``send_given()`` first, outside its lock: the server sends them at once.

Invariants: a request is answered once (the handler decides, under its own lock,
whether its ``Pending`` was given, and only one thread gives it); an outbox belongs to
one thread and is emptied before that thread serves another request, so it holds at
most the requests waiting on its server (which the server's wait slots bound).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

logger = logging.getLogger(__name__)
_local = threading.local()


class Pending:
    """The reply address of one request a server is running (see module docstring);
    a ``tq_stream.handling.Reply``."""

    __slots__ = ("reply_to", "req_id", "server")

    def __init__(self, server: object, reply_to: Any, req_id: int) -> None:
        self.server = server
        self.reply_to = reply_to  # the server's own handle: a connection, a zmq identity
        self.req_id = req_id

    def give(self, result: Any, then: Callable[[], None] | None = None) -> bool:
        """Answer this request with ``result`` from the current thread: True if the
        current thread serves a request of the same server (the reply is then sent
        when that request's handler returns, and ``then`` is called once every reply
        given there was sent); False if it cannot (nothing happened)."""
        box = getattr(_local, "box", None)
        if box is None or box.server is not self.server:
            return False
        box.replies.append((self, result))
        if then is not None and then not in box.then:
            box.then.append(then)
        return True


class Outbox:
    """What one thread serving one request gave to other waiting requests."""

    __slots__ = ("replies", "request", "send", "server", "then")

    def __init__(self, server: object, request: Pending) -> None:
        self.server = server
        self.request = request
        self.replies: list[tuple[Pending, Any]] = []
        self.then: list[Callable[[], None]] = []  # to call once the replies were sent
        self.send: Callable[[], None] | None = None  # the server's: send replies, sent()

    def sent(self) -> None:
        """The server sent (or dropped) every reply given here: call the ``then``s."""
        then, self.then = self.then, []
        for fn in then:
            try:
                fn()
            except Exception:  # noqa: BLE001 — the serving thread must go on
                logger.exception("a callback after early answers failed")


@contextmanager
def serving(server: object, reply_to: Any, req_id: int) -> Iterator[Outbox]:
    """Run a request of ``server`` (whose reply goes to ``reply_to``) on this thread;
    yields the thread's outbox (its ``request`` is the request's ``Pending``, for the
    dispatcher to hand its method), for the server to send once the handler returned."""
    box = Outbox(server, Pending(server, reply_to, req_id))
    outer = getattr(_local, "box", None)
    _local.box = box
    try:
        yield box
    finally:
        _local.box = outer


def send_given() -> None:
    """Send now the replies the current thread gave so far (then call the ``then``s): a
    handler that made rows ready and is about to block (a call to another process)
    lets the waiting callers have their replies first. Nothing happens outside a
    server, or when nothing was given. Call it without holding the handler's lock."""
    box = getattr(_local, "box", None)
    if box is not None and box.replies and box.send is not None:
        box.send()
