"""Workload 3: producer processes -> consumer ranks through each system's DataLoader.

2 producer processes write rows of ``stream_seq`` tokens (1 row, then 8 rows per put);
2 consumer ranks read batches of 32 with ``num_workers`` 0 and 2. Reports rows/s end to
end, time to first batch, write->yield latency p50/p99, duplicates and missing rows.
"""

from __future__ import annotations

import math
import sys

from benchmarks.systems.base import StreamSpec
from benchmarks.systems.streaming import run_stream, token_rows
from benchmarks.workloads.common import Row, Shapes


def run(system, shapes: Shapes, quick: bool = False) -> list[Row]:
    if not system.supports_stream:
        return []
    rows: list[Row] = []
    cases = [(1, 0), (8, 0), (8, 2)] if not quick else [(8, 0)]
    for per_put, workers in cases:
        spec = StreamSpec(rows=shapes.stream_rows, seq_len=shapes.stream_seq,
                          rows_per_put=per_put, num_workers=workers,
                          timeout_s=120.0 if quick else 300.0)
        try:
            result = run_stream(system, spec, token_rows)
            summary = result.summary()
            for error in result.errors:  # shown, so a failed case can be understood
                print(f"{system.name} streaming {per_put}/put workers={workers}: {error}",
                      file=sys.stderr)
        except Exception as exc:  # noqa: BLE001 - a peer's failure is a result, not a crash
            rows.append(Row("streaming", f"{per_put} rows/put, workers={workers}",
                            system.name, math.nan, "rows/s", {"error": repr(exc)[:120]}))
            continue
        rows.append(Row(
            "streaming", f"{per_put} rows/put, workers={workers}", system.name,
            summary["rows_per_s"], "rows/s",
            {"first_batch_s": summary["first_batch_s"],
             "p50_ms": summary["latency_p50_s"] * 1e3, "p99_ms": summary["latency_p99_s"] * 1e3,
             "duplicates": summary["duplicates"], "missing": summary["missing"],
             "errors": summary["errors"]}))
    return rows
