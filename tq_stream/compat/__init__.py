"""Compatibility layers: run code written for other data systems on tq_stream.

``tq_stream.compat.transfer_queue`` implements TransferQueue 0.1.11's API (the
part verl 0.9.1 uses, and the rest of its KV functions). ``install()`` registers
it as the ``transfer_queue`` module, so ``import transfer_queue as tq`` in
unmodified verl code gets tq_stream. The one line a verl user adds, in the
launcher and (through Ray) in every worker process:

    ray.init(runtime_env={"worker_process_setup_hook": "tq_stream.compat.install"})
    import tq_stream.compat; tq_stream.compat.install()    # the launcher itself
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tq_stream.stream import Stream

MODULE = "transfer_queue"
# TransferQueue's submodules that clients import or patch, registered under its names so
# ``from transfer_queue.storage.simple_storage import X`` finds tq_stream's module (one
# copy, not a second import of the same file under another name).
SUBMODULES = ("client", "controller", "metadata", "storage", "storage.simple_storage")


def install(force: bool = True) -> ModuleType:
    """Register ``tq_stream.compat.transfer_queue`` as ``sys.modules["transfer_queue"]``.

    Args:
        force: replace a ``transfer_queue`` already imported (e.g. the real package).
    Returns:
        the module now imported as ``transfer_queue``.
    """
    current = sys.modules.get(MODULE)
    module = importlib.import_module("tq_stream.compat.transfer_queue")
    if current is not None and current is not module and not force:
        return current
    sys.modules[MODULE] = module
    for sub in SUBMODULES:
        sys.modules[f"{MODULE}.{sub}"] = importlib.import_module(f"{module.__name__}.{sub}")
    return module


def stream() -> Stream:
    """The ``tq_stream.Stream`` behind the ``transfer_queue`` functions of this process
    (after ``init``), for tq_stream's own API on the same rows: loaders, samplers, stats.

    Raises:
        StateError: ``init`` was not called in this process.
    """
    from tq_stream.compat.runtime import RUNTIME

    return RUNTIME.get(auto=False)


def uninstall() -> None:
    """Remove the registration made by ``install`` (the next import finds the real one)."""
    module = sys.modules.get(MODULE)
    if module is not None and module.__name__ == "tq_stream.compat.transfer_queue":
        del sys.modules[MODULE]
        for sub in SUBMODULES:
            sys.modules.pop(f"{MODULE}.{sub}", None)


__all__ = ["install", "stream", "uninstall"]
