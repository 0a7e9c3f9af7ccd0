"""Process trees and resident memory, via psutil when installed, else Linux ``/proc``."""

from __future__ import annotations

import os

try:
    import psutil
except ImportError:  # the quick CI run needs no peers and so may lack psutil
    psutil = None

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _children_proc(pid: int) -> list[int]:
    kids: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # the command name may hold spaces; the ppid follows the closing paren
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            kids.append(int(entry))
    return kids


def tree_pids(root: int | None = None) -> list[int]:
    """``root`` (default: this process) and all its live descendants."""
    root = os.getpid() if root is None else root
    if psutil is not None:
        try:
            proc = psutil.Process(root)
            return [root] + [c.pid for c in proc.children(recursive=True)]
        except psutil.Error:
            return []
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(_children_proc(pid))
    return out


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` in bytes; 0 when the process is gone."""
    if psutil is not None:
        try:
            return psutil.Process(pid).memory_info().rss
        except psutil.Error:
            return 0
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def pss_bytes(pid: int) -> int:
    """Proportional set size: shared pages (Ray's object store, shm) split among the
    processes mapping them, so a sum over processes counts them once. 0 when unknown."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return 0


def name_of(pid: int) -> str:
    """Short process title (Ray workers show ``ray::ClassName``); '' when gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().split(b"\0")[0].decode(errors="replace")
        return os.path.basename(cmd.split()[0]) if cmd.startswith("/") else cmd
    except (OSError, IndexError):
        return ""


def rss_breakdown(pids: list[int]) -> dict[str, int]:
    """RSS per process title (summed over processes sharing a title)."""
    out: dict[str, int] = {}
    for pid in pids:
        title = name_of(pid) or str(pid)
        out[title] = out.get(title, 0) + rss_bytes(pid)
    return out
