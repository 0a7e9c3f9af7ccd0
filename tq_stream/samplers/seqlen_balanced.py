"""SeqlenBalancedSampler: re-split a step so every rank gets about the same token cost."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from tq_stream.errors import ConfigError, check_name
from tq_stream.samplers.base import (
    Candidates,
    Sampler,
    Selection,
    check_state_keys,
    numeric_tag,
)
from tq_stream.samplers.group import factorize
from tq_stream.samplers.sequential import SequentialSampler

Partition = Callable[[np.ndarray, int], list[np.ndarray]]
AUTO = "auto"


def karmarkar_karp(costs: np.ndarray, k: int) -> list[np.ndarray]:
    """Multiway largest differencing: split items into ``k`` parts of near-equal total cost.

    Every item starts as a k-tuple of parts (itself in one, the rest empty); the two
    tuples with the largest spread are merged repeatedly, pairing the heaviest part of
    one with the lightest of the other. The final spread (max - min part cost) is at
    most the largest item cost. With ``len(costs) >= k`` every part is non-empty (ties
    are broken by item count, so empty parts always meet non-empty ones).

    Returns:
        ``k`` int64 arrays of item positions, each sorted.
    """
    heap: list[tuple[float, int, list[float], list[list[int]]]] = []
    for i, c in enumerate(np.asarray(costs, dtype=np.float64).tolist()):
        heap.append((-c, i, [c] + [0.0] * (k - 1), [[i]] + [[] for _ in range(k - 1)]))
    heapq.heapify(heap)
    tiebreak = len(heap)
    while len(heap) > 1:
        _, _, sums_a, parts_a = heapq.heappop(heap)
        _, _, sums_b, parts_b = heapq.heappop(heap)
        # Both tuples are kept sorted heaviest first; pair heaviest with lightest.
        sums = [sums_a[j] + sums_b[k - 1 - j] for j in range(k)]
        parts = [parts_a[j] + parts_b[k - 1 - j] for j in range(k)]
        order = sorted(range(k), key=lambda j: (sums[j], len(parts[j])), reverse=True)
        sums = [sums[j] for j in order]
        parts = [parts[j] for j in order]
        heapq.heappush(heap, (sums[-1] - sums[0], tiebreak, sums, parts))
        tiebreak += 1
    if not heap:
        return [np.empty(0, dtype=np.int64) for _ in range(k)]
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in heap[0][3]]


def lpt(costs: np.ndarray, k: int) -> list[np.ndarray]:
    """Longest processing time first: each item, heaviest first, onto the lightest part.

    The final spread is at most the largest item cost; with ``len(costs) >= k`` every
    part is non-empty (ties go to the part with fewer items).

    Returns:
        ``k`` int64 arrays of item positions, each sorted.
    """
    costs = np.asarray(costs, dtype=np.float64)
    heap = [(0.0, 0, r) for r in range(k)]
    owner = np.empty(costs.shape[0], dtype=np.int64)
    values = costs.tolist()
    for i in np.argsort(-costs, kind="stable").tolist():
        load, count, r = heap[0]
        heapq.heapreplace(heap, (load + values[i], count + 1, r))
        owner[i] = r
    return [np.flatnonzero(owner == r) for r in range(k)]


METHODS: dict[str, Partition] = {"kk": karmarkar_karp, "lpt": lpt}


class SeqlenBalancedSampler(Sampler):
    """Takes the step ``inner`` picks and re-splits it so each rank's total cost is balanced.

    The cost of a row is its tag ``cost_tag`` (e.g. token count), or ``cost(tags)`` where
    ``tags`` maps a tag name to the array of that tag over the step's rows (read lazily),
    for any vectorised model such as ``lambda t: 2 * t["seqlen"] + t["seqlen"] ** 2 / 4096``.
    A cost must be finite and >= 0: anything else (e.g. a missing tag) is a ConfigError.

    Balancing units are rows, or whole groups when ``group_tag`` names a tag (rows with
    the same value stay on one rank, costed as their sum). ``group_tag="auto"`` uses the
    ``group_tag`` of the first sampler in the ``inner`` chain that has one (GroupSampler,
    DynamicFilterSampler), else rows. Units are split by ``method``: ``"kk"``
    (Karmarkar-Karp largest differencing), ``"lpt"`` (greedy), or a function
    ``(costs, k) -> k arrays of unit positions``. Both built-ins bound the spread of
    rank costs by the largest unit cost.

    Every rank gets a non-empty share, but shares may differ in row count (a rank with
    long rows gets fewer, another may get more than ``batch_size``). If the step has
    fewer units than ranks, ``inner``'s split is kept. The step's rows are exactly the
    ones ``inner`` chose; only their split over ranks changes.

    Example:
        >>> sampler = SeqlenBalancedSampler(GroupSampler(group_size=8), cost_tag="seqlen")
    """

    def __init__(
        self,
        inner: Sampler | None = None,
        cost_tag: str = "seqlen",
        cost: Callable[[Mapping[str, np.ndarray]], np.ndarray] | None = None,
        method: str | Partition = "kk",
        group_tag: str | None = AUTO,
    ) -> None:
        self.inner = SequentialSampler() if inner is None else inner
        self.cost_tag = check_name("cost_tag", cost_tag)
        if cost is not None and not callable(cost):
            raise ConfigError(f"cost must be a callable(tags) -> array or None, got {cost!r}")
        self.cost = cost
        if not callable(method) and method not in METHODS:
            raise ConfigError(
                f"method must be one of {sorted(METHODS)} or a callable, got {method!r}"
            )
        self.partition_fn: Partition = method if callable(method) else METHODS[method]
        self.group_tag = _find_group_tag(self.inner) if group_tag == AUTO else group_tag
        if self.group_tag is not None:
            check_name("group_tag", self.group_tag)

    def required_tags(self) -> tuple[str, ...]:
        own = () if self.cost is not None else (self.cost_tag,)
        return (*own, *self.inner.required_tags())

    @property
    def prefix_ok(self) -> bool:
        return self.inner.prefix_ok

    def sample(self, candidates: Candidates, batch_size: int) -> Selection:
        return self._balance(candidates, self.inner.sample(candidates, batch_size))

    def tail(self, candidates: Candidates, batch_size: int) -> Selection:
        return self._balance(candidates, self.inner.tail(candidates, batch_size))

    def _balance(self, candidates: Candidates, chosen: Selection) -> Selection:
        dp = candidates.dp_size
        if not chosen.ready or dp == 1:
            return chosen
        rows = chosen.rows
        costs = self._costs(candidates, rows)
        if self.group_tag is None:
            codes = np.arange(rows.shape[0])
        else:
            codes, _ = factorize(candidates.tag(self.group_tag, rows), self.group_tag)
        unit_cost = np.bincount(codes, weights=costs)
        if unit_cost.shape[0] < dp:
            return chosen
        parts = self.partition_fn(unit_cost, dp)
        owner = np.full(unit_cost.shape[0], -1, dtype=np.int64)
        for r, units in enumerate(parts):
            owner[np.asarray(units, dtype=np.int64)] = r
        if len(parts) != dp or (owner < 0).any() or min(len(p) for p in parts) == 0:
            raise ConfigError(
                f"method must split {unit_cost.shape[0]} units into {dp} non-empty parts "
                f"covering every unit, got part sizes {[len(p) for p in parts]}"
            )
        row_owner = owner[codes]  # rows keep the inner order within a rank
        return Selection(tuple(rows[row_owner == r] for r in range(dp)), chosen.discard)

    def _costs(self, candidates: Candidates, rows: np.ndarray) -> np.ndarray:
        if self.cost is None:
            costs = numeric_tag(candidates.tag(self.cost_tag, rows), self.cost_tag)
            costs = costs.astype(np.float64, copy=False)
            what = f"tag {self.cost_tag!r}"
        else:
            costs = np.asarray(self.cost(_LazyTags(candidates, rows)), dtype=np.float64)
            what = "cost(tags)"
        if costs.shape != rows.shape:
            raise ConfigError(
                f"{what} must give one cost per row, shape {rows.shape}, got {costs.shape}"
            )
        bad = ~np.isfinite(costs) | (costs < 0)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ConfigError(
                f"{what} must be a finite number >= 0 for every row, got {costs[i]} "
                f"for row {int(rows[i])} ({int(bad.sum())} bad rows)"
            )
        return costs

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_state_keys(self, state, ("inner",))
        self.inner.load_state_dict(state["inner"])


class _LazyTags(Mapping[str, np.ndarray]):
    """Tags of ``rows``, each fetched on first use (the cost function reads a few)."""

    def __init__(self, candidates: Candidates, rows: np.ndarray) -> None:
        self._candidates = candidates
        self._rows = rows
        self._cache: dict[str, np.ndarray] = {}

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._cache:
            self._cache[name] = self._candidates.tag(name, self._rows)
        return self._cache[name]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._candidates.has_tag(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._cache)

    def __len__(self) -> int:
        return len(self._cache)


def _find_group_tag(sampler: Sampler) -> str | None:
    """The group tag of the first sampler in the ``inner`` chain that has one."""
    while sampler is not None:
        tag = getattr(sampler, "group_tag", None)
        if isinstance(tag, str):
            return tag
        sampler = getattr(sampler, "inner", None)
    return None
