"""Small best-effort events over PUB/SUB: a secondary wake-up next to long-polls.

Delivery is lossy by design: a subscriber misses events published before its
subscription reached the publisher, and events beyond the high-water mark are
dropped, never queued without bound. Use them to wake up early, never as the
only signal: the blocking (long-poll) RPC stays the reliable path.
"""

from __future__ import annotations

import collections
import math
import os
import threading
import time
from collections.abc import Iterable
from typing import Any

import zmq

from tq_stream.errors import (
    ClosedError,
    ConfigError,
    SerializationError,
    WaitTimeout,
    check_name,
    check_positive,
    check_timeout,
)
from tq_stream.serialization import decode, encode
from tq_stream.transport.zmq_security import Key, make_curve_client, make_curve_server
from tq_stream.transport.zmq_sockets import SocketGroup

MAX_EVENT_BYTES = 1 << 20  # a frame above this drops the publisher's connection


def _topic_frame(topic: str) -> bytes:
    # zmq subscriptions match prefixes; the NUL terminator makes them exact.
    return check_name("topic", topic).encode() + b"\0"


class Publisher:
    """Publishes ``(topic, payload)`` events on a PUB socket.

    Invariants: one PUB socket, used under a lock (zmq sockets are not
    thread-safe); ``publish`` never blocks: beyond ``hwm`` queued events per
    subscriber, events are dropped.

    Example:
        >>> with Publisher() as pub:
        ...     pub.publish("rows_ready", {"partition": "train", "count": 64})
    """

    def __init__(
        self,
        address: str = "tcp://127.0.0.1:0",
        *,
        hwm: int = 1000,
        curve_secret_key: Key | None = None,
    ) -> None:
        self._group = SocketGroup(f"Publisher({address})")
        self._lock = threading.Lock()
        self._sock = self._group.socket(zmq.PUB)
        try:
            self._sock.sndhwm = check_positive("hwm", hwm)
            if curve_secret_key is not None:
                make_curve_server(self._sock, curve_secret_key)
            try:
                self._sock.bind(address)
            except zmq.ZMQError as exc:
                raise ConfigError(f"address {address!r} cannot be bound: {exc}") from None
        except BaseException:
            self.close()
            raise
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def publish(self, topic: str, payload: Any) -> None:
        """Send one event to current subscribers of ``topic`` (best effort).

        Large tensors in ``payload`` go out zero-copy after this returns: do not
        mutate them afterwards (events should be small anyway).

        Raises:
            SerializationError: ``payload`` cannot be encoded.
            ClosedError: after ``close()``.
        """
        frames = [_topic_frame(topic), *encode(payload)]
        with self._lock:
            if self._sock is None:
                raise ClosedError(f"publisher at {self.address} is closed")
            self._sock.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)

    def close(self) -> None:
        """Close the socket; idempotent."""
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            self._group.release(sock)
        self._group.close()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Subscriber:
    """Waits for events from a Publisher; for use by one thread at a time.

    Events of other subscribed topics that arrive while waiting for one topic
    are kept, at most ``hwm`` of them (oldest dropped first), for later waits.
    After ``os.fork()`` the child reconnects on first use.

    Example:
        >>> sub = Subscriber(pub.address, topics=["rows_ready"])  # doctest: +SKIP
        >>> sub.wait("rows_ready", timeout=1.0)  # doctest: +SKIP
        {'partition': 'train', 'count': 64}
    """

    def __init__(
        self,
        address: str,
        topics: Iterable[str] = (),
        *,
        hwm: int = 1000,
        curve_server_key: Key | None = None,
        curve_public_key: Key | None = None,
        curve_secret_key: Key | None = None,
    ) -> None:
        self.address = address
        self._hwm = check_positive("hwm", hwm)
        self._curve = (curve_server_key, curve_public_key, curve_secret_key)
        self._topics = {_topic_frame(t) for t in topics}
        self._pending: collections.deque[tuple[bytes, Any]] = collections.deque(maxlen=self._hwm)
        self._group: SocketGroup | None = None
        self._sock: zmq.Socket | None = None
        self._pid = -1
        self._closed = False
        self._socket()  # connect now so that subscriptions start early

    def subscribe(self, topic: str) -> None:
        """Start receiving ``topic`` (``wait`` subscribes too, but later)."""
        frame = _topic_frame(topic)
        if frame not in self._topics:
            self._topics.add(frame)
            self._socket().subscribe(frame)

    def wait(self, topic: str, timeout: float) -> Any:
        """The payload of the next event on ``topic``.

        Raises:
            WaitTimeout: no such event within ``timeout`` seconds.
            ClosedError: after ``close()``.
        """
        timeout = check_timeout("timeout", timeout)
        self.subscribe(topic)
        frame = _topic_frame(topic)
        for i, (got, payload) in enumerate(self._pending):
            if got == frame:
                del self._pending[i]
                return payload
        sock = self._socket()
        deadline = time.monotonic() + timeout
        while True:
            remaining_ms = math.ceil((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0 or not sock.poll(remaining_ms, zmq.POLLIN):
                raise WaitTimeout(f"no {topic!r} event from {self.address} within {timeout:g} s")
            msg = sock.recv_multipart(copy=False)
            try:
                got, payload = msg[0].bytes, decode(msg[1:])
            except (SerializationError, IndexError):
                continue  # a malformed event is dropped like a lost one
            if got == frame:
                return payload
            self._pending.append((got, payload))

    def close(self) -> None:
        """Close the socket; idempotent."""
        self._closed = True
        if self._sock is not None and self._pid == os.getpid():
            self._group.release(self._sock)
            self._group.close()
        self._sock = None

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _socket(self) -> zmq.Socket:
        if self._closed:
            raise ClosedError(f"subscriber to {self.address} is closed")
        if self._sock is not None and self._pid == os.getpid():
            return self._sock
        # First use, or first use after a fork (the parent's socket is left alone).
        self._group = SocketGroup(f"Subscriber({self.address})")
        sock = self._group.socket(zmq.SUB)
        try:
            sock.rcvhwm = self._hwm
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_EVENT_BYTES)  # events are small
            server_key, public, secret = self._curve
            if server_key is not None:
                make_curve_client(sock, server_key, public, secret)
            for frame in self._topics:
                sock.subscribe(frame)
            sock.connect(self.address)
        except BaseException:
            self._group.release(sock)
            self._group.close()
            raise
        self._sock, self._pid = sock, os.getpid()
        return sock
