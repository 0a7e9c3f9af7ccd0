"""Messages on a unix stream socket: a count, the frame sizes, then the frames.

Wire form of one message (little endian): ``u32 n``, ``n x u64 size``, then the
``n`` frames back to back. A message is what ``serialization.encode`` produced;
this layer only delimits it. Frames are sent with one ``sendmsg`` of all the
buffers (no joining copy) and received through a per-socket buffer, so a small
message costs one system call each way; a large frame is received straight into
its own tensor-backed buffer (one kernel copy, no zero-fill).

Sockets are non-blocking (``nonblocking``): a send or receive is tried at once and
waits (``poll``, bounded by the caller's deadline) only when it would block, so the
common small message costs its one system call, without the ``poll`` and the mode
switch a socket timeout adds to every call.

Bounds: at most ``MAX_FRAMES`` frames and ``max_bytes`` bytes per message (a
server's configured maximum; ``MAX_BYTES`` at most); a peer that announces more
is cut off (``FrameError``) before anything is allocated for it. A reader with
a ``BufferPool`` holds a receive buffer only while a message is arriving, so
idle connections of a server cost no buffer.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import time
from typing import Any

import torch

MAX_FRAMES = 1 << 14  # its sizes fit the receive buffer
MAX_BYTES = 1 << 40
BUFFER = 256 << 10  # receive buffer of a socket; larger frames get their own memory
_COUNT = struct.Struct("<I")
_IOV = 512  # buffers per sendmsg call (below every system's IOV_MAX)
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)


class FrameError(Exception):
    """The peer closed the socket, or sent what is not a message."""


class TimedOut(Exception):  # noqa: N818 - a control-flow signal, not an error
    """No (whole) message arrived before the deadline. ``idle``: nothing of a message
    was taken yet, so the reader is intact and ``read`` may be called again."""

    def __init__(self, idle: bool = False) -> None:
        super().__init__("timed out" + (" (idle)" if idle else ""))
        self.idle = idle


def nonblocking(sock: socket.socket) -> socket.socket:
    """``sock``, made non-blocking for ``send_message`` and ``Reader`` (once)."""
    sock.setblocking(False)
    return sock


_POLL_MS = 3_600_000  # the longest single poll (ms); a longer wait polls again


def ready(sock: socket.socket, events: int, timeout: float) -> bool:
    """True once ``sock`` is ready for ``events`` (``select.POLLIN``/``POLLOUT``; a
    hang-up or error counts), False after ``timeout`` seconds (0: just look). Uses
    poll, not select: any descriptor number."""
    poller = select.poll()
    poller.register(sock, events)
    ms = _POLL_MS if timeout * 1000 >= _POLL_MS else max(0, int(timeout * 1000 + 0.999))
    return bool(poller.poll(ms))


def wait_for(sock: socket.socket, events: int, deadline: float) -> None:
    """Wait until ``sock`` is ready for ``events``, or raise TimeoutError once
    ``time.monotonic()`` passes ``deadline`` (any float: a timeout of days is polled an
    hour at a time)."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        if ready(sock, events, max(0.001, remaining)):
            return


def send_message(sock: socket.socket, frames: list[Any], deadline: float) -> None:
    """Send one message on a non-blocking socket; waits while the kernel cannot take
    more bytes, until ``deadline`` (``time.monotonic()``).

    Raises:
        FrameError: more than ``MAX_FRAMES`` frames (nothing was sent).
        TimeoutError: the deadline passed (part of the message may have been sent).
    """
    if not 0 < len(frames) <= MAX_FRAMES:
        raise FrameError(f"a message must have 1..{MAX_FRAMES} frames, got {len(frames)}")
    sizes = [memoryview(f).nbytes for f in frames]
    head = _COUNT.pack(len(frames)) + struct.pack(f"<{len(sizes)}Q", *sizes)
    views = [memoryview(head)]
    views += [memoryview(f).cast("B") for f, n in zip(frames, sizes, strict=True) if n]
    while views:
        try:
            sent = sock.sendmsg(views[:_IOV], (), _NOSIGNAL)  # EPIPE, never SIGPIPE
        except BlockingIOError:
            wait_for(sock, select.POLLOUT, deadline)
            continue
        while sent:
            n = views[0].nbytes
            if sent < n:
                views[0] = views[0][sent:]
                break
            sent -= n
            views.pop(0)


class BufferPool:
    """Receive buffers shared by the readers of one server (at most ``keep`` kept)."""

    def __init__(self, keep: int) -> None:
        self._free: list[bytearray] = []
        self._keep = keep

    def take(self) -> bytearray:
        try:
            return self._free.pop()  # atomic under the GIL
        except IndexError:
            return bytearray(BUFFER)

    def give(self, buf: bytearray) -> None:
        if len(self._free) < self._keep:
            self._free.append(buf)


class Reader:
    """Reads whole messages from one socket (one reader per socket, one thread at a time).

    Args:
        sock: the socket.
        max_bytes: a message announcing more bytes is refused (FrameError).
        pool: lend the receive buffer from here, only while a message is arriving.
    """

    def __init__(self, sock: socket.socket, max_bytes: int = MAX_BYTES,
                 pool: BufferPool | None = None) -> None:
        self.sock = sock
        self.max_bytes = min(max_bytes, MAX_BYTES)
        self._pool = pool
        self._buf = bytearray(BUFFER) if pool is None else bytearray()
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0

    def _lend(self) -> None:
        if self._pool is not None and not self._buf:
            self._buf = self._pool.take()
            self._view = memoryview(self._buf)

    def _return(self) -> None:
        """Give the buffer back when nothing of a next message is in it."""
        if self._pool is not None and self._buf and self._start == self._end:
            self._view.release()
            self._pool.give(self._buf)
            self._buf, self._start, self._end = bytearray(), 0, 0
            self._view = memoryview(self._buf)

    def close(self) -> None:
        """Let go of the receive buffer (the socket is being dropped)."""
        self._start = self._end
        self._return()

    def read(self, deadline: float, first: float | None = None) -> list[Any]:
        """The frames of the next message (each its own memory, safe to keep).

        Args:
            deadline: ``time.monotonic()`` by which the whole message must be in.
            first: if given, the deadline for the message's frame count instead (an
                idle server's poll interval).
        Raises:
            TimedOut: a deadline passed; unless its ``idle`` is True (nothing of the
                message was taken), the socket must be dropped.
            FrameError: the peer closed the socket or broke the format.
        """
        self._lend()
        try:
            return self._read(deadline, first)
        finally:
            self._return()

    def _read(self, deadline: float, first: float | None) -> list[Any]:
        try:
            self._need(_COUNT.size, deadline if first is None else first)
            (count,) = _COUNT.unpack_from(self._buf, self._start)
            if count <= MAX_FRAMES:
                self._need(_COUNT.size + 8 * count, deadline)
        except TimedOut:
            raise TimedOut(idle=True) from None
        (count,) = _COUNT.unpack_from(self._buf, self._start)
        if count == 0 or count > MAX_FRAMES:
            raise FrameError(f"a message must have 1..{MAX_FRAMES} frames, got {count}")
        sizes = struct.unpack_from(f"<{count}Q", self._buf, self._start + _COUNT.size)
        if sum(sizes) > self.max_bytes:
            raise FrameError(f"a message must be at most {self.max_bytes} bytes (the "
                             f"receiver's max_message), got one announcing {sum(sizes)}")
        self._start += _COUNT.size + 8 * count
        return [self._frame(n, deadline) for n in sizes]

    def _frame(self, n: int, deadline: float) -> Any:
        if n <= BUFFER // 4:
            self._need(n, deadline)
            small = bytes(self._view[self._start : self._start + n])
            self._start += n
            return small
        out = torch.empty(n, dtype=torch.uint8)
        dest = out.numpy().data
        have = min(n, self._end - self._start)
        dest[:have] = self._view[self._start : self._start + have]
        self._start += have
        got = have
        while got < n:
            got += self._recv_into(dest[got:], deadline)
        return dest

    def _need(self, n: int, deadline: float) -> None:
        """Make ``n`` bytes available at ``_start``."""
        if self._end - self._start >= n:
            return
        if self._start:  # move what is left to the front
            left = self._end - self._start
            self._view[:left] = self._view[self._start : self._end]
            self._start, self._end = 0, left
        while self._end < n:
            self._end += self._recv_into(self._view[self._end :], deadline)

    def _recv_into(self, dest: memoryview, deadline: float) -> int:
        while True:
            try:
                got = self.sock.recv_into(dest)
                break
            except BlockingIOError:
                try:
                    wait_for(self.sock, select.POLLIN, deadline)
                except TimeoutError:
                    raise TimedOut() from None
            except OSError as exc:
                raise FrameError(f"socket error: {exc}") from None
        if not got:
            raise FrameError("the peer closed the connection")
        return got

def readable(sock: socket.socket, timeout: float) -> bool:
    try:
        return ready(sock, select.POLLIN, timeout)
    except (OSError, ValueError):
        return False


class ServerConn:
    """One accepted connection: its socket, its reader, when it was last active, and
    the request it holds while parked (``WaitSlots``)."""

    __slots__ = ("last", "parked", "queued", "reader", "sock")

    def __init__(self, sock: socket.socket, max_bytes: int, pool: BufferPool) -> None:
        self.sock = sock
        self.reader = Reader(sock, max_bytes, pool)
        self.last = time.monotonic()
        self.queued = self.last  # when it was last handed to the workers
        self.parked: tuple[Any, float] | None = None  # (request, received)

    def close(self) -> None:
        self.reader.close()
        with contextlib.suppress(OSError):
            self.sock.close()
