"""Peak resident memory of named processes, sampled in a thread while a run goes on."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable

from benchmarks.systems import procs

SHM = "shm files mapped"


def shm_bytes(pids: Iterable[int]) -> int:
    """Bytes of the ``/dev/shm`` files these processes map (each once), as tmpfs holds
    them (allocated blocks): shared memory no process's RSS need count."""
    files: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                files.update(line.split(None, 5)[5].strip() for line in f
                             if "/dev/shm/" in line and len(line.split(None, 5)) == 6)
        except OSError:
            continue
    total = 0
    for path in files:
        try:
            total += os.stat(path.removesuffix(" (deleted)")).st_blocks * 512
        except OSError:
            continue
    return total


class PeakSampler:
    """Samples RSS and PSS of ``roles()`` (role -> pids, asked again on every sample,
    so processes that start later are picked up) every ``interval`` seconds.

    A role's peak is the largest sum over its processes seen in one sample;
    ``baseline`` holds each role's first sample after ``mark_baseline``. The role
    ``SHM`` is the ``/dev/shm`` files all of them map (:func:`shm_bytes`).
    """

    def __init__(self, roles: Callable[[], dict[str, list[int]]], interval: float = 0.05) -> None:
        self._roles, self.interval = roles, interval
        self.peak_rss: dict[str, int] = {}
        self.peak_pss: dict[str, int] = {}
        self.baseline: dict[str, int] = {}
        self._want_baseline = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vlm-rss", daemon=True)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self.sample()

    def mark_baseline(self) -> None:
        """Take the next sample as every role's baseline (before any data is written)."""
        self.baseline.clear()
        self.sample(baseline=True)

    def sample(self, baseline: bool = False) -> dict[str, int]:
        """One sample now; returns RSS per role."""
        now: dict[str, int] = {}
        roles = self._roles()
        shm = shm_bytes(p for pids in roles.values() for p in pids)
        for role, pids in [*roles.items(), (SHM, [])]:
            rss = shm if role == SHM else sum(procs.rss_bytes(p) for p in pids)
            pss = shm if role == SHM else sum(procs.pss_bytes(p) for p in pids)
            now[role] = rss
            self.peak_rss[role] = max(self.peak_rss.get(role, 0), rss)
            self.peak_pss[role] = max(self.peak_pss.get(role, 0), pss)
            if baseline:
                self.baseline[role] = rss
        return now

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()
