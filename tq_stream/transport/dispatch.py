"""Explicit method dispatch: a handler names the methods a transport may call."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from tq_stream.errors import ConfigError


class Dispatcher:
    """A fixed table from method name to bound method, built from ``RPC_METHODS``.

    The handler declares ``RPC_METHODS: frozenset[str]``; only those public
    methods can be called, each with keyword arguments that must bind to its
    signature. The table is built once, so a typo in the allowlist fails at
    construction and no attribute lookup ever depends on received data.
    Immutable after construction, hence safe to share between threads.

    Example:
        >>> class Echo:
        ...     RPC_METHODS = frozenset({"echo"})
        ...     def echo(self, value):
        ...         return value
        >>> Dispatcher(Echo())("echo", {"value": 3})
        3
    """

    def __init__(self, handler: Any) -> None:
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

    @property
    def methods(self) -> list[str]:
        return sorted(self._table)

    def __call__(self, method: Any, args: Any) -> Any:
        """Call ``handler.<method>(**args)``.

        Raises:
            ConfigError: ``method`` is not in the allowlist, or ``args`` is not a
                dict of keyword arguments that bind to the method's signature.
        """
        entry = self._table.get(method) if isinstance(method, str) else None
        if entry is None:
            raise ConfigError(
                f"method must be one of {self.methods} of {self.handler_name}, got {method!r}"
            )
        if args is None:
            args = {}
        if not isinstance(args, Mapping) or not all(isinstance(k, str) for k in args):
            raise ConfigError(f"args of {method!r} must be a dict with str keys, got {args!r}")
        fn, signature = entry
        try:
            signature.bind(**args)
        except TypeError as exc:
            raise ConfigError(f"bad arguments for {self.handler_name}.{method}: {exc}") from None
        return fn(**args)
