"""Multiway number partitioning: split unit costs into ``k`` parts of near-equal total.

Two heuristics, each optionally with equal part sizes (every part gets ``n / k`` items),
and ``best_partition`` that runs both (with equal sizes, each followed by the local
search of ``balance_refine``) and keeps the better split. Used by
SeqlenBalancedSampler; a part is an int64 array of item positions.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import numpy as np

from tq_stream.errors import ConfigError
from tq_stream.samplers.balance_refine import refine_equal

Partition = Callable[[np.ndarray, int], list[np.ndarray]]


def _check_equal(n: int, k: int) -> None:
    if n % k:
        raise ConfigError(f"equal_size needs a number of items divisible by k={k}, got {n}")


def karmarkar_karp(costs: np.ndarray, k: int, equal_size: bool = False) -> list[np.ndarray]:
    """Multiway largest differencing: split items into ``k`` parts of near-equal total cost.

    Every item starts as a k-tuple of parts (itself in one, the rest empty); the two
    tuples with the largest spread are merged repeatedly, pairing the heaviest part of
    one with the lightest of the other. The final spread (max - min part cost) is at
    most the largest item cost. With ``len(costs) >= k`` every part is non-empty (ties
    are broken by item count, so empty parts always meet non-empty ones).

    With ``equal_size`` (balanced largest differencing) the items, heaviest first, are
    cut into runs of ``k`` and every run starts as one tuple with one item per part, so
    every merge keeps the parts' item counts equal.

    Returns:
        ``k`` int64 arrays of item positions, each sorted.
    Raises:
        ConfigError: with ``equal_size``, if ``len(costs)`` is not a multiple of ``k``.
    """
    values = np.asarray(costs, dtype=np.float64)
    heap: list[tuple[float, int, list[float], list[list[int]]]] = []
    if equal_size:
        _check_equal(values.shape[0], k)
        order = np.argsort(-values, kind="stable").tolist()
        for t, start in enumerate(range(0, len(order), k)):
            run = order[start : start + k]  # heaviest first, one item per part
            sums = [float(values[i]) for i in run]
            heap.append((sums[-1] - sums[0], t, sums, [[i] for i in run]))
    else:
        for i, c in enumerate(values.tolist()):
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


def lpt(costs: np.ndarray, k: int, equal_size: bool = False) -> list[np.ndarray]:
    """Longest processing time first: each item, heaviest first, onto the lightest part.

    The final spread is at most the largest item cost; with ``len(costs) >= k`` every
    part is non-empty (ties go to the part with fewer items). With ``equal_size`` a
    part that holds ``n / k`` items takes no more.

    Returns:
        ``k`` int64 arrays of item positions, each sorted.
    Raises:
        ConfigError: with ``equal_size``, if ``len(costs)`` is not a multiple of ``k``.
    """
    costs = np.asarray(costs, dtype=np.float64)
    n = costs.shape[0]
    room = n // k if equal_size else n
    if equal_size:
        _check_equal(n, k)
    heap = [(0.0, 0, r) for r in range(k)]
    owner = np.empty(n, dtype=np.int64)
    values = costs.tolist()
    for i in np.argsort(-costs, kind="stable").tolist():
        load, count, r = heap[0]
        if count + 1 < room:
            heapq.heapreplace(heap, (load + values[i], count + 1, r))
        else:  # the part is full: it leaves the heap
            heapq.heappop(heap)
        owner[i] = r
    return [np.flatnonzero(owner == r) for r in range(k)]


def part_loads(costs: np.ndarray, parts: list[np.ndarray]) -> np.ndarray:
    """Total cost of each part."""
    costs = np.asarray(costs, dtype=np.float64)
    return np.asarray([costs[np.asarray(p, dtype=np.int64)].sum() for p in parts])


def best_partition(costs: np.ndarray, k: int, equal_size: bool = False) -> list[np.ndarray]:
    """The better of ``karmarkar_karp`` and ``lpt``: the lower heaviest part (the slowest
    rank sets the step time), then the higher lightest part; Karmarkar-Karp on a tie.
    With ``equal_size`` each is first improved by ``balance_refine.refine_equal``."""
    best, key = None, None
    for method in (karmarkar_karp, lpt):
        parts = method(costs, k, equal_size)
        if equal_size:
            parts = refine_equal(costs, parts)
        loads = part_loads(costs, parts)
        score = (float(loads.max()), -float(loads.min())) if len(loads) else (0.0, 0.0)
        if key is None or score < key:
            best, key = parts, score
    assert best is not None
    return best


METHODS: dict[str, Callable[..., list[np.ndarray]]] = {
    "best": best_partition, "kk": karmarkar_karp, "lpt": lpt,
}
