"""The modules a forked DataLoader worker would import on its first batch, imported first.

An import holds a lock on its module until the module has run. If a thread of the
trainer's process is importing a module at the moment torch forks a DataLoader worker
(a producer thread's first put imports ``numpy.ma`` through ``np.unique``, say), the
worker inherits that lock held by a thread it does not have, and its own first import
of the module waits forever. The trainer's main thread often never reads a batch
itself, so modules only the read path needs may not be imported there yet.

``preload()`` imports them in the process that makes a ``StreamingDataset``, before any
worker of it is forked: an import in progress in another thread is waited for, so a
worker finds every module complete and takes no import lock at all. The list is what
a forked worker imported when nothing was preloaded (``tests/integration/
test_fork_workers.py`` checks that a worker now imports nothing).
"""

from __future__ import annotations

import importlib

WORKER_MODULES = (
    "numpy.ma",  # np.unique (placement, reads and writes) imports it on its first call
    "torch.nested._internal.ops",  # torch's jagged tensors (ragged fields), on first use
    "tq_stream.connection.same_host",  # same-host reads: made with a stream's first unit client
    "tq_stream.connection.remote_unit",  # the unit clients behind them (RemoteUnit, UnitClient)
    "tq_stream.connection.unit_client",
)


def preload() -> None:
    """Import ``WORKER_MODULES`` (once per process; later calls cost a lookup each)."""
    for name in WORKER_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # another numpy or torch: nothing there to wait for
            pass
