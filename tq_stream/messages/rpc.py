"""One RPC declared once: its name, request struct, reply type and how a server runs it.

An ``Rpc`` names a method of a service, the ``msgspec.Struct`` its request is (fields:
the method's keyword arguments, defaults included), the type of its reply, and its
flags: ``inline`` (never waits: a server may run it on its IO thread), ``waits`` (the
wait class of a call that may wait long, ``transport/wait_slots.py``), ``admin`` (only
the deployment's owner may call it), ``answers`` (called with its request's reply
handle, ``transport/answers.py``). A service's ``RpcTable`` gives a server its
allowlist and flags (``transport/dispatch.py``), and the dispatcher checks, when a
server starts, that each method's signature is its request struct.

On the wire a request is the map of its fields (``args``) and a reply whatever the
service returned (a reply struct is written as the map of its fields,
``serialization.py``); the client turns the reply back into the declared type
(``decode``): no reply is read by string key outside the transport.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any, Generic, TypeVar, Union

import msgspec

from tq_stream.errors import ConfigError, SerializationError

Req = TypeVar("Req", bound=msgspec.Struct)
Rep = TypeVar("Rep")


class Rpc(Generic[Req, Rep]):
    """The declaration of one RPC (see the module docstring). ``reply``: the reply's
    type; a struct (or ``Struct | None``, or a list of structs) is decoded into, any
    other type is trusted as it arrives (plain values: an int, a list of str, a dict of
    stats)."""

    __slots__ = ("_listed", "_optional", "_struct", "admin", "answers", "inline", "name",
                 "reply", "request", "waits")

    def __init__(self, name: str, request: type[Req], reply: object, *,
                 inline: bool = False, waits: str | None = None, admin: bool = False,
                 answers: bool = False) -> None:
        self.name, self.request, self.reply = name, request, reply
        self.inline, self.waits, self.admin, self.answers = inline, waits, admin, answers
        # the struct a reply is decoded into (None: a plain reply), and whether None is one
        self._struct, self._optional = _struct_of(reply)
        self._listed = reply if _is_struct_list(reply) else None  # each item decoded

    def args(self, request: Req) -> dict[str, object]:
        """The keyword arguments ``request`` carries (the map sent on the wire)."""
        return msgspec.structs.asdict(request)

    def decode(self, reply: object) -> Rep:
        """``reply`` as received, as the declared reply type (a map becomes its struct;
        a struct, as an in-process transport hands it, stays as it is).

        Raises:
            SerializationError: the reply is not of that shape (another version's server).
        """
        struct = self._struct
        if struct is None:
            if self._listed is None:
                return reply  # type: ignore[return-value]  # trusted as it arrives
            return self._convert(reply, self._listed)
        if type(reply) is struct or (reply is None and self._optional):
            return reply  # type: ignore[return-value]  # as declared
        if type(reply) is not dict:
            raise SerializationError(f"reply of {self.name!r} must be a {struct.__name__}: "
                                     f"expected a map, got {type(reply).__name__}")
        return self._convert(reply, struct)

    def _convert(self, reply: object, kind: object) -> Rep:
        try:
            return msgspec.convert(reply, kind)  # type: ignore[no-any-return]
        except msgspec.ValidationError as exc:
            raise SerializationError(f"reply of {self.name!r} must be a {_name(kind)}: "
                                     f"{exc}") from None

    def __repr__(self) -> str:
        return f"Rpc({self.name!r})"


def _is_struct_list(reply: object) -> bool:
    """Whether a reply type is ``list[S]`` of a struct ``S``."""
    args: tuple[object, ...] = getattr(reply, "__args__", ())
    return getattr(reply, "__origin__", None) is list and len(args) == 1 and \
        isinstance(args[0], type) and issubclass(args[0], msgspec.Struct)


def _name(kind: object) -> str:
    return kind.__name__ if isinstance(kind, type) else repr(kind)


def _struct_of(reply: object) -> tuple[type[msgspec.Struct] | None, bool]:
    """The struct in a reply type (``S`` or ``S | None``) and whether None may come."""
    if getattr(reply, "__origin__", Union) is not Union:  # list[...], dict[...]: no struct
        return None, False
    kinds = getattr(reply, "__args__", None) or (reply,)  # a union's members
    structs = [k for k in kinds if isinstance(k, type) and issubclass(k, msgspec.Struct)]
    return (structs[0] if structs else None), type(None) in kinds


class RpcTable:
    """The RPCs a service serves, by name; its frozensets are what a server reads
    (``RPC_METHODS``, ``RPC_INLINE``, ``RPC_WAITS``, ``RPC_ADMIN``, ``RPC_REPLIES``)."""

    def __init__(self, *families: Iterable[Rpc[Any, Any]]) -> None:
        self.rpcs: dict[str, Rpc[Any, Any]] = {}
        for family in families:
            for rpc in family:
                if rpc.name in self.rpcs:
                    raise ConfigError(f"RPC {rpc.name!r} is declared twice")
                self.rpcs[rpc.name] = rpc
        self.methods = frozenset(self.rpcs)
        self.inline = frozenset(n for n, r in self.rpcs.items() if r.inline)
        self.admin = frozenset(n for n, r in self.rpcs.items() if r.admin)
        self.replies = frozenset(n for n, r in self.rpcs.items() if r.answers)
        self.waits = {n: r.waits for n, r in self.rpcs.items() if r.waits is not None}

    def check(self, handler: object, skip: Iterable[str] = ("reply",)) -> None:
        """Each RPC's method on ``handler`` takes exactly its request's fields, with the
        same defaults (``skip``: arguments a server fills in).

        Raises:
            ConfigError: naming the method and what differs.
        """
        for name, rpc in self.rpcs.items():
            params = {p.name: p.default for p in
                      inspect.signature(getattr(handler, name)).parameters.values()
                      if p.name not in skip}
            fields = {f.name: _default(f) for f in msgspec.structs.fields(rpc.request)}
            if params != fields:
                raise ConfigError(f"{type(handler).__name__}.{name} must take the fields of "
                                  f"{rpc.request.__name__} with their defaults: method "
                                  f"{params}, request {fields}")


def _default(field: msgspec.structs.FieldInfo) -> object:
    if field.default is not msgspec.NODEFAULT:
        return field.default
    if field.default_factory is not msgspec.NODEFAULT:
        return field.default_factory()
    return inspect.Parameter.empty


__all__ = ["Rpc", "RpcTable"]
