"""PartitionSampler: one loader over several partitions.

Each step of the loader reads from one partition, chosen by a pure function of
the step number, the seed and which partitions have ended, so every rank (and
every DataLoader worker) maps step n to the same ``(partition, local step)``
without talking to the others:

- ``weights={"math": 3, "code": 1}``: data mixing; a smooth deterministic
  interleave (``SmoothInterleave``: smooth weighted round-robin, bounded by
  windows, seeded tie-breaks) so that every window of 20 steps holds each
  partition within +-5% of its share (math 15 of 20 steps, code 5) and the
  whole run within one step of it;
- ``order=["val", "train"]``: priority; every step reads the first partition in
  the order that has not ended (drain "val", then "train").

A partition ends when it is closed and drained (its end step is the same for
every rank); from there the interleave starts again among the rest (windows that
straddle an end hold the old mix on one side and the new one on the other).
Resuming needs only the seed (``state_dict``): the route is recomputed from step 0.
Each partition is read by its own task (same name) with its own inner sampler.

Example:
    >>> mix = PartitionSampler(weights={"math": 0.7, "code": 0.3},
    ...                        samplers={"math": GroupSampler(8), "code": GroupSampler(8)})
    >>> ds = tq.StreamingDataset(stream, None, "actor", ["input_ids"], batch_size=16,
    ...                          sampler=mix)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tq_stream.errors import ConfigError, check_name, check_positive
from tq_stream.samplers.base import Sampler, check_state_keys
from tq_stream.samplers.interleave import SmoothInterleave


class PartitionSampler:
    """Routes loader steps to partitions (see module docstring).

    Args:
        weights: partition -> weight > 0 (data mixing); or
        order: partitions in priority order.
        samplers: partition -> the Sampler forming that partition's steps
            (default: SequentialSampler).
        seed: orders ties of the interleave.
    """

    STATE_KEYS = ("seed",)

    def __init__(self, weights: Mapping[str, float] | None = None,
                 order: Sequence[str] | None = None,
                 samplers: Mapping[str, Sampler] | None = None, seed: int = 0) -> None:
        if (weights is None) == (order is None):
            raise ConfigError(f"PartitionSampler needs exactly one of weights or order, got "
                              f"weights={weights!r}, order={order!r}")
        if weights is not None:
            if not weights:
                raise ConfigError("weights must name at least one partition, got {}")
            for name, w in weights.items():
                check_name("partition", name)
                if isinstance(w, bool) or not isinstance(w, int | float) or not w > 0:
                    raise ConfigError(f"weights[{name!r}] must be a number > 0, got {w!r}")
            self.partitions = list(weights)
            self.weights: np.ndarray | None = np.asarray([float(weights[p])
                                                         for p in self.partitions])
        else:
            assert order is not None
            if isinstance(order, str) or not order or len(set(order)) != len(order):
                raise ConfigError(f"order must be a list of distinct partitions, got {order!r}")
            self.partitions = [check_name("partition", p) for p in order]
            self.weights = None
        self.samplers = dict(samplers or {})
        unknown = set(self.samplers) - set(self.partitions)
        if unknown:
            raise ConfigError(f"samplers must be keyed by the partitions {self.partitions}, "
                              f"got extra {sorted(unknown)}")
        for p, s in self.samplers.items():
            if not isinstance(s, Sampler):
                raise ConfigError(f"samplers[{p!r}] must be a Sampler, got {s!r}")
        self.seed = check_positive("seed", seed, allow_zero=True)
        self._ends: dict[str, int] = {}
        self._reset()

    def _reset(self) -> None:
        """Forget the computed route (it is recomputed from step 0)."""
        self._route: list[tuple[int, int]] = []  # step -> (partition index, local step)
        self._counts = [0] * len(self.partitions)
        self._mix: SmoothInterleave | None = None
        self._mix_alive: list[int] = []

    def sampler_for(self, partition: str) -> Sampler | None:
        return self.samplers.get(partition)

    def _choose(self, alive: list[int]) -> int:
        if self.weights is None:
            return alive[0]
        if self._mix is None or self._mix_alive != alive:  # (re)start among the alive
            self._mix = SmoothInterleave(self.weights[alive].tolist(), self.seed)
            self._mix_alive = alive
        return alive[self._mix.next()]

    def route(self, step: int, ends: Mapping[str, int]) -> tuple[str, int] | None:
        """``(partition, local step)`` of loader step ``step``; None once all ended.

        Args:
            ends: partition -> its end step (the local step at which it reported end).
        """
        if dict(ends) != self._ends:
            self._ends = dict(ends)
            self._reset()
        limit = [self._ends.get(p) for p in self.partitions]
        while len(self._route) <= step:
            alive = [i for i, lim in enumerate(limit) if lim is None or self._counts[i] < lim]
            if not alive:
                return None
            i = self._choose(alive)
            self._route.append((i, self._counts[i]))
            self._counts[i] += 1
        i, local = self._route[step]
        return self.partitions[i], local

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_state_keys(self, state, self.STATE_KEYS)
        self.seed = check_positive("seed", state["seed"], allow_zero=True)
        self._ends = {}
        self._reset()
