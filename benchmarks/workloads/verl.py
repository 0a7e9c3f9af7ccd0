"""Workload ``verl``: what verl 0.9.1's v1 trainer asks of ``transfer_queue``, on
TransferQueue 0.1.11 and on ``tq_stream.compat.transfer_queue`` side by side.

Both are driven through the same module-level functions verl calls:

- start-up: ``init(conf)`` with verl's ``transfer_queue`` node to the first
  (tag-only) ``kv_batch_put``;
- ``kv_batch_put`` / ``kv_batch_get`` of 256 rows x 20 fields (8 ragged tensor fields,
  12 non-tensor ones, as agent-loop outputs carry);
- ``kv_list()`` at 10^4 and 10^5 keys (verl's ReplayBuffer lists every partition on
  every poll);
- sampler calls per second: one ReplayBuffer poll-and-sample (``kv_list``, pick the
  oldest finished groups, ``kv_clear`` their prompts) over 1,000 groups of 8;
- the same policy with tq_stream's own samplers (``examples/verl_replay_buffer.py``):
  groups sampled per second, and time from a group's last trajectory to the moment
  it can be sampled (polling verl-style at 0.05 s vs a waiting loader).
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch
from tensordict import NonTensorStack, TensorDict

from benchmarks.workloads.common import Row, in_rounds

ROWS, FIELDS, RAGGED = 256, 20, 8
ROUNDS = 3  # every target once per round (see common.in_rounds)
GROUP, GROUPS = 8, 1000


class Target:
    """One ``transfer_queue`` implementation: ``start`` returns the module."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._owned_ray = False

    def conf(self, units: int = 2) -> dict[str, Any]:
        return {"backend": {"storage_backend": "SimpleStorage",
                            "SimpleStorage": {"num_data_storage_units": units,
                                              "total_storage_size": None}}}

    @property
    def mode(self) -> str:
        """The tq_stream mode of a compat target ("" for TransferQueue)."""
        return "" if self.name == "transferqueue" else self.name.rsplit("-", 1)[-1]

    def module(self) -> Any:
        """The ``transfer_queue`` package of this target, registered under that name
        (Ray started first for TransferQueue); nothing initialized yet."""
        if self.name == "transferqueue":
            from benchmarks.systems import ray_util
            from benchmarks.systems.transferqueue import real_module

            tq = real_module()
            self._owned_ray = ray_util.ensure_ray()
            return tq
        import tq_stream.compat

        return tq_stream.compat.install()

    def start(self) -> Any:
        tq = self.module()
        if self.name == "transferqueue":
            from omegaconf import OmegaConf

            tq.init(OmegaConf.create(self.conf()))
        else:
            tq.init({**self.conf(), "tq_stream": {"mode": self.mode}})
        return tq

    def stop(self, tq: Any) -> None:
        tq.close()
        if self.mode:
            import tq_stream.compat

            tq_stream.compat.uninstall()
        if self._owned_ray:
            from benchmarks.systems import ray_util

            ray_util.shutdown(True)
            self._owned_ray = False


def rollout_batch(n: int, seed: int = 0) -> TensorDict:
    """``n`` agent-loop outputs: RAGGED variable-length tensors + non-tensor fields."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(64, 512, (n,), generator=g).tolist()
    fields: dict[str, Any] = {}
    for i in range(RAGGED):
        dtype = torch.int64 if i < 6 else torch.float32
        rows = [torch.arange(L, dtype=dtype) + i for L in lengths]
        fields[f"t{i}"] = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    for i in range(FIELDS - RAGGED):
        kind = i % 3
        vals = [{"acc": float(j % 2), "turns": j} if kind == 0 else f"src-{j}" if kind == 1
                else j for j in range(n)]
        fields[f"o{i}"] = NonTensorStack(*vals)
    return TensorDict(fields, batch_size=[n])


def _timed(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def _register(tq: Any, partition: str, n: int, step: int = 1, chunk: int = 10_000) -> list[str]:
    keys = [f"p{partition}{i:07d}" for i in range(n)]
    for lo in range(0, n, chunk):
        part = keys[lo:lo + chunk]
        tq.kv_batch_put(keys=part, partition_id=partition,
                        tags=[{"is_prompt": True, "status": "finished", "global_steps": step}
                              for _ in part])
    return keys


def sample_once(tq: Any, partition: str, batch_groups: int,
                read: list[str] | None = None) -> int:
    """One ReplayBuffer.sample (sync, enough groups ready): the calls verl makes; with
    ``read``, the trainer then reads those fields of the batch."""
    data = tq.kv_list() or {}
    items = data.get(partition, {})
    finished = [k for k, t in items.items() if t.get("is_prompt") and t["status"] == "finished"]
    finished.sort(key=lambda k: items[k]["global_steps"])
    chosen = set(finished[:batch_groups])
    tq.kv_clear(partition_id=partition, keys=list(chosen))
    keys = [k for k in items if k.split("_")[0] in chosen and not items[k].get("is_prompt")]
    if read and keys:
        tq.kv_batch_get(keys=keys, partition_id=partition, select_fields=read)
    tq.kv_clear(partition_id=partition, keys=keys)  # end of the train step
    return len(chosen)


def measure(target: Target, quick: bool) -> list[Row]:
    rows: list[Row] = []
    name, repeats = target.name, (1 if quick else 7)
    t = time.perf_counter()
    tq = target.start()
    try:
        tq.kv_batch_put(keys=["warm"], partition_id="train", tags=[{"status": "pending"}])
        rows.append(Row("verl", "start-up: init to first put", name,
                        time.perf_counter() - t, "s"))
        n = 32 if quick else ROWS
        td = rollout_batch(n)
        runs = iter(range(1_000_000))

        def put() -> None:
            r = next(runs)
            tq.kv_batch_put(keys=[f"r{r}_{i}" for i in range(n)], partition_id="io", fields=td,
                            tags=[{"status": "success"}] * n)

        rows.append(Row("verl", f"kv_batch_put {n} rows x {FIELDS} fields", name,
                        _timed(put, repeats) * 1e3, "ms"))
        last_run = next(runs) - 1
        last = [f"r{last_run}_{i}" for i in range(n)]
        rows.append(Row("verl", f"kv_batch_get {n} rows x {FIELDS} fields", name,
                        _timed(lambda: tq.kv_batch_get(keys=last, partition_id="io"),
                               repeats) * 1e3, "ms"))
        tq.kv_clear(keys=[f"r{r}_{i}" for r in range(repeats + 2) for i in range(n)],
                    partition_id="io")
        have = 0
        for size in ((2_000,) if quick else (10_000, 100_000)):
            _register(tq, "list", size - have)  # keys "plist..." accumulate
            have = size
            rows.append(Row("verl", f"kv_list() at {size:,} keys", name,
                            _timed(tq.kv_list, repeats) * 1e3, "ms"))
        tq.kv_clear(keys=list((tq.kv_list("list") or {}).get("list", {})), partition_id="list")
        rows.append(_sampler_rate(tq, name, quick))
    finally:
        target.stop(tq)
    return rows


def _sampler_rate(tq: Any, name: str, quick: bool) -> Row:
    """ReplayBuffer samples of 16 groups per second, over GROUPS groups of GROUP rows."""
    groups = 100 if quick else GROUPS
    uids = _register(tq, "rb", groups)
    td = TensorDict({"x": torch.zeros(groups * GROUP, 4)}, [groups * GROUP])
    keys = [f"{u}_{s}_0" for u in uids for s in range(GROUP)]
    tq.kv_batch_put(keys=keys, partition_id="rb", fields=td,
                    tags=[{"status": "success", "global_steps": 1}] * len(keys))
    t, calls = time.perf_counter(), 0
    while sample_once(tq, "rb", 16) == 16:
        calls += 1
    return Row("verl", f"ReplayBuffer samples/s ({groups} groups x {GROUP})", name,
               calls / (time.perf_counter() - t), "ops/s")


def targets(quick: bool) -> list[str]:
    """The compat modes, and TransferQueue (Ray) in a full run when installed."""
    from benchmarks.systems.transferqueue import TransferQueueSystem

    names = ["tq-compat-embedded"] if quick else ["tq-compat-embedded", "tq-compat-local"]
    if not quick:
        ok, why = TransferQueueSystem.available()
        names += ["transferqueue"] if ok else []
        if not ok:
            print(f"transferqueue skipped: {why}", file=sys.stderr)
    return names


def run(quick: bool) -> list[Row]:
    """Every available target, ROUNDS times (once in a quick run), then the samplers."""
    from benchmarks.report import merge_rounds

    rounds = in_rounds(targets(quick), lambda name: measure(Target(name), quick),
                       1 if quick else ROUNDS, "verl")
    rows = merge_rounds(rounds)
    from benchmarks.workloads import verl_samplers

    rows += verl_samplers.run(quick)
    return rows
