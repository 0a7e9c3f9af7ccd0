"""Scripts the fork tests run in a fresh interpreter, shaped like a new user's script from
the README: a local stream, rows put in a loop, a StreamingDataLoader whose workers torch
forks (the default start method on Linux). A fresh interpreter matters: a module is
imported for the first time there, as in a user's script, not by an earlier test.

    python fork_scripts.py producer_thread WORKERS   # a thread puts while workers read
    python fork_scripts.py worker_imports WORKERS    # what a forked worker imported
    python fork_scripts.py write ADDRESS             # rows put from another process

Each prints one JSON line (rows read, and modules a worker imported) and exits 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from typing import Any

import torch
from tensordict import TensorDict

import tq_stream as tq

STEPS = 12
BATCH = 4  # rows per put and per step (two groups of two)
FIELDS = ["input_ids", "response", "prompt", "obs", "reward"]
CONFIG = tq.StreamConfig(timeout=20.0)


def write_rows(stream: tq.Stream) -> None:
    """STEPS puts of BATCH rows (dense, jagged, strings, a nested field and tags), a
    reward put later for the same keys, then the partition is closed."""
    w = stream.writer("train")
    for i in range(STEPS):
        keys = [f"p{i}_{j}" for j in range(BATCH)]
        w.put(keys, TensorDict({
            "input_ids": torch.randint(0, 100, (BATCH, 16)),
            "response": torch.nested.nested_tensor(
                [torch.ones(3 + j) for j in range(BATCH)], layout=torch.jagged),
            "obs": {"image": torch.rand(BATCH, 256, 256)},  # 1 MiB a batch: pooled reads
        }, [BATCH]), tags=[{"uid": f"p{i}_{j // 2}", "version": 0} for j in range(BATCH)])
        w.put(keys, {"prompt": [f"prompt {i} {j}" for j in range(BATCH)]})
        w.put(keys, {"reward": torch.rand(BATCH)})
    stream.close_partition("train")


def read_all(stream: tq.Stream, workers: int, task: str = "actor",
             ragged: str = "nested") -> int:
    """Iterate a loader over the partition to its end, acking every step; the rows read."""
    ds = tq.StreamingDataset(stream, "train", task, FIELDS, batch_size=BATCH,
                             sampler=tq.samplers.GroupSampler(group_size=2), ragged=ragged)
    loader = tq.StreamingDataLoader(ds, num_workers=workers)
    rows = 0
    for batch in loader:
        rows += len(batch)
        loader.ack()
    return rows


def producer_thread(workers: int) -> dict[str, Any]:
    """A producer thread writes while the loader's forked workers read."""
    stream = tq.init(mode="local", config=CONFIG)
    stream.create_partition("train", consumers=["actor"])
    producer = threading.Thread(target=write_rows, args=(stream,))
    producer.start()
    rows = read_all(stream, workers)
    producer.join()
    stream.close()
    return {"rows": rows}


class _ImportLog:
    """A meta-path finder that records every module imported (finds nothing itself)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        with open(self.path, "a") as f:
            f.write(name + "\n")


def worker_imports(workers: int) -> dict[str, Any]:
    """Rows come from another process, so this one has neither written nor read any
    before its workers fork; every module a worker imports on its way is recorded
    (ragged fields read as nested tensors, then padded)."""
    stream = tq.init(mode="local", config=CONFIG)
    stream.create_partition("train", consumers=["actor", "critic"])
    subprocess.run([sys.executable, __file__, "write", str(stream.address)], check=True,
                   timeout=120)
    fd, log = tempfile.mkstemp(prefix="tq_fork_imports_")
    os.close(fd)
    os.register_at_fork(after_in_child=lambda: sys.meta_path.insert(0, _ImportLog(log)))
    rows = read_all(stream, workers)
    padded = read_all(stream, workers, "critic", ragged="padded")
    stream.close()
    with open(log) as f:
        imported = sorted(set(f.read().split()))
    os.remove(log)
    return {"rows": rows, "padded_rows": padded, "imported": imported}


def main(argv: list[str]) -> None:
    if argv[0] == "write":
        stream = tq.connect(argv[1], config=CONFIG)
        write_rows(stream)
        stream.close()
        return
    run = {"producer_thread": producer_thread, "worker_imports": worker_imports}[argv[0]]
    print(json.dumps(run(int(argv[1]))), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
