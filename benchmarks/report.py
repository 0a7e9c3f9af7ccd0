"""Markdown tables (absolute figures and ratios) and a PNG chart from result rows."""

from __future__ import annotations

import math
import os
import platform
import time
from collections import defaultdict

from benchmarks.workloads.common import Row

MEMCPY = "memcpy"
PEER = "TransferQueue"
HIGHER_IS_BETTER = {"GB/s": True, "ops/s": True, "rows/s": True, "ms": False, "s": False,
                    "MB": False}


def _fmt(v: float) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"


def _ratio(v: float, ref: float | None, unit: str) -> str:
    if ref is None or not ref or math.isnan(ref) or math.isnan(v):
        return "–"
    r = v / ref if HIGHER_IS_BETTER.get(unit, True) else ref / v if v else math.nan
    return f"{r:.2f}x"


def merge_rounds(rounds: list[list[Row]], peer: str = "transferqueue") -> list[Row]:
    """Rows measured in several rounds (every system once per round, one after another)
    as one row per (workload, case, system): the median value, each round's value and,
    for the other systems, each round's ratio to ``peer`` in that same round."""
    import statistics

    groups: dict[tuple[str, str, str], list[tuple[int, Row]]] = {}
    for i, rows in enumerate(rounds):
        for r in rows:
            groups.setdefault((r.workload, r.case, r.system), []).append((i, r))
    out = []
    for (workload, case, system), items in groups.items():
        values = [r.value for _, r in items]
        extra = dict(items[0][1].extra)
        if len(rounds) > 1:
            extra["by round"] = " / ".join(_fmt(v) for v in values)
        if system != peer and len(rounds) > 1:
            ratios = [_ratio(r.value, _ref(rounds[i], case, peer), r.unit) for i, r in items]
            if any(x != "–" for x in ratios):
                extra[f"vs {PEER} by round"] = " / ".join(ratios)
        out.append(Row(workload, case, system, statistics.median(values), items[0][1].unit,
                       extra))
    return out


def _ref(rows: list[Row], case: str, name_part: str) -> float | None:
    for r in rows:
        if r.case == case and name_part.lower() in r.system.lower():
            return r.value
    return None


def tables(rows: list[Row]) -> str:
    """One markdown table per workload; ratios are 'better than' factors (>1 is better)."""
    by_workload: dict[str, list[Row]] = defaultdict(list)
    for r in rows:
        by_workload[r.workload].append(r)
    out = []
    for workload, items in by_workload.items():
        extras = sorted({k for r in items for k in r.extra})
        out.append(f"### {workload}\n")
        head = ["case", "system", "value", "unit", f"vs {MEMCPY}", f"vs {PEER}", *extras]
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---|" * len(head))
        for r in items:
            cells = [r.case, r.system, _fmt(r.value), r.unit,
                     _ratio(r.value, _ref(items, r.case, MEMCPY), r.unit),
                     _ratio(r.value, _ref(items, r.case, PEER), r.unit)]
            cells += [_fmt(r.extra[k]) if isinstance(r.extra.get(k), int | float)
                      else str(r.extra.get(k, "")) for k in extras]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def document(rows: list[Row], command: str, notes: list[str]) -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    head = [
        "# Benchmark results", "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} with `{command}` on "
        f"{os.cpu_count()} cores, {mem:.0f} GiB, Python {platform.python_version()}. "
        "All systems ran in the same run, one after another, on the same data. "
        "Ratios are 'better than' factors: above 1 means faster (or smaller) than the "
        "reference.", "",
    ]
    if notes:
        head += ["Notes:", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(head) + tables(rows)


def chart(rows: list[Row], path: str) -> str | None:
    """A bar chart of the bulk workload; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    bulk = [r for r in rows if r.workload == "bulk" and r.case.startswith("dense")]
    if not bulk:
        return None
    cases = list(dict.fromkeys(r.case for r in bulk))
    systems = list(dict.fromkeys(r.system for r in bulk))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(systems)
    for i, s in enumerate(systems):
        vals = [next((r.value for r in bulk if r.system == s and r.case == c), 0) for c in cases]
        ax.bar([j + i * width for j in range(len(cases))], vals, width, label=s)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))], cases)
    ax.set_ylabel("GB/s")
    ax.set_title("Bulk: 1024 rows x 9 float32 fields x 8192 (302 MB)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
