"""SequentialSampler: first ready, first out (the default)."""

from __future__ import annotations

from tq_stream.samplers.base import Candidates, Sampler, Selection


class SequentialSampler(Sampler):
    """Hands out the oldest ready rows, ``batch_size`` per rank.

    Example:
        >>> ds = tq.StreamingDataset(stream, "train", "actor", ["x"], batch_size=8,
        ...                          sampler=SequentialSampler())
    """

    @property
    def prefix_ok(self) -> bool:
        return True

    def sample(self, candidates: Candidates, batch_size: int) -> Selection:
        need = batch_size * candidates.dp_size
        if candidates.count < need:
            return Selection.wait()
        return Selection.split(candidates.index[:need], candidates.dp_size)
