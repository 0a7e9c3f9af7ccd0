"""DynamicFilterSampler: drop groups whose rewards are all equal (DAPO dynamic sampling)."""

from __future__ import annotations

from collections.abc import Mapping
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
from tq_stream.samplers.group import GroupSampler, GroupScan

ON_EMPTY = ("short", "wait")


class DynamicFilterSampler(Sampler):
    """Hands out complete groups of ``inner`` whose rewards are not all equal.

    Every complete group (as ``inner``, a GroupSampler, defines it) whose ``reward_tag``
    values are all exactly equal carries no GRPO advantage signal: its rows are
    discarded with reason ``"zero_variance"`` and the step is filled with the next
    complete groups (oldest first), scanning further back if needed. A group with a
    missing reward (NaN/None) is discarded with reason ``"missing_tag"``. Groups of
    size 1 always have zero variance. Incomplete groups are never judged.

    It never loops: each call scans at most every candidate once per widening of its
    window. If the groups that pass cannot fill a step, ``sample`` returns wait (with
    the discards), so a consumer whose producers stop early gets the controller's
    bounded-wait timeout. ``on_empty`` decides the end of a closed partition
    (``tail``): ``"wait"`` hands out no short final step (what passed is left for the
    controller to count as ``"tail"``), ``"short"`` hands out the remaining passing
    groups as a short final step (``inner.tail`` rules: >= 1 group per rank).

    Example:
        >>> sampler = DynamicFilterSampler(GroupSampler(group_size=16), reward_tag="acc")
    """

    inner: GroupSampler
    group_tag: str

    def __init__(
        self,
        inner: GroupSampler,
        reward_tag: str = "reward",
        group_tag: str | None = None,
        on_empty: str = "wait",
    ) -> None:
        if not isinstance(inner, GroupSampler):
            raise ConfigError(
                f"inner must be a GroupSampler (the filter judges whole groups), "
                f"got {type(inner).__name__}"
            )
        if group_tag is not None and group_tag != inner.group_tag:
            raise ConfigError(
                f"group_tag must match inner.group_tag={inner.group_tag!r} (or be None), "
                f"got {group_tag!r}"
            )
        if on_empty not in ON_EMPTY:
            raise ConfigError(f"on_empty must be one of {ON_EMPTY}, got {on_empty!r}")
        self.inner = inner
        self.reward_tag = check_name("reward_tag", reward_tag)
        self.group_tag = inner.group_tag
        self.on_empty = on_empty

    def required_tags(self) -> tuple[str, ...]:
        return (*self.inner.required_tags(), self.reward_tag)

    @property
    def prefix_ok(self) -> bool:
        return self.inner.prefix_ok

    def sample(self, candidates: Candidates, batch_size: int) -> Selection:
        self.inner.check_batch(batch_size)
        need = batch_size * candidates.dp_size
        window = min(candidates.count, max(2 * need, self.inner.MIN_WINDOW))
        while True:
            scan = self._filter(candidates, self.inner.scan(candidates, window, batch_size))
            selection = self.inner.select(candidates, scan, batch_size, final=False)
            if selection.ready or window >= candidates.count:
                return selection
            window = min(candidates.count, 4 * window)

    def tail(self, candidates: Candidates, batch_size: int) -> Selection:
        self.inner.check_batch(batch_size)
        scan = self._filter(candidates, self.inner.scan(candidates, candidates.count, batch_size))
        selection = self.inner.select(candidates, scan, batch_size, final=True)
        return selection if self.on_empty == "short" else Selection.wait(selection.discard)

    def _filter(self, candidates: Candidates, scan: GroupScan) -> GroupScan:
        if scan.n_groups == 0:
            return scan
        raw = candidates.tag(self.reward_tag, candidates.index[scan.order])
        rewards = numeric_tag(raw, self.reward_tag).astype(np.float64, copy=False)
        first = scan.starts[:-1]
        low = np.minimum.reduceat(rewards, first)
        high = np.maximum.reduceat(rewards, first)
        lost = np.isnan(low) | np.isnan(high)
        flat = ~lost & (low == high)
        drop = {
            reason: scan.order[np.repeat(groups, scan.sizes)]
            for reason, groups in (("missing_tag", lost), ("zero_variance", flat))
            if groups.any()
        }
        return scan.keep(~(lost | flat), drop)

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_state_keys(self, state, ("inner",))
        self.inner.load_state_dict(state["inner"])
