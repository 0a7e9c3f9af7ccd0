"""PrioritySampler: weighted random sampling by a tag, seeded and resumable."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from tq_stream.errors import ConfigError, check_name, check_positive
from tq_stream.samplers.base import (
    Candidates,
    Sampler,
    Selection,
    check_state_keys,
    numeric_tag,
)


class PrioritySampler(Sampler):
    """Draws each step at random with probability proportional to ``priority ** alpha``.

    A step's ``batch_size * dp_size`` rows are drawn without replacement, as successive
    weighted draws (Efraimidis-Spirakis exponential keys: one O(n) pass, no loop), from
    every candidate; ``alpha=0`` is uniform over all of them (``0 ** 0 = 1``). With
    ``alpha > 0`` rows of priority 0 are drawn only when the positive ones cannot fill
    the step (then oldest first). Rows without a priority (NaN/None) are discarded
    with reason ``"missing_tag"``; a negative or infinite priority is a ConfigError.

    ``replacement=True`` is rejected: the controller hands a row to a task at most once
    and ranks must get disjoint rows, so a row cannot be drawn twice, in one step or
    across steps. (A replay mode would need controller support for re-delivery.)

    The generator is ``numpy.random.default_rng(seed)`` (PCG64); ``state_dict()`` holds
    its ``bit_generator.state`` as plain data, with the two 128-bit integers written as
    decimal strings so JSON and msgpack (ints <= 64 bits) both carry it, and a restored
    sampler draws the same sequence.

    Example:
        >>> sampler = PrioritySampler(priority_tag="abs_adv", alpha=0.6, seed=1)
    """

    STATE_KEYS = ("rng",)

    def __init__(
        self,
        priority_tag: str = "priority",
        replacement: bool = False,
        seed: int = 0,
        alpha: float = 1.0,
    ) -> None:
        self.priority_tag = check_name("priority_tag", priority_tag)
        if replacement is not False:
            raise ConfigError(
                "replacement must be False: a row is handed to a task at most once and ranks "
                f"get disjoint rows, so it cannot be drawn twice; got replacement={replacement!r}"
            )
        self.seed = check_positive("seed", seed, allow_zero=True)
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha >= 0:
            raise ConfigError(f"alpha must be a number >= 0, got {alpha!r}")
        if alpha == float("inf"):
            raise ConfigError(f"alpha must be finite, got {alpha!r}")
        self.alpha = float(alpha)
        self._rng = np.random.default_rng(seed)

    def required_tags(self) -> tuple[str, ...]:
        return (self.priority_tag,)

    def sample(self, candidates: Candidates, batch_size: int) -> Selection:
        check_positive("batch_size", batch_size)
        need = batch_size * candidates.dp_size
        rows, weights, discard = self._weights(candidates)
        if rows.shape[0] < need:
            return Selection.wait(discard)
        return Selection.split(rows[self._draw(weights, need)], candidates.dp_size, discard)

    def tail(self, candidates: Candidates, batch_size: int) -> Selection:
        check_positive("batch_size", batch_size)
        dp = candidates.dp_size
        rows, weights, discard = self._weights(candidates)
        if rows.shape[0] < dp:
            return Selection.wait(discard)
        chosen = rows[self._draw(weights, min(rows.shape[0], batch_size * dp))]
        return Selection(tuple(np.array_split(chosen, dp)), discard)

    def _weights(self, candidates: Candidates
                 ) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """The rows that have a priority, their weights, and the rows without one."""
        if candidates.count == 0:
            return candidates.index, np.empty(0), {}
        raw = candidates.tag(self.priority_tag)
        prio = numeric_tag(raw, self.priority_tag).astype(np.float64, copy=False)
        lost = np.isnan(prio)
        rows, discard = candidates.index, {}
        if lost.any():
            discard = {"missing_tag": rows[lost]}
            rows, prio = rows[~lost], prio[~lost]
        bad = ~np.isfinite(prio) | (prio < 0)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ConfigError(
                f"tag {self.priority_tag!r} must be a finite number >= 0, got {prio[i]} "
                f"for row {int(rows[i])}"
            )
        if self.alpha == 1.0:
            return rows, prio, discard
        return rows, (np.ones_like(prio) if self.alpha == 0 else prio**self.alpha), discard

    def _draw(self, weights: np.ndarray, k: int) -> np.ndarray:
        """Positions of ``k`` weighted draws without replacement, in draw order."""
        keys = np.asarray(self._rng.standard_exponential(weights.shape[0]))
        with np.errstate(divide="ignore", invalid="ignore"):
            np.divide(keys, weights, out=keys)  # weight 0 -> inf (or NaN): drawn last
        if np.count_nonzero(weights) <= k:
            positive = np.flatnonzero(weights)
            order = positive[np.argsort(keys[positive], kind="stable")]
            zero = np.flatnonzero(weights == 0)[: k - positive.shape[0]]
            return np.concatenate([order, zero])
        top = np.argpartition(keys, k - 1)[:k]
        return top[np.argsort(keys[top], kind="stable")]

    def state_dict(self) -> dict[str, Any]:
        rng = dict(self._rng.bit_generator.state)
        rng["state"] = {k: str(v) for k, v in rng["state"].items()}  # 128-bit ints
        return {"rng": rng}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_state_keys(self, state, self.STATE_KEYS)
        rng = state["rng"]
        expected = type(self._rng.bit_generator).__name__
        if not isinstance(rng, Mapping) or rng.get("bit_generator") != expected:
            raise ConfigError(
                f"state['rng'] must be a {expected} bit_generator state dict, got {rng!r:.80}"
            )
        try:
            inner = {k: int(v) for k, v in rng["state"].items()}
            self._rng.bit_generator.state = {**rng, "state": inner}
        except (AttributeError, TypeError, ValueError, KeyError) as e:
            raise ConfigError(f"state['rng'] is not a valid {expected} state: {e!r}") from e
