"""RpcServer: serves a handler's RPC_TABLE over a zmq ROUTER socket."""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

import zmq

from tq_stream.errors import ClosedError, ConfigError, check_positive, check_timeout
from tq_stream.transport.answers import Outbox, serving
from tq_stream.transport.dispatch import Dispatcher
from tq_stream.transport.handler import Handler
from tq_stream.transport.replies import (
    DEFER,
    busy_reply,
    given_replies,
    read_request,
    run_request,
)
from tq_stream.transport.wait_slots import WaitSlots, resumed
from tq_stream.transport.zmq_security import (
    Key,
    check_bind,
    make_curve_server,
    start_client_allowlist,
)
from tq_stream.transport.zmq_sockets import SocketGroup, send_frames

logger = logging.getLogger(__name__)

_STOP = None  # work-queue sentinel: one per worker thread at close
MAX_MESSAGE = 1 << 40  # bytes one request frame may have, unless the server sets less


class RpcServer:
    """Serves ``handler.<method>(**args)`` for the names in ``handler.RPC_TABLE``.

    One IO thread owns the ROUTER socket; ``workers`` threads run handler
    methods, which may block (long-polls), and hand replies back to the IO
    thread through their own inproc PUSH sockets. Methods its ``RPC_TABLE`` lists
    in ``inline`` never wait, so the IO thread runs them itself and answers at
    once (no thread hop); one that raises ``WouldBlock`` goes to the workers
    (``tq_stream.transport.dispatch``). Invariants:

    - only the IO thread touches the ROUTER socket (zmq sockets are not thread-safe);
    - the IO thread never waits inside a handler: it runs only ``inline``
      methods, with ``may_block()`` False;
    - at most ``workers`` requests run on workers and at most ``backlog`` wait; a request
      arriving when the backlog is full is answered at once with a RemoteError
      of kind ``"ServerBusy"``, never queued;
    - every request with a usable envelope and header gets exactly one reply
      (result or error) unless the server closes first; a request that waited
      longer than its caller's timeout is not run (the caller has given up);
    - received bytes are only ever decoded by ``tq_stream.serialization``.

    Results are sent zero-copy after the handler returns: a handler must return
    tensors that nothing mutates afterwards (a gathered copy, not a view of a
    live storage slab). Tensors in ``args`` are views of private receive buffers.

    Example:
        >>> from tq_stream.transport.handler import Methods
        >>> from tq_stream.transport.zeromq import RpcClient, RpcServer
        >>> class Echo:
        ...     RPC_TABLE = Methods({"echo"})
        ...     def echo(self, value):
        ...         return value
        >>> with RpcServer(Echo()) as server, RpcClient(server.address) as client:
        ...     client.call("echo", {"value": 1}, timeout=5)
        1

    Args:
        handler: the object whose allowlisted methods are served.
        address: ``tcp://host:port`` (port 0 picks a free port) or ``ipc://path``;
            ``.address`` is the actual bound endpoint.
        workers: threads running handler methods.
        backlog: requests that may wait for a worker.
        wait_caps: requests of each wait class of the handler (its table's ``waits``) that may
            run at once; more are parked without a thread (``transport.wait_slots``).
        curve_secret_key: serve CURVE-encrypted; clients need the public key
            (``zmq_security.public_key(secret)``).
        curve_client_keys: with a secret key, admit only these client public keys.
        owner_token: the token admin calls must carry (None: no admin call is served).
        max_message: bytes one frame of a request may have (``ZMQ_MAXMSGSIZE``: zmq
            drops the connection of a peer that sends more, before buffering it).
        allow_insecure: serve a non-loopback tcp address without CURVE (refused
            otherwise: anyone who reaches it could read and write every row).
    """

    def __init__(
        self,
        handler: Handler,
        address: str = "tcp://127.0.0.1:0",
        *,
        workers: int = 8,
        backlog: int = 64,
        curve_secret_key: Key | None = None,
        curve_client_keys: Iterable[Key] | None = None,
        owner_token: str | None = None,
        max_message: int = MAX_MESSAGE,
        allow_insecure: bool = False,
        wait_caps: Mapping[str, int] | None = None,
    ) -> None:
        if not isinstance(address, str) or "://" not in address:
            raise ConfigError(
                f"address must be a zmq endpoint like 'tcp://127.0.0.1:0' or 'ipc://path', "
                f"got {address!r}"
            )
        self._dispatch = Dispatcher(handler, owner_token)
        self._waits = WaitSlots(self._dispatch.waits, wait_caps)
        self._workers_n = check_positive("workers", workers)
        self._backlog = check_positive("backlog", backlog)
        max_message = check_positive("max_message", max_message)
        check_bind(address, curve_secret_key is not None, allow_insecure)
        if curve_client_keys is not None and curve_secret_key is None:
            raise ConfigError("curve_client_keys needs curve_secret_key, got no secret key")
        self._group = SocketGroup(f"RpcServer({address})")
        self._auth = None
        token = secrets.token_hex(8)
        try:
            if curve_client_keys is not None:
                self._auth = start_client_allowlist(self._group.context, curve_client_keys)
            self._router = self._group.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.MAXMSGSIZE, max_message)
            if curve_secret_key is not None:
                make_curve_server(self._router, curve_secret_key)
            try:
                self._router.bind(address)
            except zmq.ZMQError as exc:
                raise ConfigError(f"address {address!r} cannot be bound: {exc}") from None
            self.address: str = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._replies_at = f"inproc://tq-rpc-replies-{token}"
            self._replies = self._group.socket(zmq.PULL)
            self._replies.bind(self._replies_at)
            self._control_at = f"inproc://tq-rpc-control-{token}"
            self._control = self._group.socket(zmq.PULL)
            self._control.bind(self._control_at)
        except BaseException:
            self._teardown_unstarted()
            raise
        # Sized for the backlog plus one stop sentinel per worker; the IO thread (the
        # only producer of requests) enforces the backlog bound itself.
        self._work: queue.Queue[Any] = queue.Queue(maxsize=self._backlog + self._workers_n)
        self._threads: list[threading.Thread] = []
        self._state_lock = threading.Lock()
        self._started = False
        self._closed = False

    @property
    def pending(self) -> int:
        """Requests waiting for a worker (a snapshot)."""
        return self._work.qsize()

    def start(self) -> RpcServer:
        """Start the IO and worker threads; idempotent.

        Raises:
            ClosedError: after ``close()``.
        """
        with self._state_lock:
            if self._closed:
                raise ClosedError(f"server at {self.address} is closed; cannot start it")
            if self._started:
                return self
            self._started = True
            name = f"tq-rpc {self.address}"
            self._threads = [threading.Thread(target=self._serve, name=f"{name} io", daemon=True)]
            self._threads += [
                threading.Thread(target=self._work_loop, name=f"{name} worker {i}", daemon=True)
                for i in range(self._workers_n)
            ]
        for thread in self._threads:
            thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving and release the sockets; idempotent.

        Requests still waiting are dropped (their callers time out). Waits up to
        ``timeout`` seconds for handlers that are running to return; a handler
        still blocked after that finishes in its daemon thread, and the last
        socket is released when it does.
        """
        check_timeout("timeout", timeout)
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
            started = self._started
        if not started:
            self._teardown_unstarted()
            return
        deadline = time.monotonic() + timeout
        wake = self._group.socket(zmq.PUSH)
        try:
            wake.connect(self._control_at)
            wake.send(b"", flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the IO thread is gone already
        finally:
            self._group.release(wake)
        self._threads[0].join(max(0.0, deadline - time.monotonic()))
        while True:  # drop waiting requests so the stop sentinels fit
            try:
                self._work.get_nowait()
            except queue.Empty:
                break
        for _ in range(self._workers_n):
            try:
                self._work.put_nowait(_STOP)
            except queue.Full:  # only if the IO thread outlived its join; workers are daemons
                break
        for thread in self._threads[1:]:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._stop_auth()
        self._group.close()

    def __enter__(self) -> RpcServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --------------------------------------------------------------- IO thread

    def _serve(self) -> None:
        poller = zmq.Poller()
        for sock in (self._router, self._replies, self._control):
            poller.register(sock, zmq.POLLIN)
        try:
            while True:
                # The control socket wakes us for close(); the poll timeout is only a
                # safety net, not a polling interval.
                events = dict(poller.poll(1000))
                if self._control in events or self._closed:
                    return
                if self._replies in events:
                    self._forward_replies()
                if self._router in events:
                    self._accept_requests()
        except zmq.ZMQError as exc:
            if not self._closed:
                logger.error("RPC server at %s stopped: %s", self.address, exc)
        finally:
            for sock in (self._router, self._replies, self._control):
                self._group.release(sock)

    def _forward_replies(self) -> None:
        for _ in range(self._backlog + self._workers_n):  # bounded: requests are served too
            try:
                reply = self._replies.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            # ROUTER drops (never blocks on) replies to clients that are gone or full.
            send_frames(self._router, reply)

    def _accept_requests(self) -> None:
        for _ in range(self._backlog + self._workers_n):
            try:
                msg = self._router.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(msg) < 3 or len(msg[1]) != 0:
                logger.debug("dropped a request without [identity, '', header] envelope")
                continue
            identity, received = msg[0], time.monotonic()
            request, reply = read_request(msg[2:], self.address)
            if request is not None and request[1] in self._dispatch.inline:
                with serving(self, identity, request[0]) as box:
                    box.send = lambda: self._send_given(self._router, box)
                    reply = run_request(self._dispatch, request, received, True, self.address,
                                        box)
                if reply is not DEFER:
                    request = None  # answered here, on the IO thread
            if request is None:
                if reply is not None:
                    send_frames(self._router, [identity, b"", *reply])
                continue
            if self._work.qsize() >= self._backlog:
                self._reply_busy(identity, request[0])
                continue
            self._work.put_nowait((identity, request, received))

    def _reply_busy(self, identity: zmq.Frame, req_id: int) -> None:
        message = (f"{self._workers_n} workers busy and {self._backlog} requests waiting; "
                   "retry later or raise workers/backlog")
        send_frames(self._router, [identity, b"", *busy_reply(req_id, message, self.address)])

    # ------------------------------------------------------------ worker threads

    def _work_loop(self) -> None:
        try:
            push = self._group.socket(zmq.PUSH)
        except ClosedError:
            return
        try:
            push.sndtimeo = 1000  # the IO thread drains continuously; bound it anyway
            push.connect(self._replies_at)
            while True:
                # Blocks without a timeout by design: close() always enqueues one
                # stop sentinel per worker.
                item = self._work.get()
                if item is _STOP:
                    return
                admitted = False
                while item is not None:
                    identity, request, received = item
                    if not admitted and not self._waits.take(request[1], item):
                        break  # parked: a worker finishing a wait of its class runs it
                    run = resumed(request, received) if admitted else request
                    try:
                        self._reply(push, identity, run, received)
                    finally:  # the slot goes to the oldest parked request of its class
                        item, admitted = self._waits.release(request[1]), True
        finally:
            self._group.release(push)

    def _reply(self, push: Any, identity: Any, request: Any, received: float) -> None:
        with serving(self, identity, request[0]) as box:
            box.send = lambda: self._send_given(push, box)
            reply = run_request(self._dispatch, request, received, False, self.address,
                                box)
        # After close() the IO thread is gone and a send would wait for sndtimeo.
        if reply is not None and not self._closed:
            try:
                send_frames(push, [identity, b"", *reply])
            except zmq.ZMQError as exc:
                logger.warning("reply from %s dropped: %s", self.address, exc)

    def _send_given(self, sock: Any, box: Outbox) -> None:
        """Send, on this thread's socket, the replies this thread's request gave to
        waiting requests (answers.py; their workers send nothing for them)."""
        try:
            for to, frames in given_replies(box, self.address):
                if not self._closed:
                    try:
                        send_frames(sock, [to, b"", *frames])
                    except zmq.ZMQError as exc:
                        logger.warning("reply from %s dropped: %s", self.address, exc)
        finally:
            box.sent()

    # ------------------------------------------------------------------ handling

    # ------------------------------------------------------------------ teardown

    def _teardown_unstarted(self) -> None:
        for name in ("_router", "_replies", "_control"):
            sock = self.__dict__.pop(name, None)
            if sock is not None:
                self._group.release(sock)
        self._stop_auth()
        self._group.close()

    def _stop_auth(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
