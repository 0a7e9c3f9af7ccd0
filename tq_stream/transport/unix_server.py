"""UnixRpcServer: serves a handler's RPC_METHODS on a unix stream socket, same host only.

The low-latency transport of local mode. A zmq round trip crosses two IO
threads on each side; here the caller's thread writes to the socket and the
thread serving that connection reads it, runs the method and writes the reply,
so a call costs two thread wake-ups instead of six (about 0.1 ms instead of
0.3 ms on a 2-core machine). Each connection carries one call at a time
(``UnixRpcClient`` keeps a pool), so a connection's thread may block in a
long-poll without delaying any other caller.

Protection is the file system: the socket lives in a folder only its owner can
enter (``tempfile.mkdtemp``); there is no encryption, and no other host can
connect. Use the zmq transport (tcp, CURVE) across hosts.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import selectors
import socket
import threading
import time
from typing import Any

from tq_stream.errors import ClosedError, ConfigError, check_positive, check_timeout
from tq_stream.transport.dispatch import Dispatcher
from tq_stream.transport.replies import busy_reply, read_request, run_request
from tq_stream.transport.unix_frames import FrameError, Reader, TimedOut, send_message

logger = logging.getLogger(__name__)

SCHEME = "unix://"
IDLE_POLL = 5.0  # seconds an idle connection thread sleeps between looks at ``closed``
READ_TIMEOUT = 60.0  # seconds the rest of a request may take once it started arriving
SEND_TIMEOUT = 60.0  # seconds a reply may wait for a caller that does not read it


def unix_path(address: Any) -> str:
    """The file path of a ``unix://`` address (ConfigError if it is not one)."""
    if not isinstance(address, str) or not address.startswith(SCHEME) or \
            len(address) == len(SCHEME):
        raise ConfigError(f"address must look like 'unix:///path/to/socket', got {address!r}")
    path = address[len(SCHEME):]
    if len(path.encode()) > 100:
        raise ConfigError(f"address must name a socket path of at most 100 bytes (a unix "
                          f"socket limit), got {len(path.encode())} bytes: {address!r}")
    return path


def _bind(sock: socket.socket, path: str) -> None:
    """Bind ``sock`` to ``path``; a socket file no server listens on any more (its
    server was killed) is replaced, a live one is not."""
    try:
        sock.bind(path)
        return
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except ConnectionRefusedError:
        os.unlink(path)  # stale: left by a server that died
    except OSError:
        pass
    else:
        raise OSError(errno.EADDRINUSE, "a server is listening there")
    finally:
        probe.close()
    sock.bind(path)


class UnixRpcServer:
    """Serves ``handler.<method>(**args)`` for the names in ``handler.RPC_METHODS``.

    One accept thread, and one thread per open connection that reads a request,
    runs it and writes the reply. Invariants:

    - at most ``max_connections`` connections are served; one more is answered
      with a RemoteError of kind ``"ServerBusy"`` (request id -1) and closed;
    - every request with a usable header gets exactly one reply unless the server
      closes first or the connection breaks;
    - a connection that stalls mid-request for ``READ_TIMEOUT`` is closed;
    - received bytes are only ever decoded by ``tq_stream.serialization``.

    Results are sent after the handler returns (see ``RpcServer`` for the rule on
    returned tensors). The socket file is removed by ``close()``.

    Example:
        >>> class Echo:
        ...     RPC_METHODS = frozenset({"echo"})
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
        max_connections: connections served at once (each holds a thread).
    """

    def __init__(self, handler: Any, address: str, *, max_connections: int = 256) -> None:
        path = unix_path(address)
        self._dispatch = Dispatcher(handler)
        self._max = check_positive("max_connections", max_connections)
        self.address = address
        self._path = path
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            _bind(self._listener, path)
            self._listener.listen(128)
        except OSError as exc:
            self._listener.close()
            raise ConfigError(f"address {address!r} cannot be bound: {exc}") from None
        self._wake_r, self._wake_w = os.pipe()
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._accept: threading.Thread | None = None
        self._started = False
        self._closed = False

    @property
    def connections(self) -> int:
        """Connections being served (a snapshot)."""
        return len(self._conns)

    def start(self) -> UnixRpcServer:
        """Start accepting; idempotent. Raises ClosedError after ``close()``."""
        with self._lock:
            if self._closed:
                raise ClosedError(f"server at {self.address} is closed; cannot start it")
            if not self._started:
                self._started = True
                self._accept = threading.Thread(target=self._accept_loop, daemon=True,
                                                name=f"tq-rpc {self.address} accept")
                self._accept.start()
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
            conns = list(self._conns.items())
        deadline = time.monotonic() + timeout
        os.write(self._wake_w, b"x")
        if self._accept is not None:
            self._accept.join(max(0.0, deadline - time.monotonic()))
        for conn, _ in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # wakes a thread waiting for a request
        for _, thread in conns:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._listener.close()
        with contextlib.suppress(OSError):
            os.unlink(self._path)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def __enter__(self) -> UnixRpcServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept_loop(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self._listener, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while not self._closed:
                # The wake pipe ends the wait at close(); the timeout is a safety net.
                events = sel.select(timeout=IDLE_POLL)
                if self._closed:
                    return
                if any(key.fileobj is self._listener for key, _ in events):
                    self._accept_one()

    def _accept_one(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return
        with self._lock:
            busy = self._closed or len(self._conns) >= self._max
            if not busy:
                thread = threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                          name=f"tq-rpc {self.address} conn")
                self._conns[conn] = thread
        if busy:
            self._refuse(conn)
            return
        thread.start()

    def _refuse(self, conn: socket.socket) -> None:
        message = (f"{self._max} connections are served already; retry later or raise "
                   f"max_connections")
        try:
            conn.settimeout(1.0)
            send_message(conn, busy_reply(-1, message, self.address))
        except OSError:
            pass
        finally:
            conn.close()

    def _serve(self, conn: socket.socket) -> None:
        reader = Reader(conn)
        try:
            while not self._closed:
                try:
                    now = time.monotonic()
                    frames = reader.read(now + READ_TIMEOUT, first=now + IDLE_POLL)
                except TimedOut as exc:
                    if not exc.idle:
                        return  # stalled mid-request: drop the connection
                    continue
                received = time.monotonic()
                request, reply = read_request(frames, self.address)
                if request is not None:
                    reply = run_request(self._dispatch, request, received, False, self.address)
                if reply is None:
                    continue
                if self._closed:
                    return
                conn.settimeout(SEND_TIMEOUT)
                send_message(conn, reply)
        except (FrameError, OSError) as exc:
            logger.debug("connection to %s ended: %s", self.address, exc)
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()
