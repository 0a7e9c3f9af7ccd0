"""UnixRpcClient: calls a UnixRpcServer; thread-safe, fork-safe, every call bounded."""

from __future__ import annotations

import itertools
import os
import select
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

from tq_stream.errors import (
    ClosedError,
    ConfigError,
    ConnectionLost,
    SerializationError,
    Unreachable,
    WaitTimeout,
    check_positive,
    check_timeout,
    format_seconds,
)
from tq_stream.forksafe import ForkSafeLock
from tq_stream.serialization import decode, encode
from tq_stream.transport.base import Transport
from tq_stream.transport.remote_errors import error_from_value
from tq_stream.transport.replies import INLINE_BYTES
from tq_stream.transport.unix_frames import (
    FrameError,
    Reader,
    TimedOut,
    nonblocking,
    ready,
    send_message,
)
from tq_stream.transport.unix_paths import unix_path

RETRY_CONNECT = 0.05  # seconds between attempts to reach a server that is (re)starting
RECENT = 1.0  # seconds: a connection idle for less is used without the check for a hang-up


class _Conn:
    __slots__ = ("idle_since", "reader", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = Reader(sock)
        self.idle_since = 0.0

    def stale(self) -> bool:
        """True if the server closed it (an idle connection never has data to read)."""
        try:
            return ready(self.sock, select.POLLIN, 0)
        except (OSError, ValueError):
            return True


class _HungUp(Exception):
    """A pooled connection was closed by its server before a request was sent on it."""


class _Pool:
    """Connections of one process, each serving one call at a time.

    Invariants: a connection is idle in ``_idle`` (at most ``max_idle``) or held
    by exactly one call; one that saw a timeout or an error is closed, never
    returned, so a late reply dies with it.
    """

    def __init__(self, path: str, max_idle: int, connect_window: float | None = None,
                 check_alive: Callable[[], None] | None = None) -> None:
        self.pid = os.getpid()
        self._path = path
        self._max_idle = max_idle
        self._window = connect_window
        self._check_alive = check_alive
        self._lock = ForkSafeLock()
        self._idle: list[_Conn] = []
        self._closed = False

    def checkout(self, deadline: float, address: str, method: str) -> tuple[_Conn, bool]:
        """A connection and whether it is fresh (a reused one may have gone stale)."""
        while True:
            with self._lock:
                if self._closed:
                    raise ClosedError(f"client for {address} is closed")
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                return self._connect(deadline, address, method), True
            # A server closes only connections idle for minutes (or the longest idle
            # one when it is full): a recent one is live, and if not, a send to it
            # fails before anything is sent (``_exchange`` then takes a new one).
            if time.monotonic() - conn.idle_since < RECENT or not conn.stale():
                return conn, False
            conn.sock.close()

    def _connect(self, deadline: float, address: str, method: str) -> _Conn:
        if self._window is not None:
            deadline = min(deadline, time.monotonic() + self._window)
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(max(0.001, deadline - time.monotonic()))
                sock.connect(self._path)
                return _Conn(nonblocking(sock))
            except (FileNotFoundError, ConnectionRefusedError, TimeoutError) as exc:
                sock.close()
                if self._check_alive is not None:
                    self._check_alive()  # raises when nothing will restart the server
                if not os.path.isdir(os.path.dirname(self._path)):
                    # The deployment's socket folder is gone: it stopped, nothing restarts.
                    raise Unreachable(f"no server at {address} for {method!r}: its folder "
                                      f"does not exist (the deployment stopped, or the "
                                      f"address is wrong)") from None
                # The server is starting or restarting. Nothing signals that a socket
                # began to listen, so retry at a short interval, bounded by the call's
                # deadline (as zmq reconnects in the background) and the connect window.
                wait = min(RETRY_CONNECT, deadline - time.monotonic())
                if wait <= 0:
                    raise Unreachable(f"no server at {address} for {method!r} before the "
                                      f"timeout ({type(exc).__name__})") from None
                time.sleep(wait)
            except BaseException:
                sock.close()
                raise

    def checkin(self, conn: _Conn) -> None:
        conn.idle_since = time.monotonic()
        with self._lock:
            if not self._closed and len(self._idle) < self._max_idle:
                self._idle.append(conn)
                return
        conn.sock.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.sock.close()


class UnixRpcClient(Transport):
    """Calls the allowlisted methods of a handler served by a UnixRpcServer.

    Thread-safe: concurrent calls use separate connections from a small pool.
    Fork-safe: connections are made in the process that calls. Picklable: the copy
    connects anew. Every call waits at most its timeout, including the wait for a
    restarting server to accept; after a WaitTimeout the server may or may not
    have run the request (also when the connection broke before the reply).

    Args:
        address: the server's ``unix:///path``.
        timeout: default seconds per call.
        curve_server_key: must be None (unix sockets are not encrypted; use tcp).
        max_idle_sockets: connections kept open between calls.
        connect_window: seconds a call keeps trying to reach a server that does not
            accept (starting, restarting, or dead) before WaitTimeout; None: the
            call's whole timeout. A server whose socket folder is gone fails at once.
        check_alive: called between two tries to reach the server; raises (e.g.
            DeploymentGone) when nothing will serve at ``address`` again. Not pickled.
    """

    def __init__(self, address: str, *, timeout: float = 30.0,
                 curve_server_key: Any = None, max_idle_sockets: int = 64,
                 connect_window: float | None = None,
                 check_alive: Callable[[], None] | None = None) -> None:
        self._path = unix_path(address)
        if curve_server_key is not None:
            raise ConfigError("curve_server_key needs the zmq transport (tcp/ipc); unix "
                              f"sockets are not encrypted, got a key for {address!r}")
        self.address = address
        self.timeout = check_timeout("timeout", timeout)
        self._max_idle = check_positive("max_idle_sockets", max_idle_sockets)
        self._window = None if connect_window is None else \
            check_timeout("connect_window", connect_window)
        self._check_alive = check_alive
        self._ids = itertools.count(1)
        self._lock = ForkSafeLock()  # a child's first call may find a parent's thread in it
        self._pool: _Pool | None = None
        self._closed = False

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self.address, self.timeout, self._max_idle, self._window))

    def call(self, method: str, args: Mapping[str, Any] | None = None,
             timeout: float | None = None) -> Any:
        """Send ``method(**args)`` and return its result (errors as ``RpcClient.call``)."""
        timeout = self.timeout if timeout is None else check_timeout("timeout", timeout)
        deadline = time.monotonic() + timeout
        req_id = next(self._ids)
        frames = encode({"id": req_id, "method": method, "args": {} if args is None else args,
                         "timeout": timeout}, inline=INLINE_BYTES)
        pool = self._pool_of_this_process()
        conn, fresh = pool.checkout(deadline, self.address, method)
        while True:
            try:
                reply = self._exchange(conn, fresh, frames, deadline, method, timeout)
                break
            except _HungUp:  # nothing was sent: the call goes on another connection
                conn.sock.close()
                conn, fresh = pool.checkout(deadline, self.address, method)
            except BaseException:
                conn.sock.close()
                raise
        conn_ok = reply.get("id") == req_id
        if conn_ok:
            pool.checkin(conn)
        else:
            conn.sock.close()
        if reply.get("ok") is True and conn_ok:
            return reply.get("result")
        if reply.get("ok") is True:
            raise SerializationError(f"reply from {self.address} to {method!r} answers "
                                     f"request {reply.get('id')!r}, not {req_id}")
        raise error_from_value(reply.get("error"), self.address)

    def _exchange(self, conn: _Conn, fresh: bool, frames: list[Any], deadline: float,
                  method: str, timeout: float) -> dict[str, Any]:
        """Send one request on ``conn`` and read its reply.

        Raises:
            _HungUp: ``conn`` came from the pool and its server had closed it.
        """
        try:
            send_message(conn.sock, frames, deadline)
        except (BrokenPipeError, ConnectionResetError):
            if fresh:  # a server refusing a connection answers first, then hangs up
                refusal = self._refusal(conn)
                if refusal is not None:
                    return refusal
                raise Unreachable(f"server at {self.address} closed the connection before "
                                  f"{method!r} was sent") from None
            raise _HungUp from None  # a pooled connection the server had closed
        except TimeoutError:
            raise WaitTimeout(f"could not send {method!r} to {self.address} within "
                              f"{format_seconds(timeout)}") from None
        try:
            raw = conn.reader.read(deadline)
        except TimedOut:
            raise WaitTimeout(f"no reply from {self.address} to {method!r} within "
                              f"{format_seconds(timeout)}") from None
        except FrameError as exc:
            raise ConnectionLost(f"no reply from {self.address} to {method!r}: {exc}; the "
                                 f"server may or may not have run it") from None
        try:
            reply = decode(raw)
        except SerializationError as exc:
            raise SerializationError(f"malformed reply from {self.address}: {exc}") from exc
        if not isinstance(reply, dict):
            raise SerializationError(f"malformed reply from {self.address}: not a dict")
        return reply

    def _refusal(self, conn: _Conn) -> dict[str, Any] | None:
        """The answer a server sent before it closed a new connection, if any."""
        try:
            reply = decode(conn.reader.read(time.monotonic() + 1.0))
        except (TimedOut, FrameError, SerializationError):
            return None
        return reply if isinstance(reply, dict) and reply.get("id") == -1 else None

    def close(self) -> None:
        """Close this process's connections; idempotent. Later calls raise ClosedError."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None and pool.pid == os.getpid():
            pool.close()

    def _pool_of_this_process(self) -> _Pool:
        pool = self._pool
        if pool is not None and pool.pid == os.getpid():
            return pool
        with self._lock:
            if self._closed:
                raise ClosedError(f"client for {self.address} is closed")
            if self._pool is None or self._pool.pid != os.getpid():
                # The parent's connections are left alone (never used or closed here).
                self._pool = _Pool(self._path, self._max_idle, self._window,
                                   self._check_alive)
            return self._pool


def _rebuild(address: str, timeout: float, max_idle: int,
             connect_window: float | None = None) -> UnixRpcClient:
    return UnixRpcClient(address, timeout=timeout, max_idle_sockets=max_idle,
                         connect_window=connect_window)
