"""RpcClient: calls an RpcServer; thread-safe, fork-safe, every call bounded in time."""

from __future__ import annotations

import itertools
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import zmq

from tq_stream.errors import (
    ClosedError,
    ConfigError,
    SerializationError,
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
from tq_stream.transport.zmq_security import Key, check_key, make_curve_client
from tq_stream.transport.zmq_sockets import SocketGroup, send_frames


class _SocketPool:
    """DEALER sockets of one process, each serving one call at a time.

    Invariants: a socket is either idle in ``_idle`` (at most ``max_idle``) or
    checked out by exactly one call; a socket that saw a timeout or an error
    is released, never returned, so a late reply or a request still queued
    for a dead server dies with it.
    """

    def __init__(self, address: str, configure: Any, max_idle: int) -> None:
        self.pid = os.getpid()
        self._address = address
        self._configure = configure
        self._max_idle = max_idle
        self._group = SocketGroup(f"RpcClient({address})")
        self._lock = ForkSafeLock()
        self._idle: list[zmq.Socket[bytes]] = []
        self._closed = False

    def checkout(self) -> zmq.Socket[bytes]:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        sock = self._group.socket(zmq.DEALER)  # raises ClosedError after close()
        try:
            # Reconnect soon after a server restart; zmq retries in the background.
            sock.reconnect_ivl = 100
            sock.reconnect_ivl_max = 1000
            self._configure(sock)
            sock.connect(self._address)
        except BaseException:
            self._group.release(sock)
            raise
        return sock

    def checkin(self, sock: zmq.Socket[bytes]) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self._max_idle:
                self._idle.append(sock)
                return
        self._group.release(sock)

    def discard(self, sock: zmq.Socket[bytes]) -> None:
        self._group.release(sock)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock in idle:
            self._group.release(sock)
        self._group.close()


class RpcClient(Transport):
    """Calls the allowlisted methods of a handler served by an RpcServer.

    Thread-safe: concurrent calls use separate sockets from a small pool, so a
    long-poll in one thread never delays another. Fork-safe: sockets are made
    lazily in the process that calls; a forked child builds its own and never
    touches the parent's. Picklable: the copy connects anew on first use.
    Every call waits at most its timeout; after a WaitTimeout the server may or
    may not have run the request.

    Example:
        >>> client = RpcClient("tcp://127.0.0.1:5555", timeout=10)
        >>> client.call("get_meta", {"task": "t", "batch_size": 8, "timeout": 5}, timeout=6)
        ... # doctest: +SKIP

    Args:
        address: the server's endpoint (``RpcServer.address``).
        timeout: default seconds per call.
        curve_server_key: the server's CURVE public key; required iff the server
            has a secret key.
        curve_public_key, curve_secret_key: this client's key pair (generated
            per socket if omitted; needed when the server has an allowlist).
        max_idle_sockets: sockets kept open between calls.
        check_alive: called every ``CHECK_INTERVAL`` seconds while a call waits for its
            reply (zmq does not tell that a server died); raises (e.g. DeploymentGone)
            when nothing will serve at ``address`` again. Not pickled.
    """

    CHECK_INTERVAL = 0.5  # seconds between two ``check_alive`` calls of a waiting call

    def __init__(
        self,
        address: str,
        *,
        timeout: float = 30.0,
        curve_server_key: Key | None = None,
        curve_public_key: Key | None = None,
        curve_secret_key: Key | None = None,
        max_idle_sockets: int = 8,
        check_alive: Callable[[], None] | None = None,
    ) -> None:
        if not isinstance(address, str) or "://" not in address:
            raise ConfigError(
                f"address must be a zmq endpoint like 'tcp://host:port' or 'ipc://path', "
                f"got {address!r}"
            )
        self.address = address
        self.timeout = check_timeout("timeout", timeout)
        self._curve = (
            None if curve_server_key is None else check_key("curve_server_key", curve_server_key),
            curve_public_key,
            curve_secret_key,
        )
        self._max_idle = check_positive("max_idle_sockets", max_idle_sockets)
        self._check_alive = check_alive
        self._ids = itertools.count(1)
        self._lock = ForkSafeLock()  # a child's first call may find a parent's thread in it
        self._pool: _SocketPool | None = None
        self._parent_pool: _SocketPool | None = None
        self._closed = False

    def __reduce__(self) -> tuple[Any, ...]:
        server_key, public, secret = self._curve
        kwargs = {
            "timeout": self.timeout,
            "curve_server_key": server_key,
            "curve_public_key": public,
            "curve_secret_key": secret,
            "max_idle_sockets": self._max_idle,
        }
        return (_rebuild, (self.address, kwargs))

    def call(
        self, method: str, args: Mapping[str, Any] | None = None, timeout: float | None = None
    ) -> Any:
        """Send ``method(**args)`` and return its result.

        Raises:
            WaitTimeout: no reply within ``timeout`` (names the address and method).
            ClosedError: the client is closed.
            SerializationError: ``args`` cannot be encoded, or the reply is malformed.
            TQError subclass: the handler raised it (same class and message).
            RemoteError: the handler raised any other exception, or the server was
                busy (``kind == "ServerBusy"``).
        """
        timeout = self.timeout if timeout is None else check_timeout("timeout", timeout)
        pool = self._pool_of_this_process()
        req_id = next(self._ids)
        request = {"id": req_id, "method": method, "args": {} if args is None else args}
        request["timeout"] = timeout
        frames = encode(request, inline=INLINE_BYTES)
        sock = pool.checkout()
        reply = None
        try:
            reply = self._exchange(sock, req_id, method, frames, timeout)
        finally:
            if reply is None:
                pool.discard(sock)
            else:
                pool.checkin(sock)
        if reply.get("ok") is True:
            return reply.get("result")
        raise error_from_value(reply.get("error"), self.address)

    def close(self) -> None:
        """Close this process's sockets; idempotent. Later calls raise ClosedError."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None and pool.pid == os.getpid():
            pool.close()

    def _pool_of_this_process(self) -> _SocketPool:
        pool = self._pool
        if pool is not None and pool.pid == os.getpid():
            return pool
        with self._lock:
            if self._closed:
                raise ClosedError(f"client for {self.address} is closed")
            if self._pool is None or self._pool.pid != os.getpid():
                # The parent's pool is kept referenced, never used or closed here.
                self._parent_pool = self._pool
                self._pool = _SocketPool(self.address, self._configure, self._max_idle)
            return self._pool

    def _configure(self, sock: zmq.Socket[bytes]) -> None:
        server_key, public, secret = self._curve
        if server_key is not None:
            make_curve_client(sock, server_key, public, secret)

    def _exchange(
        self, sock: zmq.Socket[bytes], req_id: int, method: str, frames: list[Any], timeout: float
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        try:
            # Only a full send queue makes a DEALER wait: try without setting sndtimeo
            # (a setsockopt per call), and bound the wait only when it must wait.
            send_frames(sock, [b"", *frames], zmq.NOBLOCK)
        except zmq.Again:
            sock.sndtimeo = max(1, math.ceil(timeout * 1000))
            try:
                send_frames(sock, [b"", *frames])
            except zmq.Again:
                raise WaitTimeout(
                    f"could not send {method!r} to {self.address} within {format_seconds(timeout)}"
                ) from None
        slice_ms = None if self._check_alive is None else int(self.CHECK_INTERVAL * 1000)
        while True:
            remaining_ms = math.ceil((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                raise WaitTimeout(
                    f"no reply from {self.address} to {method!r} within {format_seconds(timeout)}"
                )
            if not sock.poll(remaining_ms if slice_ms is None else min(slice_ms, remaining_ms),
                             zmq.POLLIN):
                if self._check_alive is not None:
                    self._check_alive()
                continue
            msg = sock.recv_multipart(copy=False)
            if len(msg) < 2 or len(msg[0]) != 0:
                continue  # not an [empty, header, ...] reply; never ours
            try:
                reply = decode(msg[1:])
            except SerializationError as exc:
                raise SerializationError(f"malformed reply from {self.address}: {exc}") from exc
            if isinstance(reply, dict) and reply.get("id") == req_id:
                return reply
            # A reply to an earlier request on this socket: its caller has gone.


def _rebuild(address: str, kwargs: dict[str, Any]) -> RpcClient:
    return RpcClient(address, **kwargs)
