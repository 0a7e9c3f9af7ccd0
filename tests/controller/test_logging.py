"""The package logger's WARNINGs and INFOs fire in the situations they describe."""

from __future__ import annotations

import logging

import pytest
import torch

import tq_stream as tq
from tq_stream.controller import events, timings
from tq_stream.controller.controller import Controller
from tq_stream.errors import WaitTimeout

W = logging.WARNING
SCHEMA = {"kind": "dense", "dtype": "float32", "shape": [2]}


def _messages(caplog: pytest.LogCaptureFixture, level: int = W) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level
            and r.name.startswith("tq_stream")]


def test_the_package_logger_has_a_null_handler() -> None:
    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("tq_stream").handlers)


def test_lease_expiry_warns_with_count_and_task(stream, clock, caplog) -> None:
    stream.writer("lx").put(["a", "b"], {"x": torch.ones(2, 2)})
    client = stream.client()
    client.register_task("lx", "t", ["x"], batch_size=2, lease_timeout=5.0)
    client.get_meta("lx", "t", step=0)
    clock.advance(10)
    with caplog.at_level(W, logger="tq_stream"):
        again = client.get_meta("lx", "t", step=0)  # the expired share is refilled
    assert sorted(again.keys) == ["a", "b"]
    (msg,) = _messages(caplog)
    assert "2 rows of task 't' on partition 'lx'" in msg and "delivered again" in msg


def test_discards_warn_rate_limited_with_reason_and_count(stream, caplog, monkeypatch) -> None:
    sampler = tq.samplers.DynamicFilterSampler(tq.samplers.GroupSampler(2))
    client = stream.client()
    client.register_task("dz", "t", ["x"], batch_size=2, sampler=sampler)
    w = stream.writer("dz")

    def flat_group(g: int) -> None:  # equal rewards: discarded as zero_variance
        w.put([f"g{g}a", f"g{g}b"], {"x": torch.ones(2, 2)},
              tags=[{"uid": f"g{g}", "reward": 1.0}] * 2)

    with caplog.at_level(W, logger="tq_stream"):
        flat_group(0)
        with pytest.raises(WaitTimeout):
            client.get_meta("dz", "t", step=0, timeout=0.05)
        flat_group(1)
        with pytest.raises(WaitTimeout):
            client.get_meta("dz", "t", step=0, timeout=0.05)
        assert _messages(caplog) == [
            "2 rows discarded by task 't' on partition 'dz' (reason 'zero_variance')"]
        monkeypatch.setattr(events, "EVERY", 0.0)  # the next line sums what was held back
        flat_group(2)
        with pytest.raises(WaitTimeout):
            client.get_meta("dz", "t", step=0, timeout=0.05)
    assert _messages(caplog)[1] == \
        "4 rows discarded by task 't' on partition 'dz' (reason 'zero_variance')"


def _slow_controller() -> Controller:
    """A controller that logs waits longer than 0.1 s (10 s in a deployment)."""
    return Controller(timings=timings.Timings(slow_wait=0.1))


def test_a_consumer_waiting_long_warns_what_it_waits_for(caplog) -> None:
    ctrl = _slow_controller()
    held = ctrl.reserve("cw", ["a"], {"x": SCHEMA})
    ctrl.commit("cw", held.index, held.generation, {"x": SCHEMA})
    ctrl.register_task("cw", "t", ["x"], batch_size=4)
    with caplog.at_level(W, logger="tq_stream"), pytest.raises(WaitTimeout):
        ctrl.get_meta("cw", "t", step=0, timeout=0.4)
    (msg,) = _messages(caplog)
    assert "get_meta on partition 'cw' has waited" in msg
    assert "task 't' step 0 (rank 0): 1 rows ready, 4 needed" in msg


def test_a_writer_blocked_at_capacity_warns(caplog) -> None:
    ctrl = _slow_controller()
    ctrl.create_partition("cap", capacity=1)
    held = ctrl.reserve("cap", ["a"], {"x": SCHEMA})
    ctrl.commit("cap", held.index, held.generation, {"x": SCHEMA})
    with caplog.at_level(W, logger="tq_stream"), pytest.raises(WaitTimeout):
        ctrl.reserve("cap", ["b"], {"x": SCHEMA}, timeout=0.4)
    (msg,) = _messages(caplog)  # once it has waited slow_wait, not as soon as it blocks
    assert "blocked at capacity on partition 'cap'" in msg and "1/1 rows held" in msg
    assert "has no declared consumers" in msg
    assert ctrl.stats()["cap"]["blocked_seconds"]["capacity"] >= 0.3


def test_a_unit_going_down_warns_once(stream, caplog, monkeypatch) -> None:
    unit = stream.connection.units()[0]
    with caplog.at_level(W, logger="tq_stream"):
        assert stream.deployment_stats()["units"][0]["up"]
        monkeypatch.setattr(unit, "stats", lambda: 1 / 0)
        assert not stream.deployment_stats()["units"][0]["up"]
        stream.deployment_stats()
    (msg,) = _messages(caplog)
    assert "storage unit 0" in msg and "is down: ZeroDivisionError" in msg


def test_a_replaced_unit_warns_with_the_rows_lost(caplog) -> None:
    from tq_stream.deploy.services import ControllerService

    ctrl = ControllerService(2, unit_client=lambda address: None)
    with caplog.at_level(W, logger="tq_stream"):
        ctrl.drop_unit(1)
    (msg,) = _messages(caplog)
    assert msg.startswith("storage unit 1 went down and was replaced")


def test_start_and_stop_are_logged_at_info(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="tq_stream"):
        tq.init(storage_units=2).close()
    msgs = _messages(caplog, logging.INFO)
    assert msgs[0].startswith("started a deployment (embedded mode, 2 storage units) in")
    assert msgs[1].startswith("stopped the deployment (embedded mode) in")
