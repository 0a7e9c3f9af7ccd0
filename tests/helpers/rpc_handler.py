"""A handler, its fixture and a polling helper shared by the transport tests (a test
module takes the fixture with ``from rpc_handler import handler``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from tq_stream.errors import KeyConflictError
from tq_stream.transport.handler import Methods


class Handler:
    RPC_TABLE = Methods({"echo", "sleep", "block", "fail", "crash"})

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def echo(self, value=None):
        return value

    def sleep(self, seconds):
        time.sleep(seconds)
        return seconds

    def block(self, timeout):
        self.entered.set()
        return self.release.wait(timeout)

    def fail(self, message):
        raise KeyConflictError(message)

    def crash(self):
        return 1 / 0

    def secret(self):  # public but not allowlisted
        return "secret"


def wait_until(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


@pytest.fixture
def handler() -> Iterator[Handler]:
    """A fresh Handler; a call still blocked in it is released at teardown."""
    h = Handler()
    yield h
    h.release.set()
