"""Finding the shared-memory segments of storage units that died, and removing them.

Segment names carry the owner's pid (``tq_<pid>_<n>``; a unit's layout epoch is
``tq_<pid>_epoch_<n>``), so ``sweep_stale`` (called by every new ``ShmUnit`` and by the
deployment) finds those of dead owners; it first moves a dead unit's layout epoch, so
readers still mapping its segments stop trusting them.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence

import numpy as np

from tq_stream.backends.segments import SHM_DIR

PREFIX = "tq_"
EPOCH = "epoch"  # names of layout-epoch segments: tq_<pid>_epoch_<n>


def shm_available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs; a zombie (dead, not yet reaped by its parent) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True  # no procfs: trust kill(0)


def sweep_stale(pids: Sequence[int] | None = None) -> int:
    """Remove segments of dead owners (or of ``pids``); returns how many were removed."""
    removed = 0
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    for name in names:
        if not name.startswith(PREFIX):
            continue
        try:
            pid = int(name.split("_")[1])
        except (IndexError, ValueError):
            continue
        if (pids is not None and pid in pids) or (pids is None and not pid_alive(pid)):
            path = os.path.join(SHM_DIR, name)
            if name.split("_")[2:3] == [EPOCH]:
                _bump_epoch(path)
            try:
                os.unlink(path)
                removed += 1
            except OSError:
                pass
    return removed


def _bump_epoch(path: str) -> None:
    """Move the layout epoch of a dead unit, so readers that still map its segments
    drop their cached layouts (and ask the unit that replaced it)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return
    try:
        with mmap.mmap(fd, 8) as m:
            epoch = np.frombuffer(m, dtype=np.int64, count=1)
            epoch[0] += 1
            del epoch
    except (OSError, ValueError):
        pass
    finally:
        os.close(fd)
