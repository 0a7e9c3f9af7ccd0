"""What a handler declares to a server: one ``RPC_TABLE`` naming its methods and flags.

A server calls only the methods its handler's ``RPC_TABLE`` names, and reads the
flags of each from it (``transport/dispatch.py``): ``inline`` (never waits: a server
may run it on its IO thread), ``admin`` (the deployment owner's only), ``replies``
(called with its request's reply handle, ``transport/answers.py``) and ``waits`` (the
wait class of a call that may wait long, ``transport/wait_slots.py``). A service's
``tq_stream.messages.rpc.RpcTable`` is one (it also checks each method against its
request struct); ``Methods`` is one for a handler without request structs.

Example:
    >>> class Echo:
    ...     RPC_TABLE = Methods({"echo", "put"}, inline={"put"})
    ...     def echo(self, value):
    ...         return value
    ...     def put(self, value):
    ...         return None
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol


class RpcDeclaration(Protocol):
    """The methods a handler serves and the flags of each (see the module docstring)."""

    @property
    def methods(self) -> frozenset[str]: ...

    @property
    def inline(self) -> frozenset[str]: ...

    @property
    def admin(self) -> frozenset[str]: ...

    @property
    def replies(self) -> frozenset[str]: ...

    @property
    def waits(self) -> Mapping[str, str]: ...

    def check(self, handler: object) -> None:
        """Raise ConfigError if ``handler``'s methods do not take what is declared."""


class Handler(Protocol):
    """An object a server serves: its ``RPC_TABLE`` names what may be called."""

    @property
    def RPC_TABLE(self) -> RpcDeclaration: ...


class Methods:
    """The declaration of a handler without request structs: method names and flags.

    Every flag names a subset of ``methods`` (the dispatcher checks it when a server
    starts); ``check`` has nothing more to compare.
    """

    __slots__ = ("admin", "inline", "methods", "replies", "waits")

    def __init__(self, methods: Iterable[str], *, inline: Iterable[str] = (),
                 admin: Iterable[str] = (), replies: Iterable[str] = (),
                 waits: Mapping[str, str] | None = None) -> None:
        self.methods = frozenset(methods)
        self.inline = frozenset(inline)
        self.admin = frozenset(admin)
        self.replies = frozenset(replies)
        self.waits: Mapping[str, str] = dict(waits or {})

    def check(self, handler: object) -> None:
        """Nothing to check: no request struct declares the methods' arguments."""

    def __repr__(self) -> str:
        return (f"Methods({sorted(self.methods)}, inline={sorted(self.inline)}, "
                f"admin={sorted(self.admin)}, replies={sorted(self.replies)}, "
                f"waits={dict(self.waits)})")


__all__ = ["Handler", "Methods", "RpcDeclaration"]
