"""verl's ReplayBuffer policy two ways on the same rows (embedded, one process):
its polling loop over the compat module (``kv_list`` + selection in Python +
``kv_clear``) and tq_stream's samplers behind a waiting loader
(``examples/verl_replay_buffer.py``).

- groups sampled (and their rows read) per second, 16 groups of 8 per sample, until
  1,000 groups are used;
- time from a group's last trajectory to the trainer having it: verl polls every
  ``POLL`` seconds (here 0.05 s; verl's default is 2 s), the loader is woken by the put.
"""

from __future__ import annotations

import statistics
import threading
import time

import torch
from tensordict import TensorDict

from benchmarks.workloads.common import Row, percentiles
from benchmarks.workloads.verl import sample_once

FIELDS = ["responses", "rm_scores"]  # what the example's loader reads

GROUP, PER_SAMPLE = 8, 16
EMBEDDED = {"tq_stream": {"mode": "embedded"}}
POLL = 0.05


def _write_group(tq, uid: str, step: int = 1) -> None:
    """A finished prompt: its 8 sessions (one put, verl's tags + uid/reward) then status."""
    keys = [f"{uid}_{s}_0" for s in range(GROUP)]
    td = TensorDict({"responses": torch.arange(GROUP * 16).view(GROUP, 16),
                     "rm_scores": torch.rand(GROUP, 16)}, [GROUP])
    tq.kv_batch_put(keys=keys, partition_id="train", fields=td,
                    tags=[{"status": "success", "global_steps": step, "uid": uid,
                           "reward": float(s % 2)} for s in range(GROUP)])
    tq.kv_batch_put(keys=[uid], partition_id="train", tags=[{"status": "finished"}])


def _register(tq, uids: list[str], step: int = 1) -> None:
    tq.kv_batch_put(keys=uids, partition_id="train",
                    tags=[{"is_prompt": True, "status": "pending", "global_steps": step}
                          for _ in uids])


def _example():
    """``examples/verl_replay_buffer.py`` of this checkout (not an installed package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "verl_replay_buffer.py"
    spec = importlib.util.spec_from_file_location("verl_replay_buffer_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _loader(stream, groups_per_step: int, timeout: float = 30.0):
    return _example().loader(stream, GROUP, groups_per_step, max_off_policy=None, dapo=True,
                  timeout=timeout)


def groups_per_second(groups: int) -> list[Row]:
    import tq_stream
    import tq_stream.compat
    from tq_stream.compat import transfer_queue as tq

    rows = []
    for how in ("ReplayBuffer loop (compat)", "tq_stream samplers"):
        tq.init(EMBEDDED)
        try:
            uids = [f"g{i:06d}" for i in range(groups)]
            _register(tq, uids)
            for u in uids:
                _write_group(tq, u)
            t, taken = time.perf_counter(), 0
            if how.startswith("ReplayBuffer"):  # sample, then the trainer reads the batch
                while taken < groups and (got := sample_once(tq, "train", PER_SAMPLE,
                                                             read=FIELDS)):
                    taken += got
            else:
                stream = tq_stream.compat.stream()
                it = _loader(stream, PER_SAMPLE)
                for _ in range(groups // PER_SAMPLE):
                    meta = tq_stream.batch_meta(next(it))
                    stream.kv.clear(list(meta.keys), partition="train")
                    taken += PER_SAMPLE
            rate = taken / (time.perf_counter() - t)
        finally:
            tq.close()
        rows.append(Row("verl", f"groups sampled and read/s ({groups} groups x {GROUP})", how,
                        rate, "ops/s"))
    return rows


def _produce(tq, uids: list[str], done: dict[str, float]) -> None:
    for u in uids:
        time.sleep(0.013)  # rollouts finish at their own pace
        _write_group(tq, u)
        done[u] = time.perf_counter()


def _poll(tq, groups: int, seen: dict[str, float], stop: threading.Event) -> None:
    """verl's ReplayBuffer: list everything, pick finished prompts, sleep, again."""
    while len(seen) < groups and not stop.is_set():
        items = tq.kv_list("train").get("train", {})
        now = time.perf_counter()
        for k, t in items.items():
            if t.get("is_prompt") and t["status"] == "finished":
                seen.setdefault(k, now)
        tq.kv_clear(keys=[k for k in seen if k in items], partition_id="train")
        time.sleep(POLL)


def _wait(it, groups: int, seen: dict[str, float]) -> None:
    """tq_stream: the loader hands each complete group over as soon as it is."""
    import tq_stream

    for _ in range(groups):
        meta = tq_stream.batch_meta(next(it))
        seen[meta.tags[0]["uid"]] = time.perf_counter()


def availability(groups: int) -> list[Row]:
    """p50/p99 ms from a group's last put to the trainer holding it."""
    import tq_stream.compat
    from tq_stream.compat import transfer_queue as tq

    rows = []
    for how in ("ReplayBuffer loop (compat)", "tq_stream samplers"):
        tq.init(EMBEDDED)
        done: dict[str, float] = {}
        seen: dict[str, float] = {}
        stop = threading.Event()
        try:
            uids = [f"l{i:04d}" for i in range(groups)]
            _register(tq, uids)
            if how.startswith("ReplayBuffer"):
                consumer = threading.Thread(target=_poll, args=(tq, groups, seen, stop))
            else:
                it = _loader(tq_stream.compat.stream(), 1)
                consumer = threading.Thread(target=_wait, args=(it, groups, seen))
            consumer.start()
            _produce(tq, uids, done)
            consumer.join(60)
        finally:
            stop.set()
            tq.close()
        lat = [seen[u] - done[u] for u in done if u in seen]
        p50, p99 = percentiles(lat)
        rows.append(Row("verl", "last trajectory -> sampleable, p50", how, p50, "ms"))
        rows.append(Row("verl", "last trajectory -> sampleable, p99", how, p99, "ms",
                        {"mean_ms": statistics.mean(lat) * 1e3 if lat else float("nan")}))
    return rows


def run(quick: bool) -> list[Row]:
    return groups_per_second(160 if quick else 1000) + availability(10 if quick else 100)
