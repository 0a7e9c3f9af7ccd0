"""How DataLoader worker processes start, how long one may take, and a warning when slow.

With ``spawn`` every worker starts a fresh interpreter that imports torch and the
trainer's main module again before its first batch (tens of seconds in a large
trainer; ``mp.spawn`` trainers often set it globally). ``fork`` starts a worker in
milliseconds; ``forkserver`` pays the import once, in the server. A StreamingDataLoader
checks the start method its workers will use and warns on ``spawn`` with that hint.

A live worker hands over a batch or an error within the dataset's ``timeout`` plus
``RELAY`` (see ``tq_stream.datasets.streaming``). One that does neither for longer is
stuck where no wait of tq_stream's runs (a lock or an import a thread of the trainer
held when the worker was forked, a hung start): the loader waits for a worker at most
``stall_timeout`` seconds (torch's ``timeout``), then raises ``WorkerStalled``.
"""

from __future__ import annotations

import multiprocessing
import warnings
from collections.abc import Iterator
from multiprocessing.context import BaseContext

from tq_stream.errors import (
    ConfigError,
    StateError,
    WorkerStalled,
    check_timeout,
    format_seconds,
)


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


# Seconds beyond a live worker's bound before it counts as stalled: the hand-over of a
# large batch, and the start of a worker (spawn and forkserver import torch again).
STALL_GRACE = {"fork": 15.0, "forkserver": 120.0, "spawn": 120.0}
_TORCH_TIMED_OUT = "DataLoader timed out after"  # torch's _get_data, when timeout > 0


def stall_timeout(timeout: float | None, bound: float, method: str) -> float:
    """Seconds the loader waits for a batch from its workers: ``timeout`` if given (it
    must exceed ``bound``, the longest a live worker takes to answer), else ``bound``
    plus ``STALL_GRACE`` of the start ``method``.

    Raises:
        ConfigError: ``timeout`` is not a positive number above ``bound``.
    """
    if timeout is None:
        return bound + STALL_GRACE[method]
    timeout = check_timeout("timeout", timeout)
    if timeout <= bound:
        raise ConfigError(
            f"timeout must be more than {format_seconds(bound)} (the dataset's timeout + "
            f"the hand-over of a batch: a worker waiting that long for rows is not "
            f"stalled), got {timeout!r}")
    return timeout


def stalled(exc: BaseException) -> bool:
    """True if ``exc`` is torch's "DataLoader timed out" (no batch within ``timeout``)."""
    return isinstance(exc, RuntimeError) and str(exc).startswith(_TORCH_TIMED_OUT)


def worker_failure(exc: BaseException, task: str, rank: int,
                   timeout: float) -> StateError | WorkerStalled:
    """The error a loader of ``task`` (``rank``) raises for its workers' ``exc``: a
    stall (no batch within ``timeout``) or a failure (a worker died or raised)."""
    if stalled(exc):
        return WorkerStalled(
            f"no batch from the DataLoader workers of task {task!r} "
            f"(rank {rank}) within timeout="
            f"{format_seconds(timeout)}, although they "
            f"live: a worker is stuck (e.g. on a lock or an import a "
            f"thread of this process held when it was forked); they were "
            f"stopped: iterate the loader again to resume at the first "
            f"unfinished step (acked batches are not read again)")
    return StateError(
        f"a DataLoader worker of task {task!r} (rank {rank}) "
        f"failed ({type(exc).__name__}: {exc}); iterate the loader again "
        f"to resume at the first unfinished step (acked batches are not "
        f"read again)")


def stop_workers(batches: Iterator[object]) -> None:
    """Shut a torch DataLoader iterator's workers down now (one of them died)."""
    shutdown = getattr(batches, "_shutdown_workers", None)
    if shutdown is not None:
        try:
            shutdown()
        except Exception:  # noqa: BLE001 — best effort: the error is raised anyway
            pass
