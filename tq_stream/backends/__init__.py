"""Storage units: where column bytes live (memory here; shm and remote units beside)."""

from tq_stream.backends.base import StorageUnit
from tq_stream.backends.memory import MemoryUnit

__all__ = ["MemoryUnit", "StorageUnit"]
