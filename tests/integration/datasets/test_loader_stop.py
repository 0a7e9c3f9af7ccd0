"""Stopping a loader with DataLoader workers ends their waits (found by the GRPO
example: after a `break`, each worker sat in its long-poll until torch's shutdown
gave up on it after 5 s and killed it)."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

import tq_stream as tq
from tests.helpers.tq_fixtures import local_stream

__all__ = ["local_stream"]

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def test_workers_exit_by_themselves_when_the_loop_stops(local_stream, monkeypatch):
    # torch joins each worker for this long, then kills it: make "then" never come
    # within the test's bound, so only workers that end by themselves pass
    monkeypatch.setattr(torch.utils.data._utils, "MP_STATUS_CHECK_INTERVAL", 600.0)
    keys = [f"s{i}" for i in range(2)]
    local_stream.writer("stop").put(keys, {"x": torch.arange(2.0)})  # one step only
    ds = tq.StreamingDataset(local_stream, "stop", "t", ["x"], batch_size=2, timeout=60)
    loader = tq.StreamingDataLoader(ds, num_workers=2, multiprocessing_context="fork")
    before = set(mp.active_children())
    it = iter(loader)
    assert tq.batch_meta(next(it)).keys == tuple(keys)
    workers = [p for p in mp.active_children() if p not in before]
    assert len(workers) == 2  # both wait for a step that will not come within 60 s
    it.close()  # a `break` out of the training loop
    assert [p.is_alive() for p in workers] == [False, False]


def test_a_worker_that_reached_the_end_does_not_cancel_the_others(local_stream, monkeypatch):
    """DataLoader workers share their iteration's session. Worker 0 reaching the end
    of the stream cancelled that session, so worker 1's wait for the last step came
    back empty and the step was never yielded (the GRPO example hung: one replica
    trained one step fewer than its DP peer)."""
    from types import SimpleNamespace

    from tq_stream.datasets import streaming

    keys = [f"e{i}" for i in range(8)]
    local_stream.writer("end").put(keys, {"x": torch.arange(8.0)})
    local_stream.close_partition("end")  # 4 steps of 2 rows, then the end
    ds = tq.StreamingDataset(local_stream, "end", "t", ["x"], batch_size=2, timeout=10,
                             prefetch=1)
    ds.session, ds.plan = "shared-session", (0, frozenset())

    def as_worker(i: int) -> list[int]:
        monkeypatch.setattr(streaming, "get_worker_info",
                            lambda: SimpleNamespace(id=i, num_workers=2))
        return [tq.batch_meta(b).step for b in ds]

    assert as_worker(0) == [0, 2]  # then the end
    assert as_worker(1) == [1, 3]  # same session, after worker 0 ended


def test_a_worker_death_signalled_during_an_ack_is_the_loader_s_clear_error(local_stream):
    """torch's SIGCHLD handler raises its RuntimeError in whatever the main thread runs
    when a worker dies; that was once the loader's ack between two batches, and the raw
    RuntimeError escaped (found by the killed-worker fault test, 1 run in 4)."""
    keys = [f"w{i}" for i in range(8)]
    local_stream.writer("died").put(keys, {"x": torch.arange(8.0)})
    ds = tq.StreamingDataset(local_stream, "died", "t", ["x"], batch_size=2, timeout=10)
    loader = tq.StreamingDataLoader(ds, num_workers=2, multiprocessing_context="fork")
    real_ack = loader._client.ack
    acks = []

    def ack_then_signal(meta):
        acks.append(real_ack(meta))  # the ack itself went through
        raise RuntimeError("DataLoader worker (pid 1) is killed by signal: Killed. ")

    it = iter(loader)
    first = tq.batch_meta(next(it)).keys
    loader._client.ack = ack_then_signal
    with pytest.raises(tq.errors.StateError, match="DataLoader worker of task 't'"):
        next(it)
    loader._client.ack = real_ack
    local_stream.close_partition("died")
    rest = [k for b in loader for k in tq.batch_meta(b).keys]  # a new iteration resumes
    assert acks == [2] and not set(rest) & set(first)
    assert sorted(rest + list(first)) == sorted(keys)


@pytest.mark.timeout(240)
def test_a_script_that_ends_holding_an_iterator_exits_quietly(tmp_path):
    """At interpreter exit the loader's generator is closed after module globals went
    (its logger was None): "Exception ignored in: <generator ...>" was printed. And
    about 1 run in 4 the interpreter aborted ("terminate called without an active
    exception", issue 20 item 15): the prefetch thread was inside a torch op reading
    the next batch when finalization began; a daemon thread that takes the GIL back
    then exits by a forced unwind, which aborts in torch's C++ frames. Rows of 16 MB
    make the read long enough for the abort to show in most runs of five."""
    import subprocess
    import sys

    script = tmp_path / "hold.py"
    script.write_text(
        "import torch, tq_stream as tq\n"
        "stream = tq.init(mode='local', storage_units=1)\n"
        "stream.writer('p').put(['a', 'b'], {'x': torch.zeros(2, 4_000_000)})\n"
        "loader = tq.StreamingDataLoader(tq.StreamingDataset(stream, 'p', 't', ['x'],\n"
        "                                                    batch_size=1, timeout=5))\n"
        "it = iter(loader)\n"
        "next(it)\n"
        "print('held')\n")
    for _ in range(5):
        done = subprocess.run([sys.executable, str(script)], capture_output=True,
                              text=True, timeout=60)
        assert done.stdout.strip() == "held", done.stderr
        assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, \
            done.stderr
        assert done.returncode == 0, done.stderr


def test_a_loop_left_by_an_exception_stops_its_workers_at_once(local_stream):
    """The iteration's end shuts its DataLoader workers down itself: left to torch's
    ``__del__``, a garbage collection (the iterator sits in a reference cycle with the
    exception's frames) joined them later, in whatever thread it ran in: a server's, a
    lease keeper's, while it held a lock."""
    keys = [f"x{i}" for i in range(2)]
    local_stream.writer("raise").put(keys, {"x": torch.arange(2.0)})
    ds = tq.StreamingDataset(local_stream, "raise", "t", ["x"], batch_size=2, timeout=60)
    loader = tq.StreamingDataLoader(ds, num_workers=2, multiprocessing_context="fork")
    before = set(mp.active_children())
    with pytest.raises(ZeroDivisionError):
        for _ in loader:
            raise ZeroDivisionError  # the training step fails
    workers = [p for p in mp.active_children() if p not in before]
    assert [p.is_alive() for p in workers] == []
