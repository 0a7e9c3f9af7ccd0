"""One measured run of workload ``vlm``: a producer, a trainer, a deployment.

A target (``vlm_tq.TqTarget``, ``vlm_peer.PeerTarget``) is started; its producer end and
consumer end run in spawned processes (in threads of this process when the target is
in-process, i.e. embedded). Both open first (connect, build the DataLoader, make the
groups) and report ready; then the producer writes one group every ``shape.pace_s`` and
the trainer reads one group a batch. Resident memory of every process is sampled
throughout (``PeakSampler``). Once every row was yielded, the target's storage is read;
the rows are never freed before that (no consumer is declared), so it holds them all.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from benchmarks.systems import procs
from benchmarks.systems.streaming import _exit_on_sigterm, _stop_all
from benchmarks.workloads.vlm_data import Shape, groups, uid_of
from benchmarks.workloads.vlm_memory import PeakSampler

now = time.monotonic
DRIVER, RAY = "driver", "ray daemons"  # roles outside the data plane's processes


@dataclass
class RunResult:
    """What one run measured."""

    target: str
    layout: str
    written: dict[str, float] = field(default_factory=dict)  # uid -> last put's start
    yielded: dict[str, float] = field(default_factory=dict)  # row key -> first yield
    peak_rss: dict[str, int] = field(default_factory=dict)  # role -> bytes
    peak_pss: dict[str, int] = field(default_factory=dict)
    baseline: dict[str, int] = field(default_factory=dict)
    storage: int = 0
    errors: list[str] = field(default_factory=list)

    def latencies(self) -> list[float]:
        """Per row: its group's last put -> the first batch holding it was yielded (s)."""
        return [t - self.written[uid_of(k)] for k, t in self.yielded.items()
                if uid_of(k) in self.written]


def _produce(end: Any, shape: Shape, out: Any, start: Any, stop: Any) -> None:
    if threading.current_thread() is threading.main_thread():  # a spawned process
        _exit_on_sigterm()
    written: dict[str, float] = {}
    try:
        todo = groups(shape)  # made before the start: not part of the write path
        end.open()
        out.put(("ready", "producer"))
        if not start.wait(120.0):
            return
        t0 = now()
        for g, grp in enumerate(todo):
            if stop.is_set():
                break
            time.sleep(max(0.0, t0 + g * shape.pace_s - now()))
            written[grp.uid] = end.put_group(grp)
    except SystemExit:  # stopped by the driver
        pass
    except BaseException:  # report, never hang the driver
        out.put(("error", "producer", traceback.format_exc(limit=8)))
    finally:
        out.put(("written", written))
        try:
            end.close()
        except Exception:  # noqa: BLE001 - closing after an error
            pass


def _consume(end: Any, shape: Shape, out: Any, start: Any, stop: Any) -> None:
    if threading.current_thread() is threading.main_thread():
        _exit_on_sigterm()
    try:
        end.open()
        out.put(("ready", "consumer"))
        if not start.wait(120.0):
            return
        seen = 0
        for ids, t in end.batches():
            out.put(("batch", list(ids), t))
            seen += len(ids)
            if seen >= shape.rows or stop.is_set():
                break
    except SystemExit:
        pass
    except BaseException:
        out.put(("error", "consumer", traceback.format_exc(limit=8)))
    finally:
        out.put(("consumed",))
        try:
            end.close()
        except Exception:  # noqa: BLE001 - closing after an error
            pass


def run(target: Any, shape: Shape, timeout: float = 300.0) -> RunResult:
    """Start ``target``, run the producer and the trainer, measure, stop ``target``."""
    res = RunResult(target.name, target.layout)
    target.start()
    try:
        _measure(target, shape, res, timeout)
    finally:
        target.stop()
    return res


def _measure(target: Any, shape: Shape, res: RunResult, timeout: float) -> None:
    in_process = target.in_process
    ctx = mp.get_context("spawn")
    out: Any = queue.Queue() if in_process else ctx.Queue()
    start, stop = (threading.Event(), threading.Event()) if in_process else \
        (ctx.Event(), ctx.Event())
    args = [(_consume, target.consumer(shape, timeout)), (_produce, target.producer())]
    children: list[Any] = []
    for fn, end in args:
        if in_process:
            children.append(threading.Thread(target=fn, args=(end, shape, out, start, stop),
                                             daemon=True))
        else:
            children.append(ctx.Process(target=fn, args=(end, shape, out, start, stop)))

    def roles() -> dict[str, list[int]]:
        if in_process:
            return {"one process (all roles)": [os.getpid()]}
        got = {DRIVER: [os.getpid()], **target.roles()}
        consumer, producer = children[0].pid, children[1].pid
        if producer is not None:
            got["producer"] = [producer]
        if consumer is not None:
            got["consumer"] = procs.tree_pids(consumer)  # with any DataLoader workers
        return got

    with PeakSampler(roles) as sampler:
        for c in children:
            c.start()
        try:
            _collect(res, out, start, children, sampler, shape, timeout)
            if not res.errors:
                res.storage = target.storage_bytes(sampler)
            sampler.sample()
        finally:
            stop.set()
            if not in_process:
                _stop_all(children)
            for c in children:
                c.join(10.0)
    res.peak_rss, res.peak_pss = dict(sampler.peak_rss), dict(sampler.peak_pss)
    res.baseline = dict(sampler.baseline)
    while True:  # whatever the ends sent while stopping
        try:
            _handle(out.get_nowait(), res, {})
        except (queue.Empty, EOFError, OSError):
            break


def _handle(msg: tuple, res: RunResult, state: dict[str, int]) -> None:
    kind = msg[0]
    if kind == "ready":
        state["ready"] = state.get("ready", 0) + 1
    elif kind == "error":
        res.errors.append(f"{msg[1]}: {msg[2]}")
    elif kind == "batch":
        for k in msg[1]:
            res.yielded.setdefault(k, msg[2])
    elif kind == "written":
        res.written.update(msg[1])
    elif kind == "consumed":
        state["consumed"] = 1


def _collect(res: RunResult, out: Any, start: Any, children: list[Any],
             sampler: PeakSampler, shape: Shape, timeout: float) -> None:
    state: dict[str, int] = {}
    deadline = now() + 180.0
    while state.get("ready", 0) < 2 and not res.errors and now() < deadline:
        try:
            _handle(out.get(timeout=0.2), res, state)
        except queue.Empty:
            if any(getattr(c, "exitcode", None) is not None for c in children):
                res.errors.append("driver: an end exited before it was ready")
    if state.get("ready", 0) < 2:
        res.errors.append(f"driver: {state.get('ready', 0)}/2 ends got ready")
        return
    sampler.mark_baseline()
    start.set()
    deadline = now() + timeout
    while now() < deadline and not res.errors and not state.get("consumed"):
        try:
            _handle(out.get(timeout=0.05), res, state)
        except queue.Empty:
            pass
    if len(res.yielded) < shape.rows and not res.errors:
        res.errors.append(f"driver: {len(res.yielded)} of {shape.rows} rows yielded "
                          f"in {timeout:.0f} s")
