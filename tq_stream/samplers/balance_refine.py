"""Local search after a multiway split into equal-sized parts: re-split pairs of parts.

Karmarkar-Karp and LPT with equal part sizes can leave the heaviest part well above
the mean (about 10 % at 8 parts of 3 or 4 items), where a better split exists. The
search takes the heaviest part and, for every other part, the best re-split of the two
parts' items into two halves of the same sizes (every split for small parts, the best
single swap of two items for larger ones); it applies the best of those while the
heaviest part gets lighter. When no pair helps and parts are small (up to
``TRIPLE_ITEMS`` items), it tries every re-split of the heaviest part with two others:
a pair search alone stops where only a cyclic exchange over three parts helps (at 3
items per part it left steps up to 7 % above the mean that split exactly). Part sizes
never change. A heuristic still: balancing equal-sized parts is NP-hard
(3-partition), so some steps cannot reach the mean, and some that can are not found.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np

EXHAUSTIVE_ITEMS = 6  # parts of up to this many items: every re-split of a pair is tried
BUDGET = 20_000_000  # element operations of the swap search, at most, per call
GOOD_ENOUGH = 1e-3  # stop once the heaviest part is this close to the mean
TRIPLE_ITEMS = 4  # parts of up to this many items: re-splits of three parts are tried
TRIPLE_GAP = 0.02  # ... while the heaviest part is this far above the mean


@functools.lru_cache(maxsize=EXHAUSTIVE_ITEMS)
def _halves(m: int) -> np.ndarray:
    """Boolean rows: every way to pick ``m`` of ``2m`` items holding item 0."""
    picks = [(0, *c) for c in itertools.combinations(range(1, 2 * m), m - 1)]
    mask = np.zeros((len(picks), 2 * m), dtype=bool)
    for i, p in enumerate(picks):
        mask[i, list(p)] = True
    return mask


def _best_resplit(a: np.ndarray, b: np.ndarray,
                  costs: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """The split of ``a`` + ``b`` (item positions, equal sizes) into two halves with the
    lightest heavier half: (its load, the two halves)."""
    pool = np.concatenate([a, b])
    if len(a) <= EXHAUSTIVE_ITEMS:
        mask = _halves(len(a))
        c = costs[pool]
        first = mask @ c
        score = np.maximum(first, c.sum() - first)
        i = int(np.argmin(score))
        return float(score[i]), pool[mask[i]], pool[~mask[i]]
    ca, cb = costs[a], costs[b]
    la, lb = float(ca.sum()), float(cb.sum())
    d = ca[:, None] - cb[None, :]  # a's item x for b's item y: a loses d, b gains d
    score = np.maximum(la - d, lb + d)
    flat = int(np.argmin(score))
    x, y = divmod(flat, len(b))
    a2, b2 = a.copy(), b.copy()
    a2[x], b2[y] = b[y], a[x]
    return float(score.flat[flat]), a2, b2


@functools.lru_cache(maxsize=TRIPLE_ITEMS)
def _thirds(m: int) -> np.ndarray:
    """Masks ``[3, ways, 3m]``: every way to cut ``3m`` items into three groups of
    ``m`` (item 0 in the first group, the lowest other item in the second)."""
    n = 3 * m
    ways = []
    for a in itertools.combinations(range(1, n), m - 1):
        first = (0, *a)
        rest = [i for i in range(n) if i not in first]
        for b in itertools.combinations(rest[1:], m - 1):
            label = np.full(n, 2)
            label[list(first)] = 0
            label[[rest[0], *b]] = 1
            ways.append(label)
    labels = np.asarray(ways)
    return np.stack([labels == g for g in range(3)])


def _best_triple(parts: list[np.ndarray], h: int, loads: np.ndarray, costs: np.ndarray,
                 budget: int) -> tuple[float, tuple[int, int], list[np.ndarray]] | None:
    """The best re-split of part ``h`` with two other parts (the lightest ones, as many
    as ``budget`` element operations allow) that makes the heaviest of the three
    lighter than ``loads[h]``: (its load, the two other parts, the three new parts)."""
    m = len(parts[h])
    masks = _thirds(m)
    per_pair = masks.shape[1] * 3 * 3 * m
    others = [j for j in np.argsort(loads).tolist() if j != h]
    while len(others) > 2 and len(others) * (len(others) - 1) // 2 * per_pair > budget:
        others.pop()  # the heaviest of the candidates goes first
    best = None
    for j, q in itertools.combinations(others, 2):
        pool = np.concatenate([parts[h], parts[j], parts[q]])
        heaviest = (masks @ costs[pool]).max(axis=0)
        i = int(np.argmin(heaviest))
        if heaviest[i] < loads[h] * (1 - 1e-12) and (best is None or heaviest[i] < best[0]):
            best = (float(heaviest[i]), (j, q), [pool[masks[g, i]] for g in range(3)])
    return best


def refine_equal(costs: np.ndarray, parts: list[np.ndarray]) -> list[np.ndarray]:
    """``parts`` (equal-sized item-position arrays) with the heaviest part made lighter
    by re-splitting it with another part, as long as that helps (see module
    docstring). Returns ``k`` sorted int64 arrays of the same sizes."""
    costs = np.asarray(costs, dtype=np.float64)
    parts = [np.asarray(p, dtype=np.int64) for p in parts]
    k = len(parts)
    m = len(parts[0]) if parts else 0
    if k < 2 or m == 0:
        return parts
    loads = np.asarray([costs[p].sum() for p in parts])
    mean = loads.sum() / k
    per_round = (k - 1) * (len(_halves(m)) * 2 * m if m <= EXHAUSTIVE_ITEMS else m * m)
    for _ in range(max(1, min(4 * k * m, BUDGET // per_round))):
        h = int(np.argmax(loads))
        if loads[h] <= mean * (1 + GOOD_ENOUGH):
            break
        best: tuple[float, int, np.ndarray, np.ndarray] | None = None
        for j in range(k):
            if j == h:
                continue
            score, a, b = _best_resplit(parts[h], parts[j], costs)
            if score < loads[h] * (1 - 1e-12) and (best is None or score < best[0]):
                best = (score, j, a, b)
        if best is None:
            triple = _best_triple(parts, h, loads, costs, BUDGET // 4) \
                if k > 2 and m <= TRIPLE_ITEMS and loads[h] > mean * (1 + TRIPLE_GAP) \
                else None
            if triple is None:
                break
            _, (j, q), new = triple
            for r, p in zip((h, j, q), new, strict=True):
                parts[r], loads[r] = p, costs[p].sum()
            continue
        _, j, a, b = best
        parts[h], parts[j] = a, b
        loads[h], loads[j] = costs[a].sum(), costs[b].sum()
    return [np.sort(p) for p in parts]
