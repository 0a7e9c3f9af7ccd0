"""UnitClient: the one client of a served storage unit's RPC (``messages/unit.py``).

``RemoteUnit`` (the client layer's ``StorageUnit``), the controller service, its restart
and its heartbeat call a unit through it: a typed request in, the declared reply out;
an admin call carries the deployment owner's token, and without one it is refused here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tq_stream.errors import AuthError
from tq_stream.messages.rpc import Rep, Req, Rpc
from tq_stream.transport.dispatch import OWNER_ARG

if TYPE_CHECKING:
    from tq_stream.transport.base import Transport


class UnitClient:
    """Calls one storage unit through ``rpc``.

    ``timeout``: seconds a call waits by default (None: the transport's default);
    ``owner_token``: sent with the unit's admin calls (a client without it gets
    AuthError from them).
    """

    def __init__(self, rpc: Transport, timeout: float | None = None,
                 owner_token: str | None = None) -> None:
        self.transport = rpc  # what it calls through
        self.timeout = timeout
        self._owner_token = owner_token

    def call(self, rpc: Rpc[Req, Rep], request: Req, timeout: float | None = None) -> Rep:
        """``rpc`` with ``request``; its reply as declared."""
        args = rpc.args(request)
        if rpc.admin:
            if self._owner_token is None:
                raise AuthError(f"{rpc.name} is an admin call of a storage unit: only the "
                                "process that started the deployment (its owner) may make "
                                "it, and this handle is not it")
            args[OWNER_ARG] = self._owner_token
        reply = self.transport.call(rpc.name, args,
                               timeout=self.timeout if timeout is None else timeout)
        return rpc.decode(reply)

    def close(self) -> None:
        self.transport.close()
