"""Workload ``vlm``: a VLM GRPO step's rollouts (issue 23's Proof), tq_stream against
TransferQueue 0.1.11 in the same run.

64 prompts x 8 responses; per prompt a ``[3, H, W]`` uint8 image (H, W uniform in
100..400) and 64..512 prompt tokens, per response 100..1000 token ids (int64), as many
log-probs (float32) and a reward (``vlm_data``). One producer process writes a group
every 50 ms (rollouts, then rewards); one trainer process reads one group a batch
through the system's DataLoader (``vlm_driver``). Measured per system and layout:

- storage held once every row was read (no row is freed before), against the raw bytes
  of the distinct images and tokens (each image and prompt once);
- peak resident memory of every process: producer, controller, each storage unit,
  trainer (and the ``/dev/shm`` files they map), sampled every 50 ms, summed, and its
  growth over the idle processes (their RSS just before the first write);
- write -> yield: from the start of the put of a group's last field (its rewards) to
  the trainer's DataLoader yielding the batch that holds it, p50 and p99 over rows.

tq_stream runs embedded (everything in one process, producer and trainer in threads)
and local (2 storage units) in the layouts of ``vlm_tq``; TransferQueue in the layout
of ``vlm_peer`` (not in a quick run).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from benchmarks.workloads import vlm_driver, vlm_tq
from benchmarks.workloads.common import Row, in_rounds, percentiles
from benchmarks.workloads.vlm_data import Shape, raw_bytes
from benchmarks.workloads.vlm_driver import DRIVER, RAY
from benchmarks.workloads.vlm_memory import SHM

ROUNDS = 2  # each target once per round, each run in a driver process of its own
OUTSIDE = (DRIVER, RAY)  # shown, not summed: the driver that deployed, Ray's own daemons
SYSTEMS = ("tq-embedded", "tq-local", "transferqueue")
MB = 1e6
RAW = "raw bytes of the distinct images and tokens"
MACHINE = ("2 cores, shared with other sessions and noisy: compare figures only within "
           "one run (the by-round columns), not across runs.")


def targets(quick: bool, only: set[str]) -> tuple[list[str], list[str]]:
    """Names ``"system/layout"`` to run, and notes on what was skipped."""
    names, notes = [], []
    layouts = list(vlm_tq.LAYOUTS)
    for system in SYSTEMS[:2]:
        if not only or system in only or "vlm" in only:
            names += [f"{system}/{layout}" for layout in layouts]
    if not quick and (not only or only & {"transferqueue", "vlm"}):
        from benchmarks.systems.transferqueue import TransferQueueSystem

        ok, reason = TransferQueueSystem.available()
        names += ["transferqueue/image per row (verl)"] if ok else []
        if not ok:
            notes.append(f"vlm: transferqueue skipped: {reason}")
    return names, notes


def _target(name: str) -> Any:
    system, layout = name.split("/", 1)
    if system == "transferqueue":
        from benchmarks.workloads.vlm_peer import PeerTarget

        return PeerTarget()
    return vlm_tq.TqTarget(system.removeprefix("tq-"), layout)


def rows_of(res: vlm_driver.RunResult, raw: int) -> list[Row]:
    """The result rows of one run."""
    system = f"{res.target} ({res.layout})"
    if res.errors:
        print(f"vlm {system}: " + "\n".join(res.errors), file=sys.stderr)
        return [Row("vlm", "storage held", system, float("nan"), "MB",
                    {"error": res.errors[0].splitlines()[-1][:160]})]
    mem = {r: v for r, v in res.peak_rss.items() if r not in OUTSIDE}
    pss = {r: v for r, v in res.peak_pss.items() if r not in OUTSIDE}
    growth = {r: v - res.baseline.get(r, 0) for r, v in mem.items()}
    outside = [f"{r} {res.peak_rss[r] / MB:.0f}" for r in OUTSIDE if r in res.peak_rss]
    per = ", ".join(f"{r} {v / MB:.1f}" if r == SHM else f"{r} {v / MB:.0f}"
                    for r, v in mem.items()) + \
        (f"; not counted: {', '.join(outside)}" if outside else "")
    p50, p99 = percentiles(res.latencies())
    storage = {"x raw": f"{res.storage / raw:.2f}"}
    if res.peak_rss.get(SHM):
        storage["shm resident"] = f"{res.peak_rss[SHM] / MB:.1f} MB " \
                                  f"({res.peak_rss[SHM] / raw:.2f}x raw)"
    return [
        Row("vlm", "storage held", system, res.storage / MB, "MB", storage),
        Row("vlm", "peak RSS, every process summed", system, sum(mem.values()) / MB, "MB",
            {"per process (MB)": per}),
        Row("vlm", "peak PSS, every process summed", system, sum(pss.values()) / MB, "MB",
            {"per process (MB)": ", ".join(f"{r} {v / MB:.0f}" for r, v in pss.items())}),
        Row("vlm", "peak RSS growth over idle, summed", system,
            sum(growth.values()) / MB, "MB",
            {"per process (MB)": ", ".join(f"{r} {v / MB:+.0f}" for r, v in growth.items())}),
        Row("vlm", "write -> yield p50", system, p50, "ms"),
        Row("vlm", "write -> yield p99", system, p99, "ms"),
    ]


def isolated(name: str, quick: bool, timeout: float = 900.0) -> vlm_driver.RunResult:
    """One run of target ``name`` in a fresh driver process (``python -m
    benchmarks.workloads.vlm``), so that no run inherits what another imported or
    allocated (TransferQueue's Ray, an earlier run's heap; local servers are forked
    from the driver)."""
    import json
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "benchmarks.workloads.vlm", name, out]
        try:
            subprocess.run(cmd + (["--quick"] if quick else []), timeout=timeout, check=True,
                           stdout=sys.stderr)
            with open(out) as f:
                return vlm_driver.RunResult(**json.load(f))
        except (subprocess.SubprocessError, OSError, ValueError) as exc:
            return vlm_driver.RunResult(*name.split("/", 1), errors=[f"driver: {exc!r}"])


def main(argv: list[str]) -> int:
    """``python -m benchmarks.workloads.vlm NAME OUT [--quick]``: one run of target NAME
    (``system/layout``), its RunResult written to OUT as JSON."""
    import dataclasses
    import json

    name, out = argv[0], argv[1]
    shape = Shape.quick() if "--quick" in argv else Shape.full()
    res = vlm_driver.run(_target(name), shape)
    with open(out, "w") as f:
        json.dump(dataclasses.asdict(res), f)
    return 0


def run(quick: bool, only: set[str] = frozenset()) -> tuple[list[Row], list[str]]:
    """Every target, ROUNDS times (once in a quick run); rows and notes."""
    from benchmarks.report import merge_rounds

    shape = Shape.quick() if quick else Shape.full()
    raw = raw_bytes(shape)
    total = sum(raw.values())
    names, notes = targets(quick, only)
    load: list[float] = []  # the 1-minute load average at each run's start and end

    def measure(name: str) -> list[Row]:
        load.append(os.getloadavg()[0])
        res = isolated(name, quick)
        load.append(os.getloadavg()[0])
        return rows_of(res, total)

    rounds = in_rounds(names, measure, 1 if quick else ROUNDS, "vlm")
    rows = [Row("vlm", RAW, "data", total / MB, "MB",
                {"parts": ", ".join(f"{k} {v / MB:.2f} MB" for k, v in raw.items())})]
    rows += merge_rounds(rounds)
    notes = [f"vlm: {MACHINE}",
             f"vlm: {shape.prompts} prompts x {shape.responses} responses, images "
             f"3 x H x W uint8 with H, W in {shape.px[0]}..{shape.px[1]}, a group "
             f"written every {shape.pace_s * 1e3:.0f} ms, one group a batch. "
             "Layout side: the yield time is taken after the trainer's join with the "
             "side partition.",
             "vlm: storage held: tq_stream's is what its units report "
             "(`deployment_stats()`, the arenas' allocated capacity); in local mode "
             "'shm resident' is the tmpfs blocks of the /dev/shm files the processes map "
             "(the pages actually written). TransferQueue reports none: its figure is the "
             "growth of its storage units' RSS from before the first write to after the "
             "last read.",
             "vlm: memory (sampled every 50 ms): the sums count producer, controller, "
             "every storage unit and trainer (and the /dev/shm files mapped, once); "
             "the driver that deployed and "
             "Ray's daemons are shown, not counted. tq_stream's local servers are forked "
             "from the driver (its default), so their RSS counts pages shared with it; "
             "PSS splits shared pages among the processes mapping them. 'Growth over "
             "idle' is the peak less each process's RSS just before the first write.",
             "vlm: TransferQueue's StreamingDataset sleeps a fixed 1 s whenever fewer than "
             "a batch of rows is ready (see benchmarks/peers/TRANSFERQUEUE_NOTES.md): "
             "that sleep is most of its write -> yield.",
             load_note(load)] + notes
    return rows, notes + targets_met(rows)


def load_note(load: list[float]) -> str:
    """The machine's load while the runs ran (2 cores: above 2, runs waited for CPU)."""
    got = sorted(load) or [float("nan")]
    return (f"vlm: 1-minute load average at each run's start and end: min {got[0]:.1f}, "
            f"median {got[len(got) // 2]:.1f}, max {got[-1]:.1f} (2 cores; other "
            "sessions' jobs share them, which inflates latencies most)")


def targets_met(rows: list[Row]) -> list[str]:
    """Issue 23's targets against these rows: storage <= 1.1x raw, peak memory <= 1/4
    of TransferQueue's (its summed peak RSS and PSS)."""
    def value(case: str, system: str) -> float | None:
        return next((r.value for r in rows if r.case == case and r.system == system), None)

    peer = next((r.system for r in rows if r.system.startswith("transferqueue")), None)
    out = []
    for system in dict.fromkeys(r.system for r in rows if r.system.startswith("tq-")):
        held, raw = value("storage held", system), value(RAW, "data")
        if held is None or held != held or not raw:  # a failed run
            continue
        line = f"storage {held / raw:.2f}x raw allocated"
        mine = next(r for r in rows if r.system == system and r.case == "storage held")
        if "shm resident" in mine.extra:
            line += f", {mine.extra['shm resident'].split('(')[1].rstrip(')')} resident"
        line += " (target <= 1.1x)"
        if peer is not None:
            for kind in ("RSS", "PSS"):
                case = f"peak {kind}, every process summed"
                a, b = value(case, system), value(case, peer)
                if a and b:
                    line += f"; peak {kind} {a / b:.2f} of TransferQueue's"
            line += " (target <= 0.25)"
        out.append(f"vlm targets, {system}: {line}")
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
