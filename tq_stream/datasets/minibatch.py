"""Minibatches of one loader batch, the same number on every rank (PPO epochs).

Every rank of an FSDP/DDP job must run the same number of optimizer steps, so the
number of minibatches depends only on the arguments and the batch's row count:
``num_minibatches=M`` always gives M; ``minibatch_size=s`` gives ``ceil(n / s)``
(``n // s`` with ``drop_last``), equal on every rank when the ranks' batches have
equal row counts (SeqlenBalancedSampler's default). The shuffle seed is derived from
``seed`` and the batch's loader step, so every step shuffles differently and every
replica of a rank (same step, same rows) shuffles identically.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from tq_stream.datasets.batch import batch_meta, loader_step, select_rows
from tq_stream.errors import ConfigError, check_positive


def minibatch_bounds(n: int, minibatch_size: int | None, num_minibatches: int | None,
                     drop_last: bool) -> list[tuple[int, int]]:
    """``(start, stop)`` of each minibatch of ``n`` rows.

    Raises:
        ConfigError: unless exactly one of ``minibatch_size`` / ``num_minibatches`` is
            given (an int >= 1), or if ``num_minibatches`` exceeds ``n``.
    """
    if (minibatch_size is None) == (num_minibatches is None):
        raise ConfigError(f"minibatches needs exactly one of minibatch_size or "
                          f"num_minibatches, got minibatch_size={minibatch_size!r}, "
                          f"num_minibatches={num_minibatches!r}")
    if num_minibatches is not None:
        m = check_positive("num_minibatches", num_minibatches)
        if m > n:
            raise ConfigError(f"num_minibatches must be <= the batch's {n} rows, got {m}")
        if drop_last:
            size = n // m
            return [(i * size, (i + 1) * size) for i in range(m)]
        sizes = [n // m + (i < n % m) for i in range(m)]  # as np.array_split
        starts = np.cumsum([0, *sizes]).tolist()
        return list(zip(starts[:-1], starts[1:], strict=True))
    s = check_positive("minibatch_size", minibatch_size)
    stop = n - n % s if drop_last else n
    return [(a, min(a + s, n)) for a in range(0, stop, s)]


def step_generator(batch: TensorDictBase, seed: int | None) -> torch.Generator:
    """A generator seeded by ``(seed or 0, the batch's loader step)``."""
    base = 0 if seed is None else check_positive("seed", seed, allow_zero=True)
    state = np.random.SeedSequence([base, loader_step(batch)]).generate_state(2)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


def minibatches(batch: TensorDictBase, minibatch_size: int | None = None, epochs: int = 1,
                shuffle: bool = False, seed: int | None = None,
                num_minibatches: int | None = None,
                drop_last: bool = False) -> Iterator[TensorDict]:
    """Re-iterate one loader batch in minibatches for several (PPO) epochs.

    Args:
        batch: a batch a StreamingDataLoader yielded.
        minibatch_size: rows per minibatch (the last may be shorter unless drop_last);
        num_minibatches: or the number of minibatches (sizes differ by at most one,
            or all ``n // num_minibatches`` with drop_last).
        epochs: passes over the batch.
        shuffle: a new row order every epoch (seeded by ``seed`` and the batch's step).
        drop_last: drop the rows that do not fill a whole minibatch.
    Yields:
        batches with their meta (``tq.batch_meta`` works on them).
    """
    check_positive("epochs", epochs)
    n = len(batch_meta(batch))
    bounds = minibatch_bounds(n, minibatch_size, num_minibatches, bool(drop_last))
    gen = step_generator(batch, seed) if shuffle else None
    for _ in range(epochs):
        order = torch.randperm(n, generator=gen) if gen is not None else torch.arange(n)
        for a, b in bounds:
            yield select_rows(batch, order[a:b])
