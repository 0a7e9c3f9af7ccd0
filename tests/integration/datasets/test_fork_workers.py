"""DataLoader workers forked while other threads of the trainer's process run (issue 20's
new-user hang): a producer thread putting rows in the same process as a
StreamingDataLoader(num_workers=k) whose workers torch forks.

A fork copies only the thread that forks: a lock or an import another thread was in at
that moment stays held in the child forever. Measured on the unmodified code, the
README-shaped script below failed in about 6 runs of 10; py-spy showed the worker's
prefetch thread waiting, for good, on the stream backend's lock (held by the producer's
first put) or on numpy.ma's import lock (the producer's first ``np.unique``). Each such
cause is replayed here deterministically, the user's script as it is, and the bound that
turns any other stuck worker into an error instead of an endless wait.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

import tq_stream as tq
from tests.helpers.tq_fixtures import CONFIG, local_stream, start_local, wait_until
from tq_stream.errors import ConfigError, WorkerStalled
from tq_stream.forksafe import ForkSafeLock

__all__ = ["local_stream"]

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "helpers", "fork_scripts.py")
ROWS = 48  # fork_scripts.STEPS * BATCH


def run_script(*args: str) -> dict:
    """Run ``fork_scripts.py args`` in a fresh interpreter; its JSON line."""
    out = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_lock_another_thread_holds_is_free_in_a_forked_child():
    held, done = threading.Event(), threading.Event()
    safe, plain = ForkSafeLock(), threading.Lock()

    def hold() -> None:
        with safe, plain:
            held.set()
            done.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(30)
        pid = os.fork()
        if pid == 0:  # the child: only this thread exists here
            ok = safe.acquire(timeout=10) and not plain.acquire(timeout=0.1)
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
    finally:
        done.set()
        holder.join()
    assert os.waitstatus_to_exitcode(status) == 0  # the plain lock stays held: the cause


@pytest.mark.slow
def test_a_forked_worker_imports_no_module():
    """Rows put from another process: the trainer's process never read nor wrote one
    before its workers fork. A module the worker imported could have been mid-import
    in a thread of the trainer at the fork (numpy.ma, torch's jagged ops, the same-host
    reader were, before ``datasets.worker_imports``)."""
    out = run_script("worker_imports", "1")
    assert out == {"rows": ROWS, "padded_rows": ROWS, "imported": []}


def test_a_worker_forked_while_a_thread_holds_the_streams_lock_reads_every_row():
    """The py-spy finding: the producer thread's first put held the backend's lock
    (making the unit clients) when torch forked the worker, whose prefetch thread then
    waited on it forever (the dataset's WaitTimeout came 25 s later)."""
    stream = start_local(storage_units=1)
    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        with stream.connection.backend._lock:  # where the producer thread was at the fork
            held.set()
            done.wait(60)

    holder = threading.Thread(target=hold)
    try:
        stream.create_partition("held", consumers=["t"])
        other = tq.connect(stream.address, config=CONFIG)  # a handle of its own: puts
        keys = [f"k{i}" for i in range(8)]
        other.writer("held").put(keys, {"x": torch.arange(8.0)[:, None] * torch.ones(1, 4)})
        other.close_partition("held")
        other.close()
        holder.start()
        assert held.wait(30)
        ds = tq.StreamingDataset(stream, "held", "t", ["x"], batch_size=2, timeout=5.0)
        read = [k for b in tq.StreamingDataLoader(ds, num_workers=1)
                for k in tq.batch_meta(b).keys]
        assert sorted(read) == keys
    finally:
        done.set()
        if holder.is_alive():
            holder.join()
        stream.close()


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_a_producer_thread_and_forked_workers_in_one_script(workers):
    """The user's script (README shape): tq.init(mode="local"), a threading.Thread
    putting batches (a reward put later), a loader with forked workers acking every
    step. Before: 18 of 30 runs failed with num_workers=1; three runs in a row pass."""
    for _ in range(3):
        assert run_script("producer_thread", str(workers)) == {"rows": ROWS}


def test_a_stuck_worker_is_worker_stalled_and_iterating_again_loses_nothing(local_stream):
    """A worker that lives but makes no progress (stopped here; stuck on an inherited
    lock in the wild) was waited for forever in torch's _try_get_data. It is stopped
    while it waits for rows, with no batch on its way (torch reads a batch's tensors
    from the worker itself, a read no timeout bounds)."""
    keys = [f"s{i}" for i in range(16)]
    local_stream.create_partition("stuck", consumers=["t"])
    w = local_stream.writer("stuck")
    w.put(keys[:2], {"x": torch.arange(2.0)})  # step 0 only: the worker then waits
    ds = tq.StreamingDataset(local_stream, "stuck", "t", ["x"], batch_size=2, timeout=2.0)
    loader = tq.StreamingDataLoader(ds, num_workers=1, multiprocessing_context="fork",
                                    timeout=8.0)
    trained: list[str] = []
    stopped: list[int] = []
    before = set(mp.active_children())
    with pytest.raises(WorkerStalled, match=r"task 't' \(rank 0\) within timeout=8 s"):
        for batch in loader:
            trained += tq.batch_meta(batch).keys
            if not stopped:
                stopped = [p.pid for p in mp.active_children() if p not in before]
                for pid in stopped:
                    os.kill(pid, signal.SIGSTOP)
                w.put(keys[2:], {"x": torch.arange(2.0, 16.0)})
                local_stream.close_partition("stuck")
    for pid in stopped:  # torch's shutdown sent SIGTERM; a stopped process gets it now
        os.kill(pid, signal.SIGCONT)
    assert stopped and wait_until(lambda: not set(mp.active_children()) - before, 30)
    trained += [k for b in loader for k in tq.batch_meta(b).keys]
    assert sorted(trained) == sorted(keys)  # nothing lost, nothing twice
    assert local_stream.stats()["stuck"]["tasks"]["t"]["acked"] == 16


def test_the_workers_timeout_must_exceed_what_a_live_worker_takes(local_stream):
    ds = tq.StreamingDataset(local_stream, "cfg", "t", ["x"], batch_size=2, timeout=10.0)
    with pytest.raises(ConfigError, match=r"timeout must be more than 15 s .* got 12"):
        tq.StreamingDataLoader(ds, num_workers=1, timeout=12)
    with pytest.raises(ConfigError, match="timeout bounds the wait for DataLoader workers"):
        tq.StreamingDataLoader(ds, num_workers=0, timeout=60)

