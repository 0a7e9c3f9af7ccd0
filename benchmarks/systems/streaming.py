"""The shared driver of workload 3: producer and consumer processes around any System.

``run_stream`` spawns ``spec.producers`` producer processes and ``spec.consumer_ranks``
consumer processes (``spawn`` start method, so a parent holding Ray or sockets is safe).
Each child opens its end (connects, builds its DataLoader), reports ready and waits; the
driver releases all of them at once, so connection and import time is excluded from the
figures. Children report timestamps through one queue; the driver stops when every row
was delivered (plus ``spec.drain_s`` to catch late duplicates), on ``spec.timeout_s``, or
on a child's error, then stops and if needed terminates the children.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import sys
import time
import traceback
from typing import TYPE_CHECKING, Any

from benchmarks.systems import procs
from benchmarks.systems.base import StreamResult, StreamSpec

if TYPE_CHECKING:
    from collections.abc import Callable

    from tensordict import TensorDict

    from benchmarks.systems.base import StreamReader, StreamWriter, System

now = time.monotonic


def token_rows(keys: list[str], spec: StreamSpec) -> TensorDict:
    """Default rows: one int64 ``input_ids`` field of ``spec.seq_len`` tokens per row."""
    import torch
    from tensordict import TensorDict

    n = len(keys)
    ids = torch.arange(n * spec.seq_len, dtype=torch.int64).view(n, spec.seq_len)
    return TensorDict({"input_ids": ids}, batch_size=[n])


def _exit_on_sigterm() -> None:
    """SIGTERM unwinds (so the DataLoader shuts its workers down); so does the parent's death."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux/glibc: an orphan lives until its own timeouts


def _produce(
    writer: StreamWriter,
    spec: StreamSpec,
    p: int,
    make_rows: Callable[[list[str], StreamSpec], TensorDict],
    out: Any,
    start: Any,
    stop: Any,
) -> None:
    _exit_on_sigterm()
    done: list[tuple[list[str], float, float]] = []
    try:
        keys = spec.keys_of(p)
        k = spec.rows_per_put
        # built before the start signal: row creation is not part of the write path
        chunks = [keys[i : i + k] for i in range(0, len(keys), k)]
        chunks = [(ck, make_rows(ck, spec)) for ck in chunks]
        writer.open()
        out.put(("ready", "producer", p))
        if not start.wait(spec.ready_timeout_s):
            return
        for chunk_keys, td in chunks:
            if stop.is_set():
                break
            t0 = now()
            writer.put(chunk_keys, td)
            done.append((chunk_keys, t0, now()))
    except BaseException:  # report, never hang the driver
        out.put(("error", f"producer {p}", traceback.format_exc(limit=8)))
    finally:
        out.put(("written", p, done))
        try:
            writer.close()
        except Exception:
            pass


def _consume(reader: StreamReader, spec: StreamSpec, rank: int, out: Any, start: Any, stop: Any):
    _exit_on_sigterm()
    # a spawned child inherits "spawn" as its start method; a training process has the
    # platform default (fork on Linux), which is what DataLoader workers should see
    mp.set_start_method(mp.get_all_start_methods()[0], force=True)
    try:
        reader.open()
        out.put(("ready", "consumer", rank))
        if not start.wait(spec.ready_timeout_s):
            return
        for ids in reader.batches():
            out.put(("batch", rank, list(ids), now()))
            if stop.is_set():
                break
    except SystemExit:
        pass
    except BaseException:
        out.put(("error", f"consumer rank {rank}", traceback.format_exc(limit=8)))
    finally:
        try:
            reader.close()
        except Exception:
            pass


def _stop_all(children: list[mp.process.BaseProcess], grace_s: float = 5.0) -> None:
    """Join, then SIGTERM, then SIGKILL the children, and kill what they left behind.

    A consumer's DataLoader workers are its forked children, blocked inside the dataset's
    iterator when the stream is drained; they would outlive a killed consumer.
    """
    children = [c for c in children if c.pid is not None]  # started ones
    deadline = now() + grace_s
    for c in children:
        c.join(max(0.0, deadline - now()))
    descendants = {p for c in children if c.is_alive() for p in procs.tree_pids(c.pid)[1:]}
    for c in children:
        if c.is_alive():
            c.terminate()  # SIGTERM: the child closes its DataLoader and exits
    for c in children:
        c.join(grace_s)
        if c.is_alive():
            c.kill()
            c.join(1.0)
    for pid in descendants:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:  # already gone
            pass


def _handle(msg: tuple, res: StreamResult, ids: list, state: dict) -> None:
    kind = msg[0]
    if kind == "ready":
        state["ready"] += 1
    elif kind == "error":
        res.errors.append(f"{msg[1]}: {msg[2]}")
    elif kind == "batch":
        _, rank, batch_ids, t = msg
        res.first_batch.setdefault(rank, t)
        for i in batch_ids:
            ids.append((i, rank, t))
        state["distinct"].update(batch_ids)
    elif kind == "written":
        state["producers_done"] += 1
        for keys, t0, t1 in msg[2]:
            for key in keys:
                res.write[key] = t0
                res.written[key] = t1


def run_stream(
    system: System,
    spec: StreamSpec,
    make_rows: Callable[[list[str], StreamSpec], TensorDict] = token_rows,
) -> StreamResult:
    """Run one streaming measurement against a started ``system``.

    Args:
        system: a started System with ``supports_stream``.
        spec: the run's shape.
        make_rows: picklable ``(keys, spec) -> TensorDict`` holding ``spec.fields``.

    Returns:
        The raw timestamps; ``StreamResult.summary()`` reduces them.
    """
    if not system.supports_stream:
        raise NotImplementedError(f"{system.name} does not support streaming")
    ctx = mp.get_context("spawn")
    out, start, stop = ctx.Queue(), ctx.Event(), ctx.Event()
    res = StreamResult(spec=spec)
    raw: list[tuple[Any, int, float]] = []
    state: dict[str, Any] = {"ready": 0, "producers_done": 0, "distinct": set()}
    system.stream_setup(spec)
    children: list[mp.process.BaseProcess] = []
    try:
        for r in range(spec.consumer_ranks):
            reader = system.stream_reader(spec, r)
            children.append(ctx.Process(target=_consume, args=(reader, spec, r, out, start, stop)))
        for p in range(spec.producers):
            w = system.stream_writer(spec)
            children.append(
                ctx.Process(target=_produce, args=(w, spec, p, make_rows, out, start, stop))
            )
        for c in children:
            c.start()
        _collect(res, raw, state, out, start, spec, children)
        stop.set()
        _stop_all(children)
        while True:  # whatever the children sent while stopping
            try:
                _handle(out.get_nowait(), res, raw, state)
            except (queue.Empty, EOFError, OSError):
                break
        uniq = list(dict.fromkeys(i for i, _, _ in raw))
        keys = dict(zip(uniq, system.stream_keys(spec, uniq), strict=True)) if uniq else {}
        res.deliveries = [(keys[i], rank, t) for i, rank, t in raw]
    finally:
        stop.set()
        _stop_all(children, grace_s=1.0)
        system.stream_teardown(spec)
    return res


def _collect(res, raw, state, out, start, spec: StreamSpec, children: list) -> None:
    n_children = len(children)
    deadline = now() + spec.ready_timeout_s
    while state["ready"] < n_children and not res.errors and now() < deadline:
        try:
            _handle(out.get(timeout=0.2), res, raw, state)
        except queue.Empty:
            dead = [c.exitcode for c in children if c.exitcode is not None]
            if dead:
                res.errors.append(f"driver: a child exited before ready (exit codes {dead})")
    if state["ready"] < n_children:
        res.errors.append(f"driver: only {state['ready']}/{n_children} children got ready")
        return
    res.start = now()
    start.set()
    deadline = res.start + spec.timeout_s
    drain_until = None
    while now() < deadline and not res.errors:
        if drain_until is None and len(state["distinct"]) >= spec.rows:
            drain_until = now() + spec.drain_s
        if drain_until is not None and now() >= drain_until:
            break
        try:
            _handle(out.get(timeout=0.05), res, raw, state)
        except queue.Empty:
            pass
    res.end = now()
