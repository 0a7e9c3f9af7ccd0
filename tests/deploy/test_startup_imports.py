"""A server process loads what serving needs, not the client side: importing the
modules a local child or a Ray actor runs, and building both services, loads
neither tensordict nor torch._dynamo (seconds of start-up per process)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import tq_stream

HEAVY = ("tensordict", "torch._dynamo")


@pytest.mark.timeout(120)
def test_a_server_process_loads_no_client_side_modules():
    code = ("import sys\n"
            "from tq_stream.deploy.server import build_service\n"
            "import tq_stream.deploy.ray_deploy\n"
            "for role in ('controller', 'unit'):\n"
            "    service, stop = build_service(role, storage='memory')\n"
            "    stop()\n"
            f"print(sorted(m for m in sys.modules if m.startswith({HEAVY!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=110, check=True)
    assert out.stdout.strip() == "[]"


def test_public_names_load_on_first_use():
    assert tq_stream.StreamConfig(timeout=1.0).timeout == 1.0
    assert "Client" in dir(tq_stream)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        tq_stream.nope  # noqa: B018
