"""Time one ``sample`` call per sampler: a 1024-row step out of 1,000,000 ready candidates.

Candidates are built the way the controller builds them: tag columns indexed by row id,
looked up with one numpy fancy index per tag (``column[rows]``). Rows: groups of 8 sharing
a ``uid``, a policy ``version``, a ``seqlen``, a 0/1 ``reward`` and a ``priority``.

Run from the repository root: ``python -m benchmarks.bench_samplers [--rows N] [--repeat R]``
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from tq_stream.samplers import (
    Candidates,
    DynamicFilterSampler,
    GroupSampler,
    PrioritySampler,
    Sampler,
    SeqlenBalancedSampler,
    SequentialSampler,
    StalenessSampler,
)

DP_SIZE = 8
BATCH_SIZE = 128  # per rank: 1024 rows a step
VERSION = 10


def make_columns(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    uid = np.arange(n, dtype=np.int64) // 8
    return {
        "uid": uid,
        "uid_str": np.array([f"prompt-{u}" for u in range(n // 8 + 1)], dtype=object)[uid],
        "version": VERSION - rng.integers(0, 3, n // 8 + 1)[uid],  # staleness 0..2
        "seqlen": rng.integers(64, 8192, n),
        "reward": rng.integers(0, 2, n).astype(np.float64),
        "priority": rng.random(n),
    }


def candidates(columns: dict[str, np.ndarray], n: int, version: int = VERSION) -> Candidates:
    rows = np.arange(n, dtype=np.int64)
    return Candidates(
        index=rows,
        ready_time=rows.astype(np.float64),
        dp_size=DP_SIZE,
        version=version,
        _tags=lambda name, r: columns[name][r],
        _has_tag=columns.__contains__,
    )


def median_ms(call: Callable[[], object], repeat: int) -> tuple[float, float]:
    call()  # warm up
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3, float(np.percentile(times, 90)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=21)
    args = parser.parse_args()
    cols = make_columns(args.rows)
    cands = candidates(cols, args.rows)
    stale = candidates(cols, args.rows, version=VERSION + 1)  # ~1/3 of groups stale

    def group() -> GroupSampler:
        return GroupSampler(group_size=8)

    cases: list[tuple[str, Callable[[], object], float | None]] = [
        ("baseline: copy of the 1024 oldest indexes", lambda: cands.index[:1024].copy(), None),
        ("baseline: one tag gather over all candidates", lambda: cands.tag("version"), None),
    ]
    samplers: list[tuple[str, Sampler, Candidates, float | None]] = [
        ("SequentialSampler", SequentialSampler(), cands, 10),
        ("GroupSampler(8)", group(), cands, 10),
        ("GroupSampler(8), str uids", GroupSampler(8, group_tag="uid_str"), cands, None),
        ("StalenessSampler(GroupSampler(8)), none stale", StalenessSampler(group(), 2), cands, 10),
        ("StalenessSampler(GroupSampler(8)), 1/3 stale", StalenessSampler(group(), 2), stale, None),
        ("SeqlenBalanced(GroupSampler(8)), best of kk/lpt", SeqlenBalancedSampler(group()),
         cands, 50),
        ("SeqlenBalanced(GroupSampler(8)), kk", SeqlenBalancedSampler(group(), method="kk"),
         cands, 50),
        ("SeqlenBalanced(GroupSampler(8)), equal_rows=False",
         SeqlenBalancedSampler(group(), equal_rows=False), cands, 50),
        (
            "SeqlenBalanced(GroupSampler(8)), lpt",
            SeqlenBalancedSampler(group(), method="lpt"),
            cands,
            50,
        ),
        ("SeqlenBalanced(Sequential), rows, best", SeqlenBalancedSampler(), cands, 50),
        ("SeqlenBalanced(Sequential), rows, kk", SeqlenBalancedSampler(method="kk"), cands, 50),
        ("SeqlenBalanced(Sequential), rows, lpt", SeqlenBalancedSampler(method="lpt"), cands, 50),
        ("DynamicFilter(GroupSampler(8))", DynamicFilterSampler(group()), cands, None),
        ("PrioritySampler", PrioritySampler(), cands, None),
    ]
    for name, sampler, c, target in samplers:
        sel = sampler.sample(c, BATCH_SIZE)
        assert sel.ready and len(sel.shares) == DP_SIZE, name
        cases.append((name, lambda s=sampler, c=c: s.sample(c, BATCH_SIZE), target))

    print(
        f"candidates: {args.rows:,} rows; step: {BATCH_SIZE} x dp_size={DP_SIZE} = "
        f"{BATCH_SIZE * DP_SIZE} rows; median and p90 of {args.repeat} calls\n"
    )
    print("| case | median ms | p90 ms | target ms | ok |")
    print("|---|---:|---:|---:|:-:|")
    for name, call, target in cases:
        med, p90 = median_ms(call, args.repeat)
        ok = "" if target is None else ("yes" if med < target else "NO")
        print(f"| {name} | {med:.3f} | {p90:.3f} | {target or ''} | {ok} |")


if __name__ == "__main__":
    main()
