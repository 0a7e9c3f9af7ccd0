"""Writer.reserve: producers are paced by the staleness window of their consumers."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import tq_stream as tq
from tq_stream.errors import ConfigError, WaitTimeout
from tq_stream.samplers import StalenessSampler


def _task(stream: tq.Stream, max_staleness: int = 1, batch_size: int = 4) -> None:
    ds = tq.StreamingDataset(stream, "train", "actor", ["x"], batch_size=batch_size,
                             sampler=StalenessSampler(max_staleness=max_staleness), timeout=5)
    ds.register()


def _put(stream: tq.Stream, start: int, n: int, version: int) -> None:
    stream.writer("train").put([f"k{i}" for i in range(start, start + n)],
                               {"x": torch.zeros(n, 2)}, tags=[{"version": version}] * n)


def test_reserve_is_unbounded_without_a_staleness_task(stream):
    assert stream.writer("train").reserve(10_000, timeout=0.5) == 10_000


def test_reserve_blocks_at_the_window_and_names_the_task(stream):
    _task(stream, max_staleness=1, batch_size=4)
    stream.set_version("train", "actor", 0)
    w = stream.writer("train")
    assert w.reserve(8) == 8  # (version 0 + max_staleness 1 + 1) x 4 rows per version
    with pytest.raises(WaitTimeout, match="staleness window of task 'actor' has room for 0"):
        w.reserve(1, timeout=0.2)


def test_acks_and_version_advance_open_the_window(stream):
    _task(stream, max_staleness=0, batch_size=4)
    stream.set_version("train", "actor", 0)
    w = stream.writer("train")
    w.reserve(4)
    _put(stream, 0, 4, version=0)
    got = []

    def producer() -> None:
        got.append(w.reserve(4, timeout=5))  # blocks until the consumer acks

    t = threading.Thread(target=producer)
    t.start()
    time.sleep(0.2)
    assert not got  # still blocked
    c = stream.client()
    meta = c.get_meta("train", "actor", 0)
    c.ack(meta)
    stream.set_version("train", "actor", 1)
    t.join(timeout=5)
    assert got == [4]


def test_paced_producer_never_produces_stale_rows(stream):
    """A producer that reserves before each row never has a row discarded as stale."""
    _task(stream, max_staleness=1, batch_size=2)
    stream.set_version("train", "actor", 0)
    w = stream.writer("train")
    client = stream.client()
    version = 0
    for step in range(10):
        for _ in range(2):
            w.reserve(1, timeout=5)
        _put(stream, 2 * step, 2, version=version)
        meta = client.get_meta("train", "actor", step)
        client.ack(meta)
        version += 1
        stream.set_version("train", "actor", version)
    stats = stream.stats()["train"]["tasks"]["actor"]
    assert stats["acked"] == 20 and stats["discarded"] == {}


def test_admission_survives_checkpoint(tmp_path):
    with tq.init() as s:
        _task(s, max_staleness=1, batch_size=4)
        s.set_version("train", "actor", 0)
        s.writer("train").reserve(6)
        s.save(str(tmp_path / "ckpt"))
    with tq.init(restore=str(tmp_path / "ckpt")) as s2:
        _task(s2, max_staleness=1, batch_size=4)
        assert s2.connection.controller().admission("train").admitted == 6
        with pytest.raises(WaitTimeout):
            s2.writer("train").reserve(3, timeout=0.2)  # 6 + 3 > 8
        assert s2.writer("train").reserve(2, timeout=1) == 2


def test_bad_reserve_arguments(stream):
    with pytest.raises(ConfigError, match="n must be an int >= 1, got 0"):
        stream.writer("train").reserve(0)
    _task(stream)
    with pytest.raises(ConfigError, match="steps_per_version must be an int >= 1"):
        stream.set_admission("train", "actor", 0)
