"""GroupSampler: hand out only complete groups (GRPO), never split across ranks or steps."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tq_stream.errors import ConfigError, check_name, check_positive
from tq_stream.samplers.base import Candidates, Sampler, Selection, missing_mask, numeric_tag

_NO_POS = np.empty(0, dtype=np.int64)


@dataclass(frozen=True)
class GroupScan:
    """The complete groups found among the oldest candidates (positions, not row indexes).

    Attributes:
        order: candidate positions of the rows of every complete group, group after
            group (groups oldest first by their oldest row, rows oldest first).
        starts: offsets into ``order``; group g is ``order[starts[g]:starts[g + 1]]``.
        discard: candidate positions to drop, by reason.
        scanned: how many of the oldest candidates were scanned.
    """

    order: np.ndarray
    starts: np.ndarray
    discard: dict[str, np.ndarray] = field(default_factory=dict)
    scanned: int = 0

    @property
    def sizes(self) -> np.ndarray:
        return np.diff(self.starts)

    @property
    def n_groups(self) -> int:
        return int(self.starts.shape[0]) - 1

    def keep(self, groups: np.ndarray, discard: dict[str, np.ndarray]) -> GroupScan:
        """Only the groups where the boolean mask ``groups`` is True, with more discards."""
        sizes = self.sizes[groups]
        rows = np.repeat(groups, self.sizes)
        starts = np.zeros(sizes.shape[0] + 1, dtype=np.int64)
        np.cumsum(sizes, out=starts[1:])
        merged = dict(self.discard)
        for reason, pos in discard.items():
            merged[reason] = np.concatenate([merged.get(reason, _NO_POS), pos])
        return GroupScan(self.order[rows], starts, merged, self.scanned)


class GroupSampler(Sampler):
    """Hands out whole complete groups of rows that share the tag ``group_tag``.

    A group is complete when it holds exactly its expected number of rows: the fixed
    ``group_size``, or the size every row of the group carries in tag ``size_tag``.
    Groups are taken oldest first (by their oldest row) and never split across ranks
    or steps.

    - Fixed ``group_size``: ``batch_size`` must be a multiple of it; each rank gets
      ``batch_size // group_size`` groups, so every share has ``batch_size`` rows.
    - Variable sizes (``size_tag``): groups are placed, oldest first, on the least
      loaded rank that still has room, so each share has at most ``batch_size`` rows
      and shares may differ in row count. A step is handed out once the complete
      groups hold at least ``batch_size * dp_size`` rows.

    Rows are discarded (whole groups, counted by reason) when a group can never be
    handed out: ``"overfull_group"`` (more rows than its size), ``"oversized_group"``
    (declared size > ``batch_size``), ``"bad_group_size"`` (size not an int >= 1, or
    rows of one group disagree), ``"missing_tag"`` (no group id or size on the row).
    Incomplete groups are never handed out; at the end of a closed partition they are
    left for the controller to count as ``"tail"``.

    Only the oldest candidates are scanned: a window of ``2 * batch_size * dp_size``
    rows (at least ``MIN_WINDOW``), widened 4x until a step is found or every
    candidate was scanned. A group is judged on the rows among current candidates:
    overfull detection is exact within the window, and rows of a group that become
    ready after the group was handed out form a new group under the same id (never
    complete unless ``group_size`` more arrive).

    Example:
        >>> sampler = GroupSampler(group_size=8)            # GRPO, 8 responses a prompt
        >>> sampler = GroupSampler(size_tag="n_samples")    # per-prompt group sizes
    """

    group_tag: str

    MIN_WINDOW = 1024

    def __init__(
        self, group_size: int | None = None, group_tag: str = "uid", size_tag: str | None = None
    ) -> None:
        if (group_size is None) == (size_tag is None):
            raise ConfigError(
                "GroupSampler needs exactly one of group_size or size_tag, "
                f"got group_size={group_size!r}, size_tag={size_tag!r}"
            )
        self.group_size = None if group_size is None else check_positive("group_size", group_size)
        self.group_tag = check_name("group_tag", group_tag)
        self.size_tag = None if size_tag is None else check_name("size_tag", size_tag)

    def required_tags(self) -> tuple[str, ...]:
        return (self.group_tag,) if self.size_tag is None else (self.group_tag, self.size_tag)

    @property
    def prefix_ok(self) -> bool:
        return True

    def sample(self, candidates: Candidates, batch_size: int) -> Selection:
        self.check_batch(batch_size)
        need = batch_size * candidates.dp_size
        window = min(candidates.count, max(2 * need, self.MIN_WINDOW))
        while True:
            scan = self.scan(candidates, window, batch_size)
            selection = self.select(candidates, scan, batch_size, final=False)
            if selection.ready or window >= candidates.count:
                return selection
            window = min(candidates.count, 4 * window)

    def tail(self, candidates: Candidates, batch_size: int) -> Selection:
        """The remaining complete groups, spread over the ranks (each rank >= 1 group)."""
        self.check_batch(batch_size)
        scan = self.scan(candidates, candidates.count, batch_size)
        return self.select(candidates, scan, batch_size, final=True)

    def progress(self, candidates: Candidates, batch_size: int) -> str:
        groups = self.scan(candidates, candidates.count, batch_size).n_groups
        size = f" of {self.group_size}" if self.group_size is not None else ""
        need = (f"{batch_size * candidates.dp_size // self.group_size} needed per step"
                if self.group_size is not None else
                f"{batch_size * candidates.dp_size} rows needed per step")
        return (f"{groups} complete group{'' if groups == 1 else 's'}{size} ready "
                f"({candidates.count} rows), {need}")

    def check_batch(self, batch_size: int) -> None:
        """Raise ConfigError unless ``batch_size`` is an int >= 1 (a multiple of group_size)."""
        check_positive("batch_size", batch_size)
        if self.group_size is not None and batch_size % self.group_size:
            raise ConfigError(
                f"batch_size must be a multiple of group_size={self.group_size} so groups are "
                f"never split across ranks, got batch_size={batch_size}"
            )

    def scan(self, candidates: Candidates, stop: int, batch_size: int) -> GroupScan:
        """Find the complete groups among the ``stop`` oldest candidates (a building block
        for wrappers such as DynamicFilterSampler)."""
        stop = min(stop, candidates.count)
        if stop <= 0:
            return GroupScan(_NO_POS, np.zeros(1, dtype=np.int64), {}, 0)
        uids = candidates.tag(self.group_tag, candidates.index[:stop])
        discard: dict[str, np.ndarray] = {}
        pos = np.arange(stop, dtype=np.int64)
        lost = missing_mask(uids)
        if self.size_tag is not None:
            raw = candidates.tag(self.size_tag, candidates.index[:stop])
            sizes = numeric_tag(raw, self.size_tag).astype(np.float64, copy=False)
            lost |= np.isnan(sizes)
        if lost.any():
            discard["missing_tag"] = pos[lost]
            pos, uids = pos[~lost], uids[~lost]
            if self.size_tag is not None:
                sizes = sizes[~lost]
        codes, counts = factorize(uids, self.group_tag)
        if self.size_tag is None:
            expected = np.full(counts.shape[0], self.group_size, dtype=np.int64)
            bad = np.zeros(counts.shape[0], dtype=bool)
        else:
            expected, bad = _group_sizes(sizes, codes, counts.shape[0])
        reasons = {
            "bad_group_size": bad,
            "overfull_group": ~bad & (counts > expected),
            "oversized_group": ~bad & (counts <= expected) & (expected > batch_size),
        }
        perm = np.argsort(codes, kind="stable")  # rows grouped, groups in age order
        for reason, groups in reasons.items():
            if groups.any():
                discard[reason] = pos[perm[np.repeat(groups, counts)]]
        complete = (counts == expected) & ~bad & (expected <= batch_size)
        keep = GroupScan(pos[perm], _starts(counts), discard, stop)
        return keep.keep(complete, {})

    def select(
        self, candidates: Candidates, scan: GroupScan, batch_size: int, *, final: bool
    ) -> Selection:
        """Place the scanned complete groups on ranks; wait if a step cannot be formed.

        ``final=False`` forms full steps only; ``final=True`` (the tail) hands out what
        there is when every rank can get at least one group.
        """
        dp = candidates.dp_size
        rank = self._assign(scan.sizes, batch_size, dp, final)
        discard = {r: candidates.index[p] for r, p in scan.discard.items() if len(p)}
        if rank is None:
            return Selection.wait(discard)
        row_rank = np.repeat(rank, scan.sizes)
        shares = tuple(candidates.index[scan.order[row_rank == r]] for r in range(dp))
        return Selection(shares, discard)

    def _assign(
        self, sizes: np.ndarray, batch_size: int, dp: int, final: bool
    ) -> np.ndarray | None:
        """The rank of each group (-1: not this step), or None when no step can be formed."""
        n = sizes.shape[0]
        if self.group_size is not None:
            per_rank = batch_size // self.group_size
            take = min(n, per_rank * dp)
            if take < (dp if final else per_rank * dp):
                return None
            counts = [len(c) for c in np.array_split(np.arange(take), dp)]
            rank = np.full(n, -1, dtype=np.int64)
            rank[:take] = np.repeat(np.arange(dp), counts)
            return rank
        if n < dp or (not final and int(sizes.sum()) < batch_size * dp):
            return None
        # Bounded look-ahead: the groups that could possibly fit into this step.
        limit = int(np.searchsorted(np.cumsum(sizes), 2 * batch_size * dp, side="right")) + 1
        rank = _least_loaded(sizes[:limit].tolist(), batch_size, dp)
        rank = np.concatenate([rank, np.full(n - rank.shape[0], -1, dtype=np.int64)])
        return rank if np.unique(rank[rank >= 0]).shape[0] == dp else None


def factorize(values: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Group codes numbered by first appearance, and the row count of each group.

    Integer ids spanning a range of at most a few times their count (prompt indexes,
    dictionary-encoded strings) take an O(n) counting path; others are sorted.
    """
    n = values.shape[0]
    if values.dtype.kind in "iu" and n:
        low = int(values.min())
        if int(values.max()) - low <= 4 * n + 1024:
            return _factorize_dense(values - low, n)
    try:
        _, first, inverse, counts = np.unique(
            values, return_index=True, return_inverse=True, return_counts=True
        )
    except TypeError as e:
        raise ConfigError(
            f"tag {name!r} must hold values of one comparable type (all str or all numbers), "
            f"got {sorted({type(v).__name__ for v in values})}"
        ) from e
    by_age = np.argsort(first, kind="stable")
    renumber = np.empty_like(by_age)
    renumber[by_age] = np.arange(by_age.shape[0])
    return renumber[inverse.reshape(-1)], counts[by_age]


def _factorize_dense(offsets: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    counts = np.bincount(offsets)
    first = np.full(counts.shape[0], n, dtype=np.int64)
    np.minimum.at(first, offsets, np.arange(n))  # (fancy assignment has no defined order)
    present = np.flatnonzero(counts)
    by_age = present[np.argsort(first[present], kind="stable")]
    renumber = np.empty(counts.shape[0], dtype=np.int64)
    renumber[by_age] = np.arange(by_age.shape[0])
    return renumber[offsets], counts[by_age]


def _group_sizes(sizes: np.ndarray, codes: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Each group's declared size and whether it is bad (not an int >= 1, or rows disagree)."""
    low = np.full(n, np.inf)
    high = np.full(n, -np.inf)
    np.minimum.at(low, codes, sizes)
    np.maximum.at(high, codes, sizes)
    bad = (low != high) | (low < 1) | (low != np.floor(low))
    return np.where(bad, 0, low).astype(np.int64), bad


def _starts(counts: np.ndarray) -> np.ndarray:
    starts = np.zeros(counts.shape[0] + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    return starts


def _least_loaded(sizes: list[int], capacity: int, dp: int) -> np.ndarray:
    """Oldest first, each group onto the least-loaded rank with room (-1 if none has)."""
    load = [0] * dp
    rank = np.full(len(sizes), -1, dtype=np.int64)
    smallest = min(sizes, default=capacity + 1)
    for g, size in enumerate(sizes):
        best = -1
        for r in range(dp):
            if load[r] + size <= capacity and (best < 0 or load[r] < load[best]):
                best = r
        if best >= 0:
            load[best] += size
            rank[g] = best
            if min(load) + smallest > capacity:
                break
    return rank
