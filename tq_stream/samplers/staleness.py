"""StalenessSampler: never hand out rows produced by a policy too many versions old."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from tq_stream.errors import check_name, check_positive
from tq_stream.samplers.base import (
    Candidates,
    Sampler,
    Selection,
    check_state_keys,
    numeric_tag,
)
from tq_stream.samplers.sequential import SequentialSampler


def admission_limit(held: int, rows_per_version: int, max_staleness: int, lag: int = 0) -> int:
    """How many more rows producers may start without any exceeding ``max_staleness``.

    Assumes the consumer takes rows oldest first, ``rows_per_version`` rows per policy
    version (global batch x steps per version). A row started now queues behind the
    ``held`` rows started and not yet consumed (in flight, ready, or leased), so the
    n-th new row is consumed ``(held + n - 1) // rows_per_version`` versions from now.
    It was started by weights ``lag`` versions behind the consumer, so its staleness
    is ``lag + (held + n - 1) // rows_per_version``; keeping that <= ``max_staleness``
    for every new row gives::

        limit = max(0, (max_staleness + 1 - lag) * rows_per_version - held)

    With ``lag=0`` this is the bound of AReaL-style asynchronous RL: rows started so
    far <= (consumer_version + max_staleness + 1) * rows_per_version.

    Args:
        held: rows started by producers and not yet consumed by the task (>= 0).
        rows_per_version: rows the consumer takes per policy version (>= 1).
        max_staleness: the bound on consumer version - producing version (>= 0).
        lag: how many versions the producers' weights are behind the consumer (>= 0).

    Raises:
        ConfigError: if an argument is not an int in its range.

    Example:
        >>> admission_limit(held=100, rows_per_version=64, max_staleness=1)
        28
    """
    held = check_positive("held", held, allow_zero=True)
    rows_per_version = check_positive("rows_per_version", rows_per_version)
    max_staleness = check_positive("max_staleness", max_staleness, allow_zero=True)
    lag = check_positive("lag", lag, allow_zero=True)
    return max(0, (max_staleness + 1 - lag) * rows_per_version - held)


class StalenessSampler(Sampler):
    """Discards rows more than ``max_staleness`` policy versions old, then asks ``inner``.

    A row's staleness is ``candidates.version`` (the consumer's current version) minus
    the OLDEST version that produced it: tag ``version_tag`` (version at the end of
    generation) and, if given, tag ``start_version_tag`` (version at its start, for
    partial rollouts that span a weight update). Rows with staleness > max_staleness
    are discarded with reason ``"stale"``, rows without a version (NaN/None) with
    reason ``"missing_tag"``; the rest go to ``inner`` (default SequentialSampler).
    Rows newer than the consumer (negative staleness) are fine.

    While the consumer has never reported a version (``candidates.version is None``)
    there is no reference point: nothing is filtered and every row goes to ``inner``.

    Staleness is judged per row. Around a GroupSampler, give every row of a group the
    same start version (rows started together, e.g. ``start_version_tag``): the group
    then goes stale as a whole; rows of one group with different versions may lose
    some rows and stay incomplete (never handed out, counted as ``"tail"`` at close).

    Example:
        >>> sampler = StalenessSampler(GroupSampler(group_size=8), max_staleness=2)
    """

    inner: Sampler

    def __init__(
        self,
        inner: Sampler | None = None,
        max_staleness: int = 1,
        version_tag: str = "version",
        start_version_tag: str | None = None,
    ) -> None:
        self.inner = SequentialSampler() if inner is None else inner
        self.max_staleness = check_positive("max_staleness", max_staleness, allow_zero=True)
        self.version_tag = check_name("version_tag", version_tag)
        self.start_version_tag = (
            None
            if start_version_tag is None
            else check_name("start_version_tag", start_version_tag)
        )

    def required_tags(self) -> tuple[str, ...]:
        own = (
            (self.version_tag,)
            if self.start_version_tag is None
            else (self.version_tag, self.start_version_tag)
        )
        return (*own, *self.inner.required_tags())

    def admission_limit(self, held: int, rows_per_version: int, lag: int = 0) -> int:
        """``admission_limit(held, rows_per_version, self.max_staleness, lag)``."""
        return admission_limit(held, rows_per_version, self.max_staleness, lag)

    @property
    def prefix_ok(self) -> bool:
        return self.inner.prefix_ok

    @property
    def version_bound(self) -> bool:
        return True

    def out_of_bound(self, candidates: Candidates) -> np.ndarray:
        """Rows of a formed share stale at ``candidates.version`` (a version the
        consumer set after the share was formed for an older or predicted one)."""
        if candidates.version is None or candidates.count == 0:
            return np.zeros(candidates.count, dtype=bool)
        stale: np.ndarray = self._born(candidates) < candidates.version - self.max_staleness
        return stale

    def sample(self, candidates: Candidates, batch_size: int) -> Selection:
        fresh, discard = self._filter(candidates)
        return self.inner.sample(self._in_time(fresh), batch_size).with_discard(discard)

    def tail(self, candidates: Candidates, batch_size: int) -> Selection:
        """The closed partition's last steps: like ``sample``, stale rows (against the
        consumer's version) are discarded, rows that may be stale at a predicted turn
        are only left out (the controller ends a stream only at the end step's turn)."""
        fresh, discard = self._filter(candidates)
        return self.inner.tail(self._in_time(fresh), batch_size).with_discard(discard)

    def _born(self, candidates: Candidates) -> np.ndarray:
        born = numeric_tag(candidates.tag(self.version_tag), self.version_tag)
        if self.start_version_tag is not None:
            start = candidates.tag(self.start_version_tag)
            born = np.minimum(born, numeric_tag(start, self.start_version_tag))
        return born

    def _in_time(self, candidates: Candidates) -> Candidates:
        """The candidates still within the bound when the consumer reads this step (a
        step formed ahead of its turn, see ``Candidates.turn_version``). The others are
        not discarded: fresh now, they wait, and are discarded only once they are stale
        for a version the consumer set; the step waits for newer rows or for its turn,
        when it is formed for the version the consumer then holds."""
        turn = candidates.turn_version
        if turn is None or candidates.version is None or turn <= candidates.version \
                or candidates.count == 0:
            return candidates
        late = self._born(candidates) < turn - self.max_staleness
        return candidates.subset(~late) if late.any() else candidates

    def _filter(self, candidates: Candidates) -> tuple[Candidates, dict[str, np.ndarray]]:
        if candidates.version is None or candidates.count == 0:
            return candidates, {}
        born = self._born(candidates)
        # NaN compares False, so missing versions are caught separately, not as stale.
        stale = born < candidates.version - self.max_staleness
        lost = np.isnan(born) if born.dtype.kind == "f" else None
        bad = stale if lost is None else stale | lost
        if not bad.any():  # the common case: no copy of the candidate arrays
            return candidates, {}
        discard = {"stale": candidates.index[stale]}
        if lost is not None and lost.any():
            discard["missing_tag"] = candidates.index[lost]
        return candidates.subset(~bad), discard

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_state_keys(self, state, ("inner",))
        self.inner.load_state_dict(state["inner"])
