"""Workload ``nemo_rl``: NeMo-RL's data-plane loop on TransferQueue 0.1.11 and on
``tq_stream.compat`` (``transfer_queue`` installed) side by side.

The calls are the ones ``tests/helpers/nemo_rl_calls.py`` replays from NeMo-RL's TransferQueue
adapter (loaded from that file, so the benchmark and the tests make the same calls):
the driver bootstraps from the package's ``config.yaml`` plus NeMo-RL's overlay
(``polling_mode: True``, SimpleStorage capacity and units). One GRPO step:

- ``register_partition`` (a float32 warm-up row per field, cleared), then the rollout
  put of STEP_ROWS samples: ragged ``input_ids`` (int64), ``generation_logprobs`` and
  ``token_mask`` (float32) of 256..1024 tokens, ``input_lengths``, ``sample_mask`` and
  a message log per sample (``np.ndarray(dtype=object)`` of dicts);
- per DP rank (DP of them), the loop measured here: ``claim_meta`` (``get_meta`` in
  fetch mode for task ``prev_lp`` with ``dp_rank``, then ``kv_retrieve_keys``) ->
  ``get_samples`` (``kv_batch_get`` of the fields a logprob pass reads) ->
  ``put_samples`` (the ``prev_logprobs`` column written back under the same keys);
  the worker's forward pass in between (making that column) is not timed;
- ``check_consumption_status``, then ``clear_all`` (``kv_list`` + ``kv_clear``).
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from benchmarks.workloads.common import Row, in_rounds
from benchmarks.workloads.verl import Target, targets

STEP_ROWS, DP, STEPS = 256, 4, 4
ROUNDS = 3
PARTITION, TASK = "train", "prev_lp"
FIELDS = ["input_ids", "input_lengths", "generation_logprobs", "token_mask", "sample_mask",
          "message_log"]
READ = ["input_ids", "input_lengths", "token_mask", "sample_mask"]
CALLS = Path(__file__).resolve().parents[2] / "tests" / "helpers" / "nemo_rl_calls.py"


def calls() -> Any:
    """``tests/helpers/nemo_rl_calls.py`` of this checkout, as a module."""
    spec = importlib.util.spec_from_file_location("nemo_rl_calls", CALLS)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"NeMo-RL's replayed calls must be at {CALLS}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rollout(n: int, step: int) -> TensorDict:
    """``n`` rollouts as NeMo-RL's rollout actor writes them (jagged per-token fields)."""
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(256, 1025, (n,), generator=g)
    ids = [torch.randint(1, 32_000, (int(k),), generator=g) for k in lengths]
    logp = [-torch.rand(int(k), generator=g) for k in lengths]
    log = np.empty(n, dtype=object)
    for i in range(n):
        log[i] = {"role": "assistant", "content": f"answer {i} of step {step}",
                  "token_count": int(lengths[i])}
    jagged = torch.nested.as_nested_tensor
    return TensorDict({
        "input_ids": jagged(ids, layout=torch.jagged),
        "input_lengths": lengths,
        "generation_logprobs": jagged(logp, layout=torch.jagged),
        "token_mask": jagged([torch.ones(int(k)) for k in lengths], layout=torch.jagged),
        "sample_mask": torch.ones(n),
        "message_log": log,
    }, batch_size=[n])


def _conf(nemo: Any, target: Target) -> Any:
    extra = {"tq_stream": {"mode": target.mode}} if target.mode else {}
    return nemo.driver_conf(capacity=4 * STEP_ROWS, units=2, extra=extra)


def measure(target: Target, quick: bool) -> list[Row]:
    nemo = calls()
    n, steps = (32, 1) if quick else (STEP_ROWS, STEPS)
    tq = target.module()
    plane = nemo.DataPlane(tq, _conf(nemo, target))
    loops: list[float] = []
    step_times: list[float] = []
    try:
        for step in range(steps):
            batch = rollout(n, step)
            t0 = time.perf_counter()
            plane.register_partition(PARTITION, FIELDS)
            keys = [f"s{step}_{i}_g0" for i in range(n)]
            plane.put_samples(keys, PARTITION, batch)
            for rank in range(DP):
                t = time.perf_counter()
                got, _ = plane.claim_meta(PARTITION, TASK, READ, batch_size=n // DP,
                                          dp_rank=rank, timeout_s=60.0)
                data = plane.get_samples(got, PARTITION, READ)
                spent = time.perf_counter() - t
                # the worker's forward pass (not timed): one logprob per token
                lp = TensorDict({"prev_logprobs": torch.nested.as_nested_tensor(
                    [-torch.ones(int(k)) for k in data["input_lengths"]], layout=torch.jagged)},
                    batch_size=[len(got)])
                t = time.perf_counter()
                plane.put_samples(got, PARTITION, lp)
                loops.append(spent + time.perf_counter() - t)
            if not plane.consumed(PARTITION, [TASK]):
                raise RuntimeError(f"{target.name}: task {TASK!r} must have consumed every "
                                   f"row of step {step}")
            plane.clear_all(PARTITION)
            step_times.append(time.perf_counter() - t0)
    finally:
        target.stop(tq)
    per = n // DP
    return [
        Row("nemo_rl", f"claim_meta -> get_samples -> put_samples, {per} of {n} rows",
            target.name, statistics.median(loops) * 1e3, "ms"),
        Row("nemo_rl", f"GRPO step: put {n}, {DP} loops, clear", target.name,
            statistics.median(step_times) * 1e3, "ms"),
    ]


def run(quick: bool) -> list[Row]:
    """Every available target, ROUNDS times (once in a quick run)."""
    from benchmarks.report import merge_rounds

    if importlib.util.find_spec("omegaconf") is None:
        print("nemo_rl skipped: omegaconf is not installed", file=sys.stderr)
        return []
    rounds = in_rounds(targets(quick), lambda name: measure(Target(name), quick),
                       1 if quick else ROUNDS, "nemo_rl")
    return merge_rounds(rounds)
