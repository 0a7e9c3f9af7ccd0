"""Issue 20 item 12: ``tq-stream status`` on a deployment that is gone, or that does not
answer, prints one clear line and exits nonzero at once (``--timeout`` bounds a call)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from tests.helpers.tq_fixtures import start_local

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _status(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "tq_stream", "status", *args],
                          capture_output=True, text=True, timeout=90)
    return done, time.monotonic() - started


def test_status_of_a_closed_local_deployment_says_so_at_once():
    stream = start_local(storage_units=1)
    address = stream.address
    stream.close()  # its socket folder goes with it
    done, took = _status(address)
    assert done.returncode == 1, done
    assert "Traceback" not in done.stderr, done.stderr
    assert address in done.stderr and "does not exist" in done.stderr, done.stderr
    assert took < 20.0, f"took {took:.1f} s"  # interpreter start included; was 60 s


def test_status_timeout_bounds_a_deployment_that_does_not_answer():
    with socket.socket() as s:  # a port where nothing serves
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    done, took = _status(address, "--timeout", "1.5")
    assert done.returncode == 1, done
    assert "Traceback" not in done.stderr, done.stderr
    assert address in done.stderr and "within 1.5 s" in done.stderr, done.stderr
    assert took < 20.0, f"took {took:.1f} s"
