"""Whether a tensor is a view of a storage unit's shared memory (this process's maps)."""

from __future__ import annotations

import torch

from tq_stream.backends.shm import PREFIX, SHM_DIR


def shm_ranges() -> list[tuple[int, int]]:
    """Address ranges this process maps from the units' shared-memory segments."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            if f"{SHM_DIR}/{PREFIX}" in line:
                lo, hi = line.split()[0].split("-")
                out.append((int(lo, 16), int(hi, 16)))
    return out


def in_shm(t: torch.Tensor) -> bool:
    ptr = t.data_ptr()
    return any(lo <= ptr < hi for lo, hi in shm_ranges())
