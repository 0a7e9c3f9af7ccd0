"""A zmq context that owns its sockets and ends when the last one is closed."""

from __future__ import annotations

import threading

import zmq

from tq_stream.errors import ClosedError


class SocketGroup:
    """A private zmq context plus a count of the sockets made from it.

    zmq sockets are not thread-safe and ``Context.term()`` blocks while any
    socket is open, so the context is terminated by whoever closes the last
    socket after ``close()`` was requested: ``close()`` itself when no socket
    is open, else the ``release()`` of the last one (e.g. a worker thread that
    was still inside a handler). Invariants: ``_open`` is the number of sockets
    created and not yet released; no socket is created after ``close()``; the
    context is terminated exactly once; every socket has linger 0, so
    terminating never waits for unsent messages.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.context = zmq.Context()
        self._lock = threading.Lock()
        self._open = 0
        self._closing = False
        self._terminated = False

    def socket(self, kind: int) -> zmq.Socket:
        """A new socket of ``kind`` with linger 0; release it with ``release``.

        Raises:
            ClosedError: after ``close()``.
        """
        with self._lock:
            if self._closing:
                raise ClosedError(f"{self.name} is closed")
            sock = self.context.socket(kind)
            self._open += 1
        sock.linger = 0
        return sock

    def release(self, sock: zmq.Socket) -> None:
        """Close ``sock`` (from the thread that used it last)."""
        sock.close(linger=0)
        with self._lock:
            self._open -= 1
        self._maybe_terminate()

    def close(self) -> None:
        """Refuse new sockets; terminate the context once every socket is released."""
        with self._lock:
            self._closing = True
        self._maybe_terminate()

    def _maybe_terminate(self) -> None:
        with self._lock:
            if not self._closing or self._open or self._terminated:
                return
            self._terminated = True
        self.context.term()
