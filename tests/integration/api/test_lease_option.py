"""Issue 20 item 17: ``lease_timeout`` is an option of ``tq.init`` in every mode (the
README says to lower it for faster takeover), validated; durations in messages read
as round numbers."""

from __future__ import annotations

import gc
import multiprocessing as mp
import time

import pytest
import torch

import tq_stream as tq
from tq_stream.errors import ConfigError, format_seconds


def _take(stream: tq.Stream) -> list[str]:
    return sorted(stream.client().get_meta("p", "t", timeout=10).keys)


@pytest.mark.parametrize("mode", ["embedded", pytest.param("local", marks=[
    pytest.mark.integration, pytest.mark.timeout(90)])])
def test_a_lower_lease_timeout_hands_a_dead_consumers_share_on_soon(mode):
    stream = tq.init(mode=mode, lease_timeout=1.0)
    try:
        assert stream.config.lease_timeout == 1.0
        stream.writer("p").put(["a", "b"], {"x": torch.ones(2, 3)})
        stream.client().register_task("p", "t", ["x"], batch_size=2)
        if mode == "embedded":
            keys = _take(stream)  # and drop the client: its heartbeat stops
            gc.collect()
        else:  # a consumer process that dies holding the step
            child = mp.get_context("fork").Process(target=_take, args=(stream,))
            child.start()
            child.join(30)
            assert child.exitcode == 0
            keys = ["a", "b"]
        started = time.monotonic()
        again = stream.client().get_meta("p", "t", timeout=20)  # the default: 300 s
        assert sorted(again.keys) == keys
        assert time.monotonic() - started < 15.0
    finally:
        stream.close()


def test_lease_timeout_is_validated_and_must_agree_with_config():
    with pytest.raises(ConfigError, match="lease_timeout must be a number of seconds > 0"):
        tq.init(lease_timeout=0)
    with pytest.raises(ConfigError, match="lease_timeout must agree with config"):
        tq.init(lease_timeout=5, config=tq.StreamConfig(lease_timeout=7))
    stream = tq.init(lease_timeout=5, config=tq.StreamConfig(timeout=3))
    assert (stream.config.timeout, stream.config.lease_timeout) == (3, 5)
    stream.close()


def test_durations_print_as_round_numbers():
    assert format_seconds(14.999999639999942) == "15 s"
    assert format_seconds(2.5) == "2.5 s"
    assert format_seconds(0.05) == "0.05 s"
    assert format_seconds(300) == "300 s"


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_a_handle_joining_by_address_takes_the_deployment_s_lease_timeout():
    """Found by a README-only user: workers joined with ``tq.connect(address)`` kept the
    300 s default, so a killed worker's share (its task registered by the workers) came
    back only after 300 s, though the owner started the deployment with 3."""
    stream = tq.init(mode="local", lease_timeout=3.0)
    try:
        assert tq.connect(stream.address).config.lease_timeout == 3.0
        assert tq.connect(stream.address, lease_timeout=7.0).config.lease_timeout == 7.0
        own = tq.connect(stream.address, config=tq.StreamConfig(lease_timeout=9.0))
        assert own.config.lease_timeout == 9.0  # a choice of its own stays
        joined = tq.connect(stream.address)
        joined.writer("p").put(["a", "b"], {"x": torch.ones(2, 3)})
        joined.client().register_task("p", "t", ["x"], batch_size=2)  # its lease: 3 s
        assert stream.stats()["p"]["tasks"]["t"]["fields"] == ["x"]
        child = mp.get_context("fork").Process(target=_take, args=(joined,))
        child.start()
        child.join(30)
        assert child.exitcode == 0
        started = time.monotonic()
        assert sorted(joined.client().get_meta("p", "t", timeout=20).keys) == ["a", "b"]
        assert time.monotonic() - started < 10.0
    finally:
        stream.close()
    plain = tq.init(mode="local")
    try:
        assert tq.connect(plain.address).config.lease_timeout == 300.0
    finally:
        plain.close()
