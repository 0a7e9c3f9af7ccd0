"""A full partition whose rows no ack can free (no declared consumers) says so, with
the fix, in the writer's error, the reader's error and a WARNING (issue 20 item 6)."""

from __future__ import annotations

import logging

import pytest
import torch

import tq_stream as tq
from tq_stream.controller.controller import Controller
from tq_stream.controller.timings import Timings
from tq_stream.errors import WaitTimeout

P = "full"
SCHEMA = {"kind": "dense", "dtype": "float32", "shape": [2]}


def fill_and_drain(stream: tq.Stream) -> tq.Client:
    """Capacity 16, no consumers: 16 rows written, read and acked by task "t"."""
    stream.create_partition(P, capacity=16)
    client = stream.client()
    client.register_task(P, "t", ["x"], batch_size=8)
    stream.writer(P).put([f"k{i}" for i in range(16)], {"x": torch.zeros(16, 2)})
    for step in range(2):
        client.ack(client.get_meta(P, "t", step, timeout=10))
    return client


def check_full_partition_says_why(stream: tq.Stream, caplog: pytest.LogCaptureFixture) -> None:
    client = fill_and_drain(stream)
    with caplog.at_level(logging.WARNING, logger="tq_stream"), \
            pytest.raises(WaitTimeout) as put_error:
        stream.writer(P).put(["k16"], {"x": torch.zeros(1, 2)}, timeout=0.3)
    message = str(put_error.value)
    assert "no declared consumers" in message, message
    assert "consumers=[...]" in message and "clear" in message, message
    assert "must ack" not in message
    # the WARNING comes once a writer has been blocked SLOW_WAIT (10) s, as documented;
    # a put blocked for less says it in its error only
    assert "no declared consumers" not in caplog.text, caplog.text
    with pytest.raises(WaitTimeout) as get_error:
        client.get_meta(P, "t", 2, timeout=0.3)
    assert "no declared consumers" in str(get_error.value), get_error.value
    assert "consumers=[...]" in str(get_error.value)
    client.clear([f"k{i}" for i in range(16)], partition=P)  # the documented fix works
    stream.writer(P).put(["k16"], {"x": torch.zeros(1, 2)}, timeout=5)


def test_full_partition_without_consumers_says_why(caplog):
    with tq.init() as stream:
        check_full_partition_says_why(stream, caplog)


def test_full_partition_with_consumers_names_them():
    with tq.init() as stream:
        stream.create_partition(P, capacity=8, consumers=["t"])
        stream.writer(P).put([f"k{i}" for i in range(8)], {"x": torch.zeros(8, 2)})
        with pytest.raises(WaitTimeout, match=r"declared consumers \['t'\] have not acked"):
            stream.writer(P).put(["k8"], {"x": torch.zeros(1, 2)}, timeout=0.2)


def test_a_writer_blocked_long_logs_why_the_partition_stays_full(caplog):
    """The WARNING of a writer blocked ``slow_wait`` seconds (10 in a deployment) on a
    partition without declared consumers names the cause and the fix."""
    ctrl = Controller(timings=Timings(slow_wait=0.2))
    ctrl.create_partition(P, capacity=2)
    held = ctrl.reserve(P, ["a", "b"], {"x": SCHEMA})
    ctrl.commit(P, held.index, held.generation, {"x": SCHEMA})
    with caplog.at_level(logging.WARNING, logger="tq_stream"), pytest.raises(WaitTimeout):
        ctrl.reserve(P, ["c"], {"x": SCHEMA}, timeout=0.6)
    assert "a writer blocked at capacity" in caplog.text, caplog.text
    assert "no declared consumers" in caplog.text and "consumers=[...]" in caplog.text
