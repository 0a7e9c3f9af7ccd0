"""Adapters of the benchmarked systems; ``base.py`` defines the interface.

Adapter modules import their system's package lazily, so listing and ``available()``
work where the peers are not installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.systems.base import System

PEERS = {
    "memcpy": "benchmarks.systems.memcpy:MemcpySystem",
    "ray-baseline": "benchmarks.systems.ray_baseline:RayBaselineSystem",
    "transferqueue": "benchmarks.systems.transferqueue:TransferQueueSystem",
}


def load(path: str) -> type[System]:
    """The System class at ``"module:Class"``."""
    module, _, cls = path.partition(":")
    return getattr(importlib.import_module(module), cls)
