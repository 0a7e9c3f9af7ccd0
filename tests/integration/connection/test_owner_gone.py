"""Issue 20 item 9: the process that called ``tq.init(mode="local")`` dies; a consumer in
another process fails within seconds with DeploymentGone naming the deployment,
instead of waiting out its timeout (re-sending calls for a controller nothing will
restart)."""

from __future__ import annotations

import base64
import pickle
import signal
import subprocess
import sys
import time

import pytest

import tq_stream as tq
from tests.helpers.tq_fixtures import kill
from tq_stream.errors import DeploymentGone

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

_OWNER = """
import base64, pickle, sys, torch
import tq_stream as tq
transport = sys.argv[1]
opts = {"curve": True} if transport == "curve" else {"transport": transport}
s = tq.init(mode="local", storage_units=1, **opts)
s.writer("p").put(["a"], {"x": torch.ones(1, 4)})
print(s.address, base64.b64encode(pickle.dumps(s)).decode(),
      base64.b64encode(s.curve_server_key or b"-").decode(), flush=True)
sys.stdin.readline()
"""

WAIT = 45.0  # the consumer's timeout: what it used to wait out


def _handle(how: str, address: str, pickled: str, key: str) -> tq.Stream:
    if how == "pickled":
        return pickle.loads(base64.b64decode(pickled))
    raw = base64.b64decode(key)
    return tq.connect(address, config=tq.StreamConfig(timeout=WAIT),
                      curve_server_key=None if raw == b"-" else raw)


@pytest.mark.parametrize("how", ["connect", "pickled"])
@pytest.mark.parametrize("transport", ["unix", "curve"])
def test_a_consumer_fails_soon_with_a_clear_error_when_the_owner_is_killed(transport, how):
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, transport], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    stream = None
    try:
        line = owner.stdout.readline()
        assert line, f"the owner exited with {owner.wait(10)}"
        address, pickled, key = line.split()
        stream = _handle(how, address, pickled, key)
        client = stream.client()
        client.register_task("p", "t", ["x"], batch_size=4)  # 1 row: get_meta waits
        owner.send_signal(signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(DeploymentGone, match=address.replace("/", ".")) as err:
            client.get_meta("p", "t", timeout=WAIT)
        waited = time.monotonic() - started
        assert waited < 15.0, f"waited {waited:.1f} s of the {WAIT:g} s timeout"
        assert "owner" in str(err.value)
        # Every later call fails the same way, at once.
        started = time.monotonic()
        with pytest.raises(DeploymentGone):
            stream.stats()
        assert time.monotonic() - started < 15.0
    finally:
        if stream is not None:
            stream.close()
        if owner.poll() is None:
            kill(owner.pid)
        owner.wait(10)
        owner.stdin.close()
        owner.stdout.close()
