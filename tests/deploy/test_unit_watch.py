"""UnitWatch: a unit's silence belongs to the process that was silent."""

from __future__ import annotations

import threading
import time
from typing import Any

from tq_stream.deploy.unit_watch import UnitWatch
from tq_stream.messages.unit import UnitPing


class _Service:
    def __init__(self) -> None:
        self.answers = 0

    def unit_may_be_dead(self, unit: int) -> bool:
        return False

    def unit_lost(self, unit: int) -> None:
        raise AssertionError("a unit that is only slow is not lost")

    def unit_answered(self, unit: int, pid: int) -> None:
        self.answers += 1


class _ReplacedUnit:
    """A unit's client whose first ping reaches the old process: it hangs while the
    owner replaces the process, then fails (the connection was reset). Pings after
    that reach the new process, which answers only once ``answer`` is set."""

    def __init__(self) -> None:
        self.pings = 0
        self.first_failed = threading.Event()
        self.pinging = threading.Event()
        self.release = threading.Event()
        self.answer = threading.Event()

    def call(self, rpc: Any, request: Any = None, timeout: float = 0.0) -> UnitPing:
        self.pings += 1
        if self.pings == 1:
            self.pinging.set()
            self.release.wait(5.0)
            self.first_failed.set()
            raise ConnectionError("connection reset by peer")
        if not self.answer.is_set():
            raise TimeoutError("the new process is still starting")
        return UnitPing(pid=2, host="", nbytes=0)


def test_a_ping_of_the_old_process_failing_after_its_replacement_does_not_silence_the_new():
    client = _ReplacedUnit()
    watch = UnitWatch(_Service(), lambda: [client], timeout=4.0)  # one ping a second
    try:
        assert client.pinging.wait(20.0)
        watch.replaced(0)  # the owner started a new process, which answers
        client.release.set()
        assert client.first_failed.wait(5.0)
        time.sleep(0.05)  # the failed ping is handled
        assert not watch.silent(0)
    finally:
        watch.stop()


def test_a_unit_that_misses_its_ping_is_silent_until_it_answers():
    client = _ReplacedUnit()
    client.pings = 1  # no replacement: every ping reaches the one process
    service = _Service()
    watch = UnitWatch(service, lambda: [client], timeout=0.2)
    try:
        deadline = time.monotonic() + 5.0
        while not watch.silent(0) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watch.silent(0)
        client.answer.set()
        while watch.silent(0) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not watch.silent(0) and service.answers >= 1
    finally:
        watch.stop()


class _Counting(_Service):
    def __init__(self) -> None:
        super().__init__()
        self.lost: list[int] = []

    def unit_may_be_dead(self, unit: int) -> bool:
        return True

    def unit_lost(self, unit: int) -> None:
        self.lost.append(unit)


class _Dead:
    def call(self, rpc: Any, request: Any = None, timeout: float = 0.0) -> UnitPing:
        raise ConnectionRefusedError("no process serves the unit")


def test_a_replacement_that_dies_before_its_first_ping_is_lost_again():
    """The unit-loss model test: a unit killed, restarted by its owner, and killed again
    before the watch heard from the new process was never declared lost again (the
    first outage's mark stayed): puts to it failed at their timeout, reads waited."""
    service = _Counting()
    watch = UnitWatch(service, lambda: [_Dead()], timeout=0.2)
    try:
        deadline = time.monotonic() + 5.0
        while service.lost != [0] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert service.lost == [0]
        watch.replaced(0)  # the owner restarted it; the new process dies at once
        while service.lost != [0, 0] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert service.lost == [0, 0]
    finally:
        watch.stop()
