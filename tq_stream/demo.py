"""``tq-stream demo``: an embedded GRPO-like stream, end to end, in seconds.

Producer threads write groups of responses (random tokens, variable lengths)
and later add each group's rewards in a second write; two consumer ranks read
complete rows through StreamingDataLoader. The summary checks that every row
arrived exactly once.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from tensordict import TensorDict

import tq_stream as tq


@dataclass(frozen=True)
class DemoConfig:
    prompts: int = 512
    group_size: int = 8
    producers: int = 2
    ranks: int = 2
    batch_size: int = 32
    max_response: int = 512
    prompt_len: int = 64


def _produce(stream: tq.Stream, cfg: DemoConfig, pid: int, written: dict[str, float]) -> None:
    rng = np.random.default_rng(pid)
    w = stream.writer("train")
    for p in range(pid, cfg.prompts, cfg.producers):
        uid = f"prompt{p}"
        keys = [f"{uid}_{i}" for i in range(cfg.group_size)]
        lengths = rng.integers(1, cfg.max_response + 1, cfg.group_size)
        responses = [torch.from_numpy(rng.integers(0, 32000, n)) for n in lengths]
        td = TensorDict({
            "prompt": torch.from_numpy(rng.integers(0, 32000, (cfg.group_size, cfg.prompt_len))),
            "response": torch.nested.nested_tensor(responses, layout=torch.jagged),
        }, [cfg.group_size])
        w.put(keys, td, tags=[{"uid": uid, "version": 0, "seqlen": int(n)} for n in lengths])
        rewards = torch.from_numpy(rng.random(cfg.group_size).astype(np.float32))
        now = time.perf_counter()
        w.put(keys, {"reward": rewards})
        for k in keys:
            written[k] = now


def _consume(stream: tq.Stream, cfg: DemoConfig, rank: int, seen: list[str],
             lat: list[tuple[str, float]]) -> None:
    ds = tq.StreamingDataset(stream, "train", "update_actor", ["prompt", "response", "reward"],
                             batch_size=cfg.batch_size, dp_rank=rank, dp_size=cfg.ranks,
                             sampler=tq.samplers.GroupSampler(cfg.group_size), timeout=30)
    for batch in tq.StreamingDataLoader(ds):
        now = time.perf_counter()
        keys = tq.batch_meta(batch).keys
        seen.extend(keys)
        lat.extend((k, now) for k in keys)


def _progress_bar(quiet: bool) -> Progress:
    """A rich progress bar on stderr: rows delivered of all rows, and the rate."""
    return Progress(TextColumn("rows"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[rate]:,.0f} rows/s"), TimeElapsedColumn(),
                    console=Console(stderr=True), disable=quiet, transient=False)


def _advance(bar: Progress, task: TaskID, done: int, start: float) -> None:
    bar.update(task, completed=done, rate=done / max(time.perf_counter() - start, 1e-9))


def run(cfg: DemoConfig | None = None, quiet: bool = False) -> dict[str, Any]:
    """Run the demo; returns the summary it prints."""
    cfg = cfg or DemoConfig()
    total = cfg.prompts * cfg.group_size
    written: dict[str, float] = {}
    seen: list[str] = []
    lat: list[tuple[str, float]] = []
    with tq.init() as stream, _progress_bar(quiet) as bar:
        rows = bar.add_task("rows", total=total, rate=0.0)
        # rows are freed once the trainer acked them (undeclared partitions keep rows)
        stream.create_partition("train", consumers=["update_actor"])
        start = time.perf_counter()
        threads = [threading.Thread(target=_produce, args=(stream, cfg, i, written))
                   for i in range(cfg.producers)]
        threads += [threading.Thread(target=_consume, args=(stream, cfg, r, seen, lat))
                    for r in range(cfg.ranks)]
        for t in threads:
            t.start()
        for t in threads[: cfg.producers]:
            t.join()
        stream.close_partition("train")
        while any(t.is_alive() for t in threads):
            _advance(bar, rows, len(seen), start)
            next(t for t in threads if t.is_alive()).join(timeout=0.2)
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - start
        _advance(bar, rows, len(seen), start)
        stats = stream.stats()["train"]
    counts = Counter(seen)
    ms = np.array([(t - written[k]) * 1e3 for k, t in lat if k in written])
    summary = {
        "rows": total, "delivered": len(seen), "seconds": round(elapsed, 2),
        "rows_per_s": round(len(seen) / elapsed, 1),
        "latency_ms_p50": round(float(np.percentile(ms, 50)), 2) if len(ms) else None,
        "latency_ms_p99": round(float(np.percentile(ms, 99)), 2) if len(ms) else None,
        "duplicates": sum(c - 1 for c in counts.values() if c > 1),
        "missing": total - len(counts),
        "discarded": stats["tasks"]["update_actor"]["discarded"],
        "rows_left": stats["rows"],
    }
    if not quiet:
        for k, v in summary.items():
            print(f"{k:>16}: {v}")
    return summary
