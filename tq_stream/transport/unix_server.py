"""UnixRpcServer: serves a handler's RPC_TABLE on a unix stream socket, same host only.

The low-latency transport of local mode. A zmq round trip crosses two IO
threads on each side; here one IO thread watches every idle connection
(``selectors``) and hands a connection with a request to a worker, which reads
it, runs the method and writes the reply straight to the socket. Each
connection carries one call at a time (``UnixRpcClient`` keeps a pool).

Bounds (a client cannot exhaust the server): the threads are the IO thread
plus ``workers``, whatever the number of connections; at most
``max_connections`` are open (a new one beyond that closes the longest idle
connection, or is refused with ``ServerBusy`` if none is idle); a connection
idle for ``idle_timeout`` is closed (clients reconnect by themselves); a request
announcing more than ``max_message`` bytes is refused before anything is
buffered; one that stalls mid-way for ``READ_TIMEOUT`` is dropped.

Protection is the file system: the socket lives in a folder only its owner can
enter (``tempfile.mkdtemp``); there is no encryption, and no other host can
connect. Use the zmq transport (tcp, CURVE) across hosts.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import selectors
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

from tq_stream.errors import ClosedError, ConfigError, check_positive, check_timeout
from tq_stream.transport.answers import Outbox, serving
from tq_stream.transport.dispatch import Dispatcher
from tq_stream.transport.handler import Handler
from tq_stream.transport.replies import busy_reply, given_replies, read_request, run_request
from tq_stream.transport.unix_frames import (
    MAX_BYTES,
    BufferPool,
    FrameError,
    ServerConn,
    TimedOut,
    nonblocking,
    readable,
    send_message,
)
from tq_stream.transport.unix_paths import bind_path, unix_path
from tq_stream.transport.wait_slots import WaitSlots, resumed

logger = logging.getLogger(__name__)

IDLE_TIMEOUT = 300.0  # seconds an idle connection stays open
MAX_CONNECTIONS = 4096  # connections open at once (each costs a file descriptor only)
MAX_MESSAGE = MAX_BYTES  # bytes one request may announce, unless the server sets less
READ_TIMEOUT = 60.0  # seconds the rest of a request may take once it started arriving
SEND_TIMEOUT = 60.0  # seconds a reply may wait for a caller that does not read it
GIVEN_SEND_TIMEOUT = 5.0  # the same for a reply another request's thread sends (it
# holds that request's own reply back meanwhile); a caller waiting for it reads at once
STICKY = 0.05  # seconds a worker waits for the next request on its connection, while
# other workers are idle (a caller's next call then skips the hop through the IO thread)
_SWEEP = 1.0  # seconds between looks for idle connections to close
LISTEN_BACKLOG = 1024  # connections the kernel queues before the IO thread accepts them
_ACCEPTS = 256  # connections accepted per wake-up (then the other events get a turn)


class UnixRpcServer:
    """Serves ``handler.<method>(**args)`` for the names in ``handler.RPC_TABLE``.

    One IO thread accepts connections and watches the idle ones; ``workers``
    threads each take a connection with a request, run it and reply, then give
    the connection back to the IO thread. Invariants:

    - threads: 1 + ``workers``, independent of the number of connections;
    - a connection is either watched by the IO thread (idle), queued, or held by
      exactly one worker; at most ``max_connections`` are open;
    - every request with a usable header gets exactly one reply unless the server
      closes first or the connection breaks;
    - a request announcing more than ``max_message`` bytes, or stalling mid-way
      for ``READ_TIMEOUT``, closes its connection; an idle connection is closed
      after ``idle_timeout``;
    - received bytes are only ever decoded by ``tq_stream.serialization``.

    Results are sent after the handler returns (see ``RpcServer`` for the rule on
    returned tensors). The socket file is removed by ``close()``. A worker blocked
    in a long-poll holds one worker: size ``workers`` for the waits you expect.

    Example:
        >>> from tq_stream.transport.handler import Methods
        >>> class Echo:
        ...     RPC_TABLE = Methods({"echo"})
        ...     def echo(self, value):
        ...         return value
        >>> import tempfile
        >>> from tq_stream.transport.unix_client import UnixRpcClient
        >>> address = "unix://" + tempfile.mkdtemp() + "/echo"
        >>> with UnixRpcServer(Echo(), address) as server, UnixRpcClient(address) as client:
        ...     client.call("echo", {"value": 1}, timeout=5)
        1

    Args:
        handler: the object whose allowlisted methods are served.
        address: ``unix:///path`` (the file must not exist; its folder must).
        workers: threads running requests.
        max_connections: connections open at once.
        idle_timeout: seconds an idle connection stays open.
        max_message: bytes one request may announce.
        owner_token: the token admin calls must carry (None: no admin call is served).
        wait_caps: requests of each wait class of the handler (its table's ``waits``) that may
            run at once; more are parked without a thread (``transport.wait_slots``).
    """

    def __init__(self, handler: Handler, address: str, *, workers: int = 16,
                 max_connections: int = MAX_CONNECTIONS, idle_timeout: float = IDLE_TIMEOUT,
                 max_message: int = MAX_MESSAGE, owner_token: str | None = None,
                 wait_caps: Mapping[str, int] | None = None) -> None:
        path = unix_path(address)
        self._dispatch = Dispatcher(handler, owner_token)
        self._waits = WaitSlots(self._dispatch.waits, wait_caps)
        self._workers_n = check_positive("workers", workers)
        self._max = check_positive("max_connections", max_connections)
        self._idle_timeout = check_timeout("idle_timeout", idle_timeout)
        self._max_message = check_positive("max_message", max_message)
        self.address = address
        self._path = path
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            bind_path(self._listener, path)
            self._listener.listen(LISTEN_BACKLOG)
            self._listener.setblocking(False)
        except OSError as exc:
            self._listener.close()
            raise ConfigError(f"address {address!r} cannot be bound: {exc}") from None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._buffers = BufferPool(keep=self._workers_n)
        self._lock = threading.Lock()
        self._open: set[ServerConn] = set()  # every open connection (guarded by _lock)
        self._returned: collections.deque[ServerConn] = collections.deque()  # back from workers
        # Unbounded in type, bounded in fact: a connection is queued at most once.
        self._work: queue.SimpleQueue[ServerConn | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle_workers = 0  # a hint for stickiness (races only skew it)
        self._started = False
        self._closed = False

    @property
    def connections(self) -> int:
        """Connections open (a snapshot)."""
        return len(self._open)

    @property
    def threads(self) -> int:
        """Threads this server runs (the IO thread and the workers)."""
        return len(self._threads)

    def start(self) -> UnixRpcServer:
        """Start accepting; idempotent. Raises ClosedError after ``close()``."""
        with self._lock:
            if self._closed:
                raise ClosedError(f"server at {self.address} is closed; cannot start it")
            if self._started:
                return self
            self._started = True
            name = f"tq-rpc {self.address}"
            self._threads = [threading.Thread(target=self._io_loop, daemon=True,
                                              name=f"{name} io")]
            self._threads += [threading.Thread(target=self._work_loop, daemon=True,
                                               name=f"{name} worker {i}")
                              for i in range(self._workers_n)]
        for thread in self._threads:
            thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving, close every connection, remove the socket file; idempotent.

        Waits up to ``timeout`` seconds for handlers that are running; one still
        blocked after that finishes in its daemon thread, and its reply is dropped.
        """
        check_timeout("timeout", timeout)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._open)
        deadline = time.monotonic() + timeout
        self._wake()
        for _ in range(self._workers_n):
            self._work.put(None)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)  # ends a read or send in progress
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._waits.drain()  # parked requests: their connections close below
        with self._lock:
            conns = list(self._open)
            self._open.clear()
        for conn in conns:
            conn.close()
        self._listener.close()
        with contextlib.suppress(OSError):
            os.unlink(self._path)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def __enter__(self) -> UnixRpcServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):  # full: a wake-up is pending
            os.write(self._wake_w, b"x")

    # --------------------------------------------------------------- IO thread

    def _io_loop(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self._listener, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            idle: dict[ServerConn, None] = {}  # watched connections, oldest activity first
            next_sweep = time.monotonic() + _SWEEP
            while not self._closed:
                for key, _ in sel.select(timeout=_SWEEP):
                    if key.fileobj is self._listener:
                        for _ in range(_ACCEPTS):
                            if not self._accept(sel, idle):
                                break
                    elif key.fileobj is self._wake_r:
                        with contextlib.suppress(OSError):
                            os.read(self._wake_r, 4096)
                    elif key.data in idle:  # a request (or the peer's hang-up) arrived
                        sel.unregister(key.fileobj)
                        del idle[key.data]
                        key.data.queued = time.monotonic()
                        self._work.put(key.data)
                if self._closed:
                    return
                while self._returned:
                    conn = self._returned.popleft()
                    conn.last = time.monotonic()
                    idle[conn] = None
                    sel.register(conn.sock, selectors.EVENT_READ, conn)
                if time.monotonic() >= next_sweep:
                    next_sweep = time.monotonic() + _SWEEP
                    self._close_idle(sel, idle, time.monotonic() - self._idle_timeout)

    def _accept(self, sel: selectors.BaseSelector, idle: dict[ServerConn, None]) -> bool:
        """Accept one connection; False when none is waiting."""
        try:
            sock, _ = self._listener.accept()
        except OSError:  # BlockingIOError: none waiting
            return False
        nonblocking(sock)
        with self._lock:
            full = len(self._open) >= self._max
        if full and idle:  # make room: the longest idle connection goes
            self._drop(sel, idle, next(iter(idle)))
            full = False
        if full or self._closed:
            self._refuse(sock)
            return True
        conn = ServerConn(sock, self._max_message, self._buffers)
        with self._lock:
            self._open.add(conn)
        idle[conn] = None
        sel.register(sock, selectors.EVENT_READ, conn)
        return True

    def _close_idle(self, sel: selectors.BaseSelector, idle: dict[ServerConn, None],
                    before: float) -> None:
        for conn in [c for c in idle if c.last < before]:
            self._drop(sel, idle, conn)

    def _drop(self, sel: selectors.BaseSelector, idle: dict[ServerConn, None],
              conn: ServerConn) -> None:
        sel.unregister(conn.sock)
        del idle[conn]
        self._forget(conn)

    def _forget(self, conn: ServerConn) -> None:
        with self._lock:
            self._open.discard(conn)
        conn.close()

    def _refuse(self, sock: socket.socket) -> None:
        message = (f"{self._max} connections are open and none is idle; retry later or "
                   f"raise max_connections")
        try:
            send_message(sock, busy_reply(-1, message, self.address), time.monotonic() + 1.0)
        except OSError:
            pass
        finally:
            sock.close()

    # ------------------------------------------------------------ worker threads

    def _work_loop(self) -> None:
        while True:
            self._idle_workers += 1
            conn = self._work.get()  # close() puts one None per worker
            self._idle_workers -= 1
            if conn is None or self._closed:
                return
            try:
                if conn.parked is not None:  # its slot was handed to it: answer it
                    (request, received), conn.parked = conn.parked, None
                    self._answer(conn, resumed(request, received), received)
                elif not self._serve_one(conn, conn.queued):
                    continue  # parked: the connection waits with its request
                # The same caller's next request, if it comes soon and other workers are
                # free for everyone else, is served here: no hop through the IO thread.
                while not self._closed and self._idle_workers > 0 and \
                        readable(conn.sock, STICKY):
                    if not self._serve_one(conn, None):
                        break
                else:
                    self._give_back(conn)
            except (FrameError, OSError) as exc:
                logger.debug("connection to %s ended: %s", self.address, exc)
                self._forget(conn)

    def _give_back(self, conn: ServerConn) -> None:
        """Hand an idle connection back to the IO thread (or close it when closing)."""
        if self._closed:
            self._forget(conn)
            return
        self._returned.append(conn)
        self._wake()

    def _serve_one(self, conn: ServerConn, queued: float | None) -> bool:
        """Read one request from ``conn``, run it, reply; False if it was parked instead
        (``WaitSlots``: the connection is no longer this worker's). A request that
        waited for a worker (since ``queued``) longer than its caller's timeout is not run.

        Raises:
            FrameError, OSError: the connection broke or stalled: drop it.
        """
        try:
            frames = conn.reader.read(time.monotonic() + READ_TIMEOUT)
        except TimedOut as exc:
            raise FrameError(f"request stalled for {READ_TIMEOUT} s") from exc
        received = time.monotonic() if queued is None else queued
        request, reply = read_request(frames, self.address)
        if request is None:
            self._send(conn, reply)
            return True
        conn.parked = (request, received)
        if not self._waits.take(request[1], conn):
            return False
        conn.parked = None
        self._answer(conn, request, received)
        return True

    def _answer(self, conn: ServerConn, request: Any, received: float) -> None:
        """Run a request that holds its wait slot (if its method has one) and reply; the
        slot then goes to the oldest parked request of its class, on a worker."""
        try:
            with serving(self, conn, request[0]) as box:
                box.send = lambda: self._send_given(box)
                reply = run_request(self._dispatch, request, received, False, self.address,
                                    box)
            self._send(conn, reply)
        finally:
            parked = self._waits.release(request[1])
            if parked is not None:
                self._work.put(parked)

    def _send(self, conn: ServerConn, reply: Any) -> None:
        if reply is not None and not self._closed:
            send_message(conn.sock, reply, time.monotonic() + SEND_TIMEOUT)

    def _send_given(self, box: Outbox) -> None:
        """Send the replies this thread's request gave to waiting requests (answers.py;
        their workers send nothing for them). A failed send shuts that socket down, so
        its worker drops the connection (a part of the reply may have gone out)."""
        try:
            for conn, reply in given_replies(box, self.address):
                try:
                    if not self._closed:
                        send_message(conn.sock, reply, time.monotonic() + GIVEN_SEND_TIMEOUT)
                except (FrameError, OSError) as exc:
                    logger.debug("reply to a waiting request at %s dropped: %s",
                                 self.address, exc)
                    with contextlib.suppress(OSError):
                        conn.sock.shutdown(socket.SHUT_RDWR)
        finally:
            box.sent()

