"""A zmq context that owns its sockets and ends when the last one is closed."""

from __future__ import annotations

import threading
from typing import Any

import zmq

from tq_stream.errors import ClosedError


class _Context(zmq.Context[zmq.Socket[bytes]]):
    """A zmq context that references its sockets strongly.

    pyzmq keeps a context's sockets in a WeakSet; an unclosed context that is
    garbage-collected closes them and then terminates. When the context and its
    sockets die together in a reference cycle (a client dropped without
    ``close()``), the weak references are cleared before the finalizer runs, the
    sockets stay open and ``term()`` blocks forever, hanging whichever thread ran
    the collection. Strong references keep them reachable for that finalizer.
    """

    def __init__(self) -> None:
        super().__init__()
        self._sockets = set()  # type: ignore[assignment]  # pyzmq adds/discards on close


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
        self.context = _Context()
        self._lock = threading.Lock()
        self._open = 0
        self._closing = False
        self._terminated = False

    def socket(self, kind: int) -> zmq.Socket[bytes]:
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

    def release(self, sock: zmq.Socket[bytes]) -> None:
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


_MORE = int(zmq.SNDMORE)
COPY_BYTES = 64 << 10  # frames below this are copied (zero copy costs more for them)


def send_frames(sock: zmq.Socket[bytes], frames: list[Any], flags: int = 0) -> None:
    """``sock.send_multipart(frames, flags, copy=False)`` at a fraction of its cost for
    small messages: no per-call type checks or enum arithmetic, and frames below
    ``COPY_BYTES`` take the copying path (pyzmq would wrap each in a Frame object
    and copy it anyway). Frames must be bytes, 1-D byte memoryviews or zmq.Frames.

    Raises:
        zmq.Again: with ``zmq.NOBLOCK``, only before the first frame is queued.
    """
    flags = int(flags)
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        copy = not isinstance(frame, zmq.Frame) and len(frame) < COPY_BYTES
        sock.send(frame, flags | _MORE if i < last else flags, copy=copy)
