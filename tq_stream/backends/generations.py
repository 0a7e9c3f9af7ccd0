"""Generations: the occupancy token of each slot of a partition, a seqlock word per slot."""

from __future__ import annotations

import numpy as np
import torch

from tq_stream.backends.alloc import MIN_ROWS, Alloc, fence, grown, heap_alloc
from tq_stream.errors import StateError

UNSET = -1  # the token of a slot that is free, or being written right now


class Generations:
    """The occupancy token of each slot of one partition; a seqlock word per slot.

    Invariants: a slot's token is ``UNSET`` while a put writes it (``begin`` ..
    ``end``) and after it is freed; otherwise it is the token of the row whose
    values the slot holds. Tokens are never reused within a partition, so a
    reader that copied rows and *then* finds each slot's token equal to the one
    it expects knows that no put touched those slots during its copy and that
    they still hold its rows (a reader in another process does this on the
    shared-memory slabs, see ``ShmReader.current``). A token array that is
    replaced (growth) or discarded is first set to ``UNSET`` everywhere, so a
    reader still mapping it never trusts it. Memory order: on x86 (TSO) stores
    and loads are not reordered among themselves, which this relies on.
    """

    def __init__(self, alloc: Alloc = heap_alloc) -> None:
        self._alloc = alloc
        self.data = alloc((MIN_ROWS,), torch.int64)
        self.data.fill_(UNSET)

    def begin(self, slots: np.ndarray) -> None:
        """Mark ``slots`` as being written (growing the array to hold them)."""
        cap = self.data.shape[0]
        if int(slots.max()) >= cap:
            new = self._alloc((grown(cap, int(slots.max()) + 1),), torch.int64)
            new.fill_(UNSET)
            fence()  # as in DenseSlab.ensure: a new segment bumped the layout epoch
            new[:cap].copy_(self.data)
            self.retire()
            self.data = new
        self.data[torch.from_numpy(slots)] = UNSET

    def end(self, slots: np.ndarray, tokens: np.ndarray | None) -> None:
        """Publish the tokens of the rows just written (``None``: unknown, UNSET)."""
        idx = torch.from_numpy(slots)
        if tokens is None:
            self.data[idx] = UNSET
        else:
            self.data[idx] = torch.from_numpy(np.asarray(tokens, dtype=np.int64))

    def free(self, slots: np.ndarray) -> None:
        slots = slots[(slots >= 0) & (slots < self.data.shape[0])]
        self.data[torch.from_numpy(slots)] = UNSET

    def retire(self) -> None:
        """Invalidate every slot (before the array is replaced or dropped)."""
        self.data.fill_(UNSET)

    def holds(self, slots: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Mask over ``slots``: the slot holds the row of its token."""
        inside = (slots >= 0) & (slots < self.data.shape[0])
        ok = inside.copy()
        ok[inside] = self.data.numpy()[slots[inside]] == tokens[inside]
        return np.asarray(ok, dtype=bool)

    def check(self, partition: str, slots: np.ndarray, tokens: np.ndarray) -> None:
        """Raise StateError unless every slot holds the row of its token."""
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.shape != slots.shape:
            raise StateError(f"generations must have one entry per slot ({len(slots)}), "
                             f"got shape {tokens.shape}")
        ok = self.holds(slots, tokens)
        if not ok.all():
            raise stale_rows(partition, slots[~ok])


def stale_rows(partition: str, slots: np.ndarray) -> StateError:
    return StateError(
        f"rows must still exist to be read, but slots {slots[:5].tolist()} of partition "
        f"{partition!r} were cleared (and may hold newer rows) since their metadata was read")
