"""SeqlenBalancedSampler: re-split a step so every rank gets about the same token cost."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from tq_stream.errors import ConfigError, check_name
from tq_stream.samplers.balance import METHODS, Partition, karmarkar_karp, lpt
from tq_stream.samplers.base import (
    Candidates,
    Sampler,
    Selection,
    check_state_keys,
    numeric_tag,
)
from tq_stream.samplers.group import GroupSampler, factorize
from tq_stream.samplers.sequential import SequentialSampler

__all__ = ["SeqlenBalancedSampler", "karmarkar_karp", "lpt"]

AUTO = "auto"


class SeqlenBalancedSampler(Sampler):
    """Takes the step ``inner`` picks and re-splits it so each rank's total cost is balanced.

    The cost of a row is its tag ``cost_tag`` (e.g. token count), or ``cost(tags)`` where
    ``tags`` maps a tag name to the array of that tag over the step's rows (read lazily),
    for any vectorised model such as ``lambda t: 2 * t["seqlen"] + t["seqlen"] ** 2 / 4096``.
    A cost must be finite and >= 0: anything else (e.g. a missing tag) is a ConfigError.

    Balancing units are rows, or whole groups when ``group_tag`` names a tag (rows with
    the same value stay on one rank, costed as their sum). ``group_tag="auto"`` uses the
    ``group_tag`` of the first sampler in the ``inner`` chain that has one (GroupSampler,
    DynamicFilterSampler), else rows. Units are split by ``method``: ``"best"`` (the
    default: Karmarkar-Karp and LPT both run and the split with the lighter heaviest
    rank is kept), ``"kk"`` (Karmarkar-Karp largest differencing), ``"lpt"`` (greedy), or
    a function ``(costs, k) -> k arrays of unit positions``. The built-ins bound the
    spread of rank costs by the largest unit cost (without ``equal_rows``).

    ``equal_rows=True`` (the default): every rank gets the same number of rows, so every
    rank runs the same number of minibatches and collectives (FSDP/DDP would hang
    otherwise); costs are balanced within that constraint (every rank gets the same
    number of units). Groups must then all have one size: a step whose groups differ in
    size is a ConfigError, and so is an ``inner`` chain with ``GroupSampler(size_tag=...)``
    (sizes vary by design), at construction. When a step's units do not split evenly
    over the ranks (the short last step of a closed partition), the newest units are
    left out of it (at most ``dp_size - 1`` units; at the end of the stream they are
    discarded with reason ``"tail"``); a step with fewer units than ranks waits.
    ``equal_rows=False``: row counts may differ between ranks (a rank with long rows gets
    fewer); the trainer must then agree on its step count itself (e.g. all-reduce it).

    Every rank gets a non-empty share. The step's rows are the ones ``inner`` chose
    (minus the units left out for equal rows); only their split over ranks changes.

    Example:
        >>> sampler = SeqlenBalancedSampler(GroupSampler(group_size=8), cost_tag="seqlen")
    """

    inner: Sampler

    def __init__(
        self,
        inner: Sampler | None = None,
        cost_tag: str = "seqlen",
        cost: Callable[[Mapping[str, np.ndarray]], np.ndarray] | None = None,
        method: str | Partition = "best",
        group_tag: str | None = AUTO,
        equal_rows: bool = True,
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
        self.method = method
        self.group_tag = _find_group_tag(self.inner) if group_tag == AUTO else group_tag
        if self.group_tag is not None:
            check_name("group_tag", self.group_tag)
        if not isinstance(equal_rows, bool):
            raise ConfigError(f"equal_rows must be a bool, got {equal_rows!r}")
        self.equal_rows = equal_rows
        sized = _find_sized_groups(self.inner)
        if equal_rows and sized is not None and sized.group_tag == self.group_tag:
            raise ConfigError(
                f"equal_rows=True needs groups of one size, but GroupSampler(size_tag="
                f"{sized.size_tag!r}) makes groups of varying sizes; pass equal_rows=False "
                f"and make the ranks agree on their step count (e.g. all-reduce it)"
            )

    def required_tags(self) -> tuple[str, ...]:
        own = () if self.cost is not None else (self.cost_tag,)
        return (*own, *self.inner.required_tags())

    @property
    def prefix_ok(self) -> bool:
        return self.inner.prefix_ok

    @property
    def version_bound(self) -> bool:
        return self.inner.version_bound

    def out_of_bound(self, candidates: Candidates) -> np.ndarray:
        return self.inner.out_of_bound(candidates)

    def sample(self, candidates: Candidates, batch_size: int) -> Selection:
        return self._balance(candidates, self.inner.sample(candidates, batch_size))

    def tail(self, candidates: Candidates, batch_size: int) -> Selection:
        return self._balance(candidates, self.inner.tail(candidates, batch_size))

    def _balance(self, candidates: Candidates, chosen: Selection) -> Selection:
        dp = candidates.dp_size
        if not chosen.ready or dp == 1:
            return chosen
        rows = chosen.rows
        if self.group_tag is None:
            codes = np.arange(rows.shape[0])
        else:
            codes, _ = factorize(candidates.tag(self.group_tag, rows), self.group_tag)
        if self.equal_rows:
            even, codes = self._even_units(rows, codes, dp)
            if even is None:
                return Selection.wait(chosen.discard)
            rows = even
        costs = self._costs(candidates, rows)
        unit_cost = np.bincount(codes, weights=costs)
        if unit_cost.shape[0] < dp:
            return chosen
        owner = self._split(unit_cost, dp)
        row_owner = owner[codes]  # rows keep the inner order within a rank
        return Selection(tuple(rows[row_owner == r] for r in range(dp)), chosen.discard)

    def _even_units(self, rows: np.ndarray, codes: np.ndarray,
                    dp: int) -> tuple[np.ndarray | None, np.ndarray]:
        """The step's first ``n_units // dp * dp`` units (codes number units by first
        appearance, so the newest are left out); None if fewer units than ranks.

        Raises:
            ConfigError: if the units (groups) differ in row count.
        """
        sizes = np.bincount(codes)
        if (sizes != sizes[0]).any():
            raise ConfigError(
                f"equal_rows=True needs groups (tag {self.group_tag!r}) of one size in a "
                f"step, got sizes {sorted(set(sizes.tolist()))[:8]}; pass equal_rows=False "
                f"and make the ranks agree on their step count (e.g. all-reduce it)"
            )
        keep = sizes.shape[0] // dp * dp
        if keep == 0:
            return None, codes
        if keep == sizes.shape[0]:
            return rows, codes
        mask = codes < keep
        return rows[mask], codes[mask]

    def _split(self, unit_cost: np.ndarray, dp: int) -> np.ndarray:
        """The rank of every unit."""
        if callable(self.method):
            parts = self.method(unit_cost, dp)
        else:
            parts = METHODS[self.method](unit_cost, dp, self.equal_rows)
        n = unit_cost.shape[0]
        owner = np.full(n, -1, dtype=np.int64)
        for r, units in enumerate(parts):
            owner[np.asarray(units, dtype=np.int64)] = r
        sizes = [len(p) for p in parts]
        even = not self.equal_rows or len(set(sizes)) == 1
        if len(parts) != dp or (owner < 0).any() or min(sizes) == 0 or not even \
                or sum(sizes) != n:
            rule = "equal-sized " if self.equal_rows else ""
            raise ConfigError(
                f"method must split {n} units into {dp} non-empty {rule}parts covering "
                f"every unit once, got part sizes {sizes}"
            )
        return owner

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


def _chain(sampler: object) -> Iterator[Sampler]:
    """``sampler`` and its ``inner`` ones, while each is a Sampler (a subclass may use
    the name ``inner`` for something of its own)."""
    while isinstance(sampler, Sampler):
        yield sampler
        sampler = sampler.inner


def _find_sized_groups(sampler: Sampler) -> GroupSampler | None:
    """The first GroupSampler with per-group sizes (``size_tag``) in the ``inner`` chain."""
    for s in _chain(sampler):
        if isinstance(s, GroupSampler) and s.size_tag is not None:
            return s
    return None


def _find_group_tag(sampler: Sampler) -> str | None:
    """The group tag of the first sampler in the ``inner`` chain that has one."""
    for s in _chain(sampler):
        if isinstance(s.group_tag, str):
            return s.group_tag
    return None
