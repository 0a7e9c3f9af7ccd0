"""WaitSlots: per-class caps on requests that may wait long; the others are parked in
arrival order and handed a slot as one of their class finishes."""

from __future__ import annotations

import time

import pytest

from tq_stream.errors import ConfigError
from tq_stream.transport.wait_slots import MIN_WAIT, WaitSlots, resumed

CLASSES = {"get_meta": "consume", "reserve": "produce", "admit": "produce"}


def test_a_class_runs_up_to_its_cap_and_parks_the_rest_in_order():
    slots = WaitSlots(CLASSES, {"consume": 2})
    assert slots.take("get_meta", "a") and slots.take("get_meta", "b")
    assert not slots.take("get_meta", "c") and not slots.take("get_meta", "d")
    assert slots.parked() == 2
    assert slots.take("reserve", "p") and slots.take("ack", "x")  # not capped
    assert slots.release("reserve") is None and slots.release("ack") is None
    assert slots.release("get_meta") == "c"  # a's slot passes to the oldest parked
    assert slots.release("get_meta") == "d"
    assert slots.release("get_meta") is None and slots.release("get_meta") is None
    assert slots.take("get_meta", "e") and slots.take("get_meta", "f")  # both slots free
    assert not slots.take("get_meta", "g")


def test_classes_are_capped_separately():
    slots = WaitSlots(CLASSES, {"consume": 1, "produce": 1})
    assert slots.take("get_meta", 1) and not slots.take("get_meta", 2)
    assert slots.take("reserve", 3)  # consumers waiting never hold up a producer's slot
    assert not slots.take("admit", 4)  # reserve and admit share the produce class
    assert slots.release("reserve") == 4
    assert slots.drain() == [2] and slots.parked() == 0


def test_caps_must_name_wait_classes_and_be_positive():
    with pytest.raises(ConfigError, match=r"wait_caps must name wait classes.*\['bogus'\]"):
        WaitSlots(CLASSES, {"bogus": 1})
    with pytest.raises(ConfigError, match="wait_caps\\['consume'\\]"):
        WaitSlots(CLASSES, {"consume": 0})
    assert WaitSlots(CLASSES, None).take("get_meta", 1)  # no caps: never parked


def test_a_resumed_wait_is_shortened_by_the_time_it_was_parked():
    request = (7, "get_meta", {"partition": "p", "timeout": 10.0}, 15.0)
    req_id, method, args, rpc_timeout = resumed(request, time.monotonic() - 4.0)
    assert (req_id, method, rpc_timeout) == (7, "get_meta", 15.0)
    assert 5.0 < args["timeout"] <= 6.0 and args["partition"] == "p"
    assert request[2]["timeout"] == 10.0  # the parked request itself is unchanged
    assert resumed(request, time.monotonic() - 60.0)[2]["timeout"] == MIN_WAIT
    no_wait = (1, "ack", {"step": 3}, 5.0)
    assert resumed(no_wait, time.monotonic() - 4.0) == no_wait
