"""A worker paused past its lease (SIGSTOP) comes back after another worker took its
batch over and acked it: its late put_data and ack are refused with LeaseTakenOver, and
the result the next stage reads is the live worker's (local mode; before the fence the
paused worker's write overwrote it silently). Embedded: tests/controller/test_lease_takeover.py."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from tests.helpers.tq_fixtures import kill, local_stream
from tests.helpers.tq_workers import paused_reward_worker

__all__ = ["local_stream"]  # the module-scoped fixture, imported for pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

LEASE = 1.0


def test_a_paused_worker_cannot_overwrite_the_result_of_the_one_that_took_over(local_stream):
    s, part = local_stream, "paused"
    keys = [f"k_{i}" for i in range(4)]
    s.create_partition(part, consumers=["reward", "train"])
    s.writer(part).put(keys, {"x": torch.arange(4.0)})
    c = s.client()
    c.register_task(part, "reward", ["x"], batch_size=4, lease_timeout=LEASE)
    c.register_task(part, "train", ["x", "r"], batch_size=4)
    ctx = mp.get_context("spawn")
    go = ctx.Event()
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=paused_reward_worker, args=(s, part, go, send))
    p.start()
    send.close()
    try:
        assert recv.poll(60), "the worker never got its batch"
        assert recv.recv() == keys
        os.kill(p.pid, signal.SIGSTOP)
        time.sleep(LEASE * 3)  # its heartbeat is stopped with it: the lease lapses
        live = s.client()
        meta = live.get_meta(part, "reward", timeout=10)
        assert list(meta.keys) == keys  # taken over
        live.put_data(meta, {"r": torch.full((4,), 2.0)})
        assert live.ack(meta) == 4
        os.kill(p.pid, signal.SIGCONT)
        go.set()
        assert recv.poll(60), "the paused worker never reported"
        assert recv.recv() == ["LeaseTakenOver", "LeaseTakenOver"]
        train = s.client()
        got = train.get_meta(part, "train", timeout=10)
        assert train.get_data(got)["r"].tolist() == [2.0] * 4
        assert train.ack(got) == 4
        assert s.stats()[part]["rows"] == 0  # every row freed once
    finally:
        p.join(20)
        if p.is_alive():
            kill(p.pid)
