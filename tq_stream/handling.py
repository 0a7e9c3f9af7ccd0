"""What a server and the handler methods it runs tell each other (below both layers).

The transport (``transport/``) runs the methods of a handler (the controller, a
storage unit); neither imports the other, both import this:

- ``may_block()`` is False while a method runs inline on a server's IO thread (the
  server runs it ``inline()``). An inline method that finds it would have to wait
  raises ``WouldBlock`` before changing anything; the server runs it again on a worker
  thread, where it may block.
- ``Reply`` is where the reply of one waiting request goes. A method a handler names in
  its ``RPC_TABLE``'s ``replies`` is called with ``reply=`` its request's handle (None
  when no socket server runs it: embedded mode, a direct call). A thread that ends that
  wait may call ``reply.give(result, then)``; the waiting method, once its reply was given, returns
  ``ANSWERED`` and its server sends nothing for it (``transport/answers.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar


class _Inline(threading.local):
    active = False  # True while an inline call runs in this thread


_INLINE = _Inline()


class WouldBlock(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Raised by a method running inline, before any state changed, when it would
    have to wait: the server runs the call again on a worker thread."""


def may_block() -> bool:
    """False while a handler method runs inline on a server's IO thread."""
    return not _INLINE.active


@contextmanager
def inline() -> Iterator[None]:
    """Run the block as an inline call (``may_block()`` False in this thread)."""
    _INLINE.active = True
    try:
        yield
    finally:
        _INLINE.active = False


class _Answered:
    def __repr__(self) -> str:
        return "ANSWERED"


ANSWERED: Any = _Answered()  # a handler's result whose reply was already given


R = TypeVar("R", contravariant=True)  # the result a reply handle takes


class Reply(Protocol[R]):
    """The reply address of one request a server runs (``transport.answers.Pending``),
    whose method's result is an ``R`` (a reply struct, ``tq_stream.messages``)."""

    def give(self, result: R, then: Callable[[], None] | None = None) -> bool:
        """Answer the request with ``result`` from the current thread: True if its
        server sends it (and then calls ``then``, once every reply given in this
        thread's request was sent); False if it cannot (nothing happened: the waiting
        method returns ``result`` itself)."""
        ...


__all__ = ["ANSWERED", "Reply", "WouldBlock", "inline", "may_block"]
