"""How DataLoader worker processes start, and a warning when that is slow.

With ``spawn`` every worker starts a fresh interpreter that imports torch and the
trainer's main module again before its first batch (tens of seconds in a large
trainer; ``mp.spawn`` trainers often set it globally). ``fork`` starts a worker in
milliseconds; ``forkserver`` pays the import once, in the server. A StreamingDataLoader
checks the start method its workers will use and warns on ``spawn`` with that hint.
"""

from __future__ import annotations

import multiprocessing
import warnings
from multiprocessing.context import BaseContext

from tq_stream.errors import ConfigError


class SpawnStartWarning(UserWarning):
    """DataLoader workers will start with ``spawn`` (slow first batch)."""


def start_method(context: str | BaseContext | None) -> str:
    """The start method of worker processes made with ``context`` (None: the global one).

    Raises:
        ConfigError: if ``context`` is not a start method name or a multiprocessing context.
    """
    methods = multiprocessing.get_all_start_methods()
    if context is None:
        # allow_none: reading it must not fix the global default for the trainer
        return multiprocessing.get_start_method(allow_none=True) or methods[0]
    if isinstance(context, str):
        if context not in methods:
            raise ConfigError(f"multiprocessing_context must be one of {methods} or a "
                              f"multiprocessing context, got {context!r}")
        return context
    if isinstance(context, BaseContext):
        return context.get_start_method()
    raise ConfigError(f"multiprocessing_context must be one of {methods} or a "
                      f"multiprocessing context, got {context!r}")


def check_start_method(context: str | BaseContext | None) -> str:
    """``start_method(context)``, warning (SpawnStartWarning) if it is ``spawn``."""
    method = start_method(context)
    if method == "spawn":
        hint = "fork" if "fork" in multiprocessing.get_all_start_methods() else "forkserver"
        warnings.warn(
            f"DataLoader workers will start with 'spawn' (multiprocessing_context="
            f"{context!r}): each worker re-imports torch and the main module before its "
            f"first batch, which can take tens of seconds; pass "
            f"multiprocessing_context={hint!r} (or 'forkserver') to StreamingDataLoader",
            SpawnStartWarning, stacklevel=3)
    return method
