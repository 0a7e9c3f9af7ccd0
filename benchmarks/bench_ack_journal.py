"""Cost of the ack journal: ack latency with and without ``checkpoint_interval``.

With ``checkpoint_interval`` set, every ack (and every step formed) is appended
to the journal next to the controller's checkpoint before the reply
(``tq_stream/deploy/ack_journal.py``). Two measurements, each compared within
one run:

- ``local``: a local deployment (2 units); the low-level client takes a step of
  ``--batch`` rows (not timed) and acks it (timed), ``--ops`` times;
- ``in-process``: the same on a ControllerService called directly, no sockets,
  which isolates the controller's own work (the append is most of the difference);
- ``append``: the journal's own cost per record (no controller around it);
- ``restart``: the time a restarted controller takes to load its checkpoint and
  replay 1,000 / 10,000 steps journaled since.

The checkpoint interval is long (1 h), so no checkpoint is written while it runs:
what is measured is the journal's append. Run from the repository root:
``python -m benchmarks.bench_ack_journal [--ops 2000] [--batch 4]``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
import torch

import tq_stream as tq
from tq_stream.columns import schema_of
from tq_stream.deploy.services import ControllerService

P = "p"
SCHEMA = {"x": schema_of(torch.zeros(1, 4)).to_dict()}


def _stats(lat: list[float]) -> dict[str, float]:
    ms = np.asarray(lat) * 1e3
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "mean_ms": float(ms.mean())}


def bench_local(journal: bool, ops: int, batch: int) -> dict[str, float]:
    options = {"checkpoint_interval": 3600.0} if journal else {}
    stream = tq.init(mode="local", storage_units=2, **options)
    try:
        stream.create_partition(P, consumers=["t", "other"])  # rows stay stored
        w = stream.writer(P)
        for i in range(0, ops * batch, 256):
            n = min(256, ops * batch - i)
            w.put([f"k{j}" for j in range(i, i + n)], {"x": torch.zeros(n, 4)})
        client = stream.client()
        client.register_task(P, "t", ["x"], batch_size=batch)
        lat = []
        for step in range(ops):
            meta = client.get_meta(P, "t", step=step)
            t0 = time.perf_counter()
            client.ack(meta)
            lat.append(time.perf_counter() - t0)
        return _stats(lat[10:])
    finally:
        stream.close()


class _NoUnit:
    def call(self, method, args=None, timeout=None):
        return None


def bench_in_process(journal: bool, ops: int, batch: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as folder:
        ctrl = ControllerService(1, unit_client=lambda address: _NoUnit(), unit_timeout=None,
                                 owner_token="bench-" + "o" * 26,
                                 checkpoint_path=os.path.join(folder, "c.tqmeta"),
                                 checkpoint_interval=3600.0 if journal else None)
        ctrl.attach_units([{"address": "u0", "host": "", "pid": -1}])
        ctrl.create_partition(P, consumers=["t", "other"])
        ctrl.register_task(P, "t", ["x"], batch_size=batch)
        place = ctrl.reserve(P, [f"k{i}" for i in range(ops * batch)], SCHEMA)
        ctrl.commit(P, place.index, place.generation, SCHEMA)
        lat = []
        for step in range(ops):
            meta = ctrl.get_meta(P, "t", step=step, timeout=5.0, session="s")
            t0 = time.perf_counter()
            ctrl.ack(P, "t", step, 0, meta.index, meta.generation)
            lat.append(time.perf_counter() - t0)
        journal_bytes = sum(os.path.getsize(os.path.join(folder, f))
                            for f in os.listdir(folder) if ".acks." in f)
        ctrl.close()
        return {**_stats(lat[10:]), "journal_bytes_per_step": journal_bytes / ops}


def bench_replay(steps: int, batch: int) -> dict[str, float]:
    """A controller that formed and acked ``steps`` steps after its checkpoint dies; the
    restarted one loads the checkpoint and replays the journal."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "c.tqmeta")

        def controller() -> ControllerService:
            return ControllerService(1, unit_client=lambda address: _NoUnit(),
                                     unit_timeout=None, checkpoint_path=path,
                                     owner_token="bench-" + "o" * 26,
                                     checkpoint_interval=3600.0)

        ctrl = controller()
        ctrl.attach_units([{"address": "u0", "host": "", "pid": -1}])
        ctrl.create_partition(P, consumers=["t", "other"])
        ctrl.register_task(P, "t", ["x"], batch_size=batch)
        place = ctrl.reserve(P, [f"k{i}" for i in range(steps * batch)], SCHEMA)
        ctrl.commit(P, place.index, place.generation, SCHEMA)
        ctrl.checkpoints.checkpointer.write_now()
        for step in range(steps):
            meta = ctrl.get_meta(P, "t", step=step, timeout=5.0, session="s")
            ctrl.ack(P, "t", step, 0, meta.index, meta.generation)
        size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)
                   if ".acks." in f)
        started = time.perf_counter()
        again = controller()  # the dead one is simply dropped
        total = time.perf_counter() - started
        assert again.stats()[P]["tasks"]["t"]["acked"] == steps * batch
        return {"journal_mb": size / 1e6, "load_s": again.recovery["load_seconds"],
                "restart_s": total}


def bench_append() -> dict[str, float]:
    """Microseconds per appended record: an ack of 4 rows, a step of one share of 4."""
    import timeit

    from tq_stream.deploy.ack_journal import AckJournal

    with tempfile.TemporaryDirectory() as folder:
        j = AckJournal(os.path.join(folder, "c.tqmeta"), 1)
        rows, gen = np.arange(4), np.ones(4, dtype=np.int64)
        out = {}
        for name, fn in (("acked", lambda: j.acked(P, "t", 5, 0, 0, rows, gen)),
                         ("formed", lambda: j.formed(P, "t", 5, [rows], [gen]))):
            out[name] = min(timeit.repeat(fn, number=5000, repeat=5)) / 5000 * 1e6
        j.close()
        return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=2000, help="acks per measurement")
    parser.add_argument("--batch", type=int, default=4, help="rows per step")
    args = parser.parse_args(argv)
    print("| where | journal | ack p50 ms | ack p99 ms | ack mean ms | journal B/step |")
    print("|---|---|---:|---:|---:|---:|")
    for where, fn in (("in-process", bench_in_process), ("local", bench_local)):
        for journal in (False, True, False, True):  # interleaved: drift shows
            r = fn(journal, args.ops, args.batch)
            size = r.get("journal_bytes_per_step")
            print(f"| {where} | {'on' if journal else 'off'} | {r['p50_ms']:.4f} | "
                  f"{r['p99_ms']:.4f} | {r['mean_ms']:.4f} | "
                  f"{'' if size is None else f'{size:.0f}'} |", flush=True)
    us = bench_append()
    print(f"\nappend (best of 5 x 5000): an ack record {us['acked']:.1f} us, a formed step "
          f"{us['formed']:.1f} us")
    for steps in (1000, 10000):
        r = bench_replay(steps, args.batch)
        print(f"\nrestart after {steps} steps of {args.batch} rows acked since the "
              f"checkpoint: journal {r['journal_mb']:.2f} MB, load + replay "
              f"{r['load_s']:.3f} s, with the checkpoint written again {r['restart_s']:.3f} s")


if __name__ == "__main__":
    main()
