"""Explicit method dispatch: a handler's ``RPC_TABLE`` names the methods a transport may call.

The table (``transport/handler.py``: a service's ``RpcTable``, or ``Methods``) may
also name, in ``inline``, methods that never wait (no condition wait, no sleep, no
I/O to another process; locks held only for short CPU work): a server runs those on
its IO thread, skipping two thread hops. An inline method that finds it would have
to wait raises ``WouldBlock`` before changing anything, and the server runs it again
on a worker thread, where it may block. ``may_block()`` tells a method which case it
is in (both in ``tq_stream.handling``, which the handlers import instead of the
transport). And it may name, in ``replies``, methods another request may answer while
they wait (``transport/answers.py``): each takes a ``reply`` argument, which the
dispatcher fills with the request's reply handle (never a caller: a request carrying
``reply`` is refused).

Every dispatcher counts the calls it ran and the errors they raised, per method, in
this process (``rpc_stats()``: what a server reports to metrics).
Authorization: the table may name, in ``admin``, the methods only the deployment's
owner may call (attach or drop storage units, load or read the whole state, ...). A
call of one of them must carry the owner's token as the keyword argument
``owner_token``; the token is compared in constant time and removed before the method
is called. A server started without a token serves no admin method at all.
"""

from __future__ import annotations

import hmac
import inspect
import threading
from collections.abc import Callable, Mapping
from typing import Any

from tq_stream.errors import AuthError, ConfigError
from tq_stream.handling import Reply, WouldBlock, inline
from tq_stream.transport.handler import Handler

MAX_BOUND = 1024  # argument-name tuples remembered as valid
OWNER_ARG = "owner_token"  # the argument of an admin call that carries the owner's token
REPLY_ARG = "reply"  # the argument of a ``replies`` method that carries its reply handle
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
    """A fixed table from method name to bound method, built from ``handler.RPC_TABLE``.

    Only the public methods the table names can be called, each with keyword
    arguments that must bind to its signature; its flags (``inline``, ``admin``,
    ``waits``, ``replies``: see the module docstring) each name a subset of them.
    The table is built once, so a typo in the allowlist fails at construction and no attribute
    lookup ever depends on received data. Safe to share between threads: the
    table is immutable, and the only other state is a cache of argument names
    known to bind.

    Example:
        >>> from tq_stream.transport.handler import Methods
        >>> class Echo:
        ...     RPC_TABLE = Methods({"echo"})
        ...     def echo(self, value):
        ...         return value
        >>> Dispatcher(Echo())("echo", {"value": 3})
        3
    """

    def __init__(self, handler: Handler, owner_token: str | None = None) -> None:
        self.handler_name = type(handler).__name__
        declared = handler.RPC_TABLE
        methods = declared.methods
        self._table: dict[str, tuple[Callable[..., Any], inspect.Signature]] = {}
        for name in sorted(methods):
            method = getattr(handler, name, None)  # a declared name, never received data
            if not isinstance(name, str) or name.startswith("_") or not callable(method):
                raise ConfigError(
                    f"{self.handler_name}.RPC_TABLE.methods must name public methods, "
                    f"got {name!r}"
                )
            self._table[name] = (method, inspect.signature(method))
        self._counted = {name: f"{self.handler_name}.{name}" for name in self._table}
        self.inline: frozenset[str] = self._subset("inline", declared.inline, methods)
        self.admin: frozenset[str] = self._subset("admin", declared.admin, methods)
        if owner_token is not None and (not isinstance(owner_token, str) or
                                        len(owner_token) < 16):
            raise ConfigError("owner_token must be a str of at least 16 characters, got "
                              f"{type(owner_token).__name__} of length "
                              f"{len(owner_token) if isinstance(owner_token, str) else '-'}")
        waits = declared.waits
        if not set(waits) <= methods or not all(isinstance(c, str) for c in waits.values()):
            raise ConfigError(
                f"{self.handler_name}.RPC_TABLE.waits must map names in its methods to "
                f"wait classes (str), got {dict(waits)!r}"
            )
        # Methods that may wait long, and their class (see ``transport.wait_slots``).
        self.waits: dict[str, str] = dict(waits)
        replies = declared.replies
        if not replies <= methods or \
                not all(_takes(self._table[m][1], REPLY_ARG) for m in replies):
            raise ConfigError(
                f"{self.handler_name}.RPC_TABLE.replies must be names in its methods "
                f"whose methods take a {REPLY_ARG!r} argument, got {set(replies)!r}"
            )
        self.replies: frozenset[str] = replies
        declared.check(handler)  # e.g. each method takes its request struct's fields
        self._owner = owner_token
        # (method, *argument names) that bound to the signature before; sets are safe to
        # share between threads under the GIL (an add racing a lookup only repeats a bind).
        self._bound: set[tuple[str, ...]] = set()

    def _subset(self, flag: str, names: frozenset[str], methods: frozenset[str]
                ) -> frozenset[str]:
        if not names <= methods:
            raise ConfigError(f"{self.handler_name}.RPC_TABLE.{flag} must be names in its "
                              f"methods, got {sorted(names - methods)!r} that are not")
        return names

    @property
    def methods(self) -> list[str]:
        return sorted(self._table)

    def __call__(self, method: Any, args: Any, reply: Reply[Any] | None = None) -> Any:
        """Call ``handler.<method>(**args)`` (with ``reply=reply`` if ``method`` is in
        the table's ``replies``: the reply handle of the request being run, None outside a
        socket server).

        Raises:
            ConfigError: ``method`` is not in the allowlist, or ``args`` is not a
                dict of keyword arguments that bind to the method's signature (and
                without ``reply`` for a method in ``replies``).
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

    def call_inline(self, method: Any, args: Any, reply: Reply[Any] | None = None) -> Any:
        """``self(method, args, reply)`` with ``may_block()`` False (on a server's IO
        thread).

        Raises:
            WouldBlock: the method would have to wait; call it again on a worker.
        """
        with inline():
            return self(method, args, reply)
