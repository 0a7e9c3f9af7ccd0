"""PartitionStore: the stores of one partition inside a storage unit, its written
slots and their occupancy tokens."""

from __future__ import annotations

import numpy as np
import torch

from tq_stream.backends.alloc import MIN_ROWS, Alloc, fence
from tq_stream.backends.generations import Generations
from tq_stream.backends.slabs import Store


class PartitionStore:
    """The stores of one partition; ``live`` marks written slots so an empty
    partition can hand all of its memory back; ``gen`` holds each slot's token.
    ``live`` comes from an allocator, like the slabs (see ``DenseSlab``)."""

    def __init__(self, alloc: Alloc, live_alloc: Alloc | None = None) -> None:
        self.fields: dict[str, Store] = {}
        self._live_alloc = live_alloc or alloc
        self.live_flags = self._live_alloc((MIN_ROWS,), torch.bool)  # maybe more rows
        self.live_flags.zero_()
        self.live = self.live_flags.numpy()
        self.gen = Generations(alloc)

    def mark(self, slots: np.ndarray, value: bool) -> None:
        top = int(slots.max()) + 1 if len(slots) else 0
        cap = self.live.shape[0]
        if top > cap:
            new = self._live_alloc((max(top, 2 * cap),), torch.bool).zero_()
            fence()  # as in DenseSlab.ensure
            new[:cap].copy_(self.live_flags)
            self.live_flags, self.live = new, new.numpy()
        self.live[slots] = value
