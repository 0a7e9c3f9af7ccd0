"""The transport contract (one method) and the in-process transport unit tests use."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

from tq_stream.errors import ClosedError, RemoteError, TQError, check_timeout
from tq_stream.transport.dispatch import Dispatcher
from tq_stream.transport.handler import Handler


class Transport(ABC):
    """Sends one request to a handler and returns its reply.

    Errors: tq_stream errors raised by the handler are raised again with the
    same class and message; any other handler exception arrives as RemoteError.
    A call that does not complete within its timeout raises WaitTimeout.
    """

    address: str  # where it calls (a socket address, or a name in process)

    @abstractmethod
    def call(
        self, method: str, args: Mapping[str, Any] | None = None, timeout: float | None = None
    ) -> Any:
        """Call ``handler.<method>(**args)`` on the far side and return its result.

        Args:
            method: a name in the handler's ``RPC_TABLE``.
            args: keyword arguments (msgpack/tensor values for socket transports).
            timeout: seconds to wait for the reply; None uses the transport default.
        """

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release resources; idempotent. Calls after close raise ClosedError."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class InprocTransport(Transport):
    """Calls the handler in the caller's thread; objects pass through unchanged.

    No serialization and no copy: the handler receives the caller's objects
    and the caller receives the handler's result itself. The timeout is
    validated but cannot interrupt the handler; a blocking handler method
    receives its own wait timeout as an argument, as over a socket. The handler's
    allow-list and admin methods hold as over a socket (``owner_token``: the token
    its admin calls must carry; None: none is served), so a service driven through
    it in a unit test is refused what a remote caller would be. A method in its
    table's ``replies`` gets ``reply=None`` (answered when it returns, as outside a
    socket server). Thread-safe if the handler is.

    Example:
        >>> from tq_stream.transport.handler import Methods
        >>> class Echo:
        ...     RPC_TABLE = Methods({"echo"})
        ...     def echo(self, value):
        ...         return value
        >>> InprocTransport(Echo()).call("echo", {"value": 1})
        1
    """

    def __init__(self, handler: Handler, *, name: str = "inproc",
                 owner_token: str | None = None) -> None:
        self._dispatch = Dispatcher(handler, owner_token)
        self.address = name
        self._closed = False

    def call(
        self, method: str, args: Mapping[str, Any] | None = None, timeout: float | None = None
    ) -> Any:
        if self._closed:
            raise ClosedError(f"transport {self.address} is closed; cannot call {method!r}")
        if timeout is not None:
            check_timeout("timeout", timeout)
        try:
            return self._dispatch(method, args)
        except TQError:
            raise
        except Exception as exc:  # as over a socket: a handler bug arrives as RemoteError
            raise RemoteError(type(exc).__name__, str(exc), self.address) from exc

    def close(self) -> None:
        self._closed = True
