"""``python -m benchmarks`` / ``tq-stream bench``: every workload x every system, one run.

Systems run one after another (each started, measured, stopped), so they never compete
for the two cores; the memcpy limit and the peers run on the same data in the same run.
``--quick`` uses small shapes and no peers, for CI: it checks the harness, not speed.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from benchmarks import report
from benchmarks.systems import PEERS, load
from benchmarks.systems.tq import TqStreamSystem
from benchmarks.workloads import (
    bulk,
    controller_scale,
    nemo_rl,
    small_ops,
    startup,
    streaming,
    verl,
    vlm,
)
from benchmarks.workloads.common import Row, Shapes


def _systems(quick: bool, only: set[str]) -> list[tuple[str, object]]:
    """(name, factory) of every system to run, peers only when installed."""
    out: list[tuple[str, object]] = [("memcpy", load(PEERS["memcpy"]))]
    out += [("tq-embedded", lambda: TqStreamSystem("embedded")),
            ("tq-local", lambda: TqStreamSystem("local", 2))]
    if not quick:
        out.append(("tq-ray", lambda: TqStreamSystem("ray", 2)))
        for name in ("transferqueue", "ray-baseline"):
            out.append((name, load(PEERS[name])))
    return [(n, f) for n, f in out if not only or n in only]


def _available(name: str, factory: object) -> tuple[bool, str]:
    if name == "tq-ray":
        import importlib.util

        return (importlib.util.find_spec("ray") is not None, "ray is not installed")
    check = getattr(factory, "available", None)
    return check() if check is not None else (True, "")


WORKLOADS = ("bulk", "small", "streaming", "controller", "verl", "nemo_rl", "vlm")
VLM_SYSTEMS = {"vlm", "tq-embedded", "tq-local", "transferqueue"}


def run(quick: bool, only: set[str],
        workloads: tuple[str, ...] = WORKLOADS) -> tuple[list[Row], list[str]]:
    shapes = Shapes.quick() if quick else Shapes.full()
    rows: list[Row] = []
    notes: list[str] = []
    for name, factory in _systems(quick, only):
        ok, why = _available(name, factory)
        if not ok:
            notes.append(f"{name} skipped: {why}")
            continue
        print(f"## {name}", file=sys.stderr, flush=True)
        system = None
        try:
            got, system = startup.run(factory, shapes)  # always: it starts the system
            rows += got
            if "bulk" in workloads:
                rows += bulk.run(system, shapes)
            if "small" in workloads:
                rows += small_ops.run(system, shapes)
            if "streaming" in workloads:
                rows += streaming.run(system, shapes, quick=quick)
        except Exception as exc:  # noqa: BLE001 - report the failure, keep measuring the rest
            traceback.print_exc()
            notes.append(f"{name} failed: {exc!r:.200}")
        finally:
            if system is not None:
                system.stop()
    if "controller" in workloads and (not only or "controller" in only):
        print("## controller scale", file=sys.stderr, flush=True)
        rows += controller_scale.run(shapes)
    for name, workload in (("verl", verl), ("nemo_rl", nemo_rl)):  # against TransferQueue
        if name in workloads and (not only or only & {name, "transferqueue"}):
            print(f"## {name}", file=sys.stderr, flush=True)
            try:
                rows += workload.run(quick)
            except Exception as exc:  # noqa: BLE001 - report the failure, keep the rest
                traceback.print_exc()
                notes.append(f"{name} failed: {exc!r:.200}")
    if "vlm" in workloads and (not only or only & VLM_SYSTEMS):  # tq_stream and TQ
        print("## vlm", file=sys.stderr, flush=True)
        try:
            got, more = vlm.run(quick, only)
            rows += got
            notes += more
        except Exception as exc:  # noqa: BLE001 - report the failure, keep the rest
            traceback.print_exc()
            notes.append(f"vlm failed: {exc!r:.200}")
    _stop_ray()
    return rows, notes


def _stop_ray() -> None:
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            ray.shutdown()


def main(quick: bool = False, systems: str = "", out: str = "benchmarks/RESULTS.md",
         workloads: str = "") -> int:
    only = {s.strip() for s in systems.split(",") if s.strip()}
    chosen = tuple(w.strip() for w in workloads.split(",") if w.strip()) or WORKLOADS
    unknown = sorted(set(chosen) - set(WORKLOADS))
    if unknown:
        print(f"--workloads must name some of {', '.join(WORKLOADS)}, got {unknown}",
              file=sys.stderr)
        return 2
    rows, notes = run(quick, only, chosen)
    command = "tq-stream bench" + (" --quick" if quick else "") + \
        (f" --workloads {workloads}" if workloads else "") + \
        (f" --systems {systems}" if systems else "")
    text = report.document(rows, command, notes)
    print(text)
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            f.write(text)
        png = report.chart(rows, os.path.splitext(out)[0] + ".png")
        if png:
            print(f"chart: {png}", file=sys.stderr)
    failed = [n for n in notes if " failed: " in n]
    return 1 if failed and quick else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--systems", default="")
    parser.add_argument("--out", default="benchmarks/RESULTS.md")
    parser.add_argument("--workloads", default="",
                        help=f"comma-separated subset of {','.join(WORKLOADS)} (default: all; "
                             "start-up always runs)")
    args = parser.parse_args()
    sys.exit(main(args.quick, args.systems, args.out, args.workloads))
