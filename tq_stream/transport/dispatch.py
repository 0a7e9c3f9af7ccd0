"""Explicit method dispatch: a handler names the methods a transport may call.

A handler may also name, in ``RPC_INLINE``, methods that never wait (no
condition wait, no sleep, no I/O to another process; locks held only for short
CPU work): a server runs those on its IO thread, skipping two thread hops. An
inline method that finds it would have to wait raises ``WouldBlock`` before
changing anything, and the server runs it again on a worker thread, where it
may block. ``may_block()`` tells a method which case it is in (both in
``tq_stream.handling``, which the handlers import instead of the transport). And it
may name, in ``RPC_REPLIES``, methods another request may answer while they wait
(``transport/answers.py``): each takes a ``reply`` argument, which the dispatcher
fills with the request's reply handle (never a caller: a request carrying ``reply``
is refused).

Every dispatcher counts the calls it ran and the errors they raised, per method, in
this process (``rpc_stats()``: what a server reports to metrics).
Authorization: a handler may name, in ``RPC_ADMIN`` (a subset of
``RPC_METHODS``), the methods only the deployment's owner may call (attach or
drop storage units, load or read the whole state, ...). A call of one of them
must carry the owner's token as the keyword argument ``owner_token``; the
token is compared in constant time and removed before the method is called. A
server started without a token serves no admin method at all.
"""

from __future__ import annotations

import hmac
import inspect
import threading
from collections.abc import Callable, Mapping
from typing import Any

from tq_stream.errors import AuthError, ConfigError
from tq_stream.handling import Reply, WouldBlock, inline

MAX_BOUND = 1024  # argument-name tuples remembered as valid
OWNER_ARG = "owner_token"  # the argument of an admin call that carries the owner's token
REPLY_ARG = "reply"  # the argument of an RPC_REPLIES method that carries its reply handle
_CALLS: dict[str, int] = {}  # "Handler.method" -> calls run in this process
_ERRORS: dict[tuple[str, str], int] = {}  # ("Handler.method", exception name) -> count
_COUNT_LOCK = threading.Lock()


def rpc_stats() -> dict[str, Any]:
    """Calls run by every dispatcher of this process, per ``"Handler.method"``, and the
    errors they raised per exception name: ``{"calls": {...}, "errors": {m: {e: n}}}``."""
    with _COUNT_LOCK:
        errors: dict[str, dict[str, int]] = {}
        for (method, kind), n in _ERRORS.items():
            errors.setdefault(method, {})[kind] = n
        return {"calls": dict(_CALLS), "errors": errors}


def _count(name: str, error: BaseException | None) -> None:
    with _COUNT_LOCK:
        _CALLS[name] = _CALLS.get(name, 0) + 1
        if error is not None:
            key = (name, type(error).__name__)
            _ERRORS[key] = _ERRORS.get(key, 0) + 1


def _takes(signature: inspect.Signature, name: str) -> bool:
    """True if a method of ``signature`` can be called with keyword ``name``."""
    try:
        signature.bind_partial(**{name: None})
    except TypeError:
        return False
    return True


class Dispatcher:
    """A fixed table from method name to bound method, built from ``RPC_METHODS``.

    The handler declares ``RPC_METHODS: frozenset[str]``; only those public
    methods can be called, each with keyword arguments that must bind to its
    signature. An optional ``RPC_INLINE: frozenset[str]`` (a subset) names the
    methods that never wait, ``RPC_ADMIN: frozenset[str]`` (a subset) the
    methods only the owner may call (see the module docstring), ``RPC_WAITS``
    (method -> wait class) the methods that may wait long (``transport.wait_slots``),
    and ``RPC_REPLIES: frozenset[str]`` (a subset) the methods called with ``reply=``
    their request's reply handle (see the module docstring).
    The table is built once, so a typo in the allowlist fails at construction and no attribute
    lookup ever depends on received data. Safe to share between threads: the
    table is immutable, and the only other state is a cache of argument names
    known to bind.

    Example:
        >>> class Echo:
        ...     RPC_METHODS = frozenset({"echo"})
        ...     def echo(self, value):
        ...         return value
        >>> Dispatcher(Echo())("echo", {"value": 3})
        3
    """

    def __init__(self, handler: Any, owner_token: str | None = None) -> None:
        methods = getattr(handler, "RPC_METHODS", None)
        if not isinstance(methods, frozenset) or not all(isinstance(m, str) for m in methods):
            raise ConfigError(
                f"handler {type(handler).__name__} must define RPC_METHODS as a frozenset "
                f"of method names, got {methods!r}"
            )
        self.handler_name = type(handler).__name__
        self._table: dict[str, tuple[Callable[..., Any], inspect.Signature]] = {}
        for name in sorted(methods):
            method = getattr(handler, name, None)
            if name.startswith("_") or not callable(method):
                raise ConfigError(
                    f"{self.handler_name}.RPC_METHODS must name public methods, got {name!r}"
                )
            self._table[name] = (method, inspect.signature(method))
        self._counted = {name: f"{self.handler_name}.{name}" for name in self._table}
        inline: object = getattr(handler, "RPC_INLINE", frozenset())
        if not isinstance(inline, frozenset) or not inline <= methods:
            raise ConfigError(
                f"{self.handler_name}.RPC_INLINE must be a frozenset of names in RPC_METHODS, "
                f"got {inline!r}"
            )
        self.inline: frozenset[str] = inline
        admin: object = getattr(handler, "RPC_ADMIN", frozenset())
        if not isinstance(admin, frozenset) or not admin <= methods:
            raise ConfigError(
                f"{self.handler_name}.RPC_ADMIN must be a frozenset of names in RPC_METHODS, "
                f"got {admin!r}"
            )
        if owner_token is not None and (not isinstance(owner_token, str) or
                                        len(owner_token) < 16):
            raise ConfigError("owner_token must be a str of at least 16 characters, got "
                              f"{type(owner_token).__name__} of length "
                              f"{len(owner_token) if isinstance(owner_token, str) else '-'}")
        self.admin: frozenset[str] = admin
        waits = getattr(handler, "RPC_WAITS", {})
        if not isinstance(waits, Mapping) or not set(waits) <= methods or \
                not all(isinstance(c, str) for c in waits.values()):
            raise ConfigError(
                f"{self.handler_name}.RPC_WAITS must map names in RPC_METHODS to wait "
                f"classes (str), got {waits!r}"
            )
        # Methods that may wait long, and their class (see ``transport.wait_slots``).
        self.waits: dict[str, str] = dict(waits)
        replies: object = getattr(handler, "RPC_REPLIES", frozenset())
        if not isinstance(replies, frozenset) or not replies <= methods or \
                not all(_takes(self._table[m][1], REPLY_ARG) for m in replies):
            raise ConfigError(
                f"{self.handler_name}.RPC_REPLIES must be a frozenset of names in "
                f"RPC_METHODS whose methods take a {REPLY_ARG!r} argument, got {replies!r}"
            )
        self.replies: frozenset[str] = replies
        table = getattr(handler, "RPC_TABLE", None)  # typed messages (``tq_stream.messages``)
        if table is not None:
            table.check(handler)  # each method takes its request struct's fields
        self._owner = owner_token
        # (method, *argument names) that bound to the signature before; sets are safe to
        # share between threads under the GIL (an add racing a lookup only repeats a bind).
        self._bound: set[tuple[str, ...]] = set()

    @property
    def methods(self) -> list[str]:
        return sorted(self._table)

    def __call__(self, method: Any, args: Any, reply: Reply | None = None) -> Any:
        """Call ``handler.<method>(**args)`` (with ``reply=reply`` if ``method`` is in
        ``RPC_REPLIES``: the reply handle of the request being run, None outside a
        socket server).

        Raises:
            ConfigError: ``method`` is not in the allowlist, or ``args`` is not a
                dict of keyword arguments that bind to the method's signature (and
                without ``reply`` for a method in ``RPC_REPLIES``).
        """
        entry = self._table.get(method) if isinstance(method, str) else None
        if entry is None:
            raise ConfigError(
                f"method must be one of {self.methods} of {self.handler_name}, got {method!r}"
            )
        if args is None:
            args = {}
        if not isinstance(args, Mapping):
            raise ConfigError(f"args of {method!r} must be a dict with str keys, got {args!r}")
        if method in self.admin:
            args = self._owner_only(method, args)
        if method in self.replies:
            if REPLY_ARG in args:
                raise ConfigError(f"args of {method!r} must not carry {REPLY_ARG!r}: its "
                                  f"server gives the reply handle, got {REPLY_ARG}="
                                  f"{args[REPLY_ARG]!r:.80}")
            args = {**args, REPLY_ARG: reply}
        fn, signature = entry
        names = (method, *args)
        try:
            # Binding depends on the argument names only; names that bound before are
            # str (checked then), so a known tuple needs no check of its keys.
            if names not in self._bound:
                if not all(isinstance(k, str) for k in args):
                    raise ConfigError(f"args of {method!r} must be a dict with str keys, "
                                      f"got {args!r}")
                try:
                    signature.bind(**args)
                except TypeError as exc:
                    raise ConfigError(f"bad arguments for {self.handler_name}.{method}: "
                                      f"{exc}") from None
                if len(self._bound) < MAX_BOUND:
                    self._bound.add(names)
            result = fn(**args)
        except WouldBlock:
            raise  # not run: it runs again on a worker, and is counted there
        except Exception as exc:
            _count(self._counted[method], exc)
            raise
        _count(self._counted[method], None)
        return result

    def _owner_only(self, method: str, args: Mapping[str, Any]) -> dict[str, Any]:
        """``args`` without the owner's token, or AuthError if it is not there."""
        args = dict(args)
        token = args.pop(OWNER_ARG, None)
        if self._owner is None:
            raise AuthError(f"method {method!r} of {self.handler_name} is an admin call and "
                            "this server was started without an owner token: no client may "
                            "call it")
        if not isinstance(token, str) or not hmac.compare_digest(token.encode(),
                                                                 self._owner.encode()):
            raise AuthError(f"method {method!r} of {self.handler_name} is an admin call: "
                            f"{OWNER_ARG} must be the deployment owner's token, got "
                            f"{'none' if token is None else 'a wrong one'}")
        return args

    def call_inline(self, method: Any, args: Any, reply: Reply | None = None) -> Any:
        """``self(method, args, reply)`` with ``may_block()`` False (on a server's IO
        thread).

        Raises:
            WouldBlock: the method would have to wait; call it again on a worker.
        """
        with inline():
            return self(method, args, reply)
