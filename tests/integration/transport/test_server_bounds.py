"""Servers a client cannot exhaust (local mode): a unit stores rows only in slots the
controller placed, every request is bounded in size, idle connections neither lock
new clients out nor cost threads, and random input keeps within those bounds."""

from __future__ import annotations

import random
import socket
import struct

import numpy as np
import pytest
import torch
import zmq

from tests.helpers.tq_fixtures import start_local, wait_until
from tests.helpers.tq_workers import values
from tq_stream.errors import StateError
from tq_stream.serialization import encode
from tq_stream.transport.handler import Methods
from tq_stream.transport.rpc import rpc_client
from tq_stream.transport.unix_server import UnixRpcServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


def status(pid: int, field: str) -> int:
    """A number from /proc/<pid>/status (``VmRSS`` in kB, ``Threads``)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def shm_bytes(pid: int) -> int:
    """Bytes of the shared-memory segments process ``pid`` has mapped."""
    total = 0
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            if "/dev/shm/" in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                total += hi - lo
    return total


@pytest.fixture(scope="module", params=["unix", "tcp"])
def deployment(request):
    stream = start_local(storage_units=1, transport=request.param)
    try:
        yield stream
    finally:
        stream.close()


# ---------------------------------------------------------------- slot grants


@pytest.mark.parametrize("slot", [2**24, 2**31 - 1])
def test_a_unit_refuses_slots_the_controller_did_not_place(deployment, slot):
    keys = ["g_0", "g_1"]
    deployment.writer("grants").put(keys, {"x": values(keys)})  # placed: slots 0, 1
    unit_pid, unit = deployment.owner.pids[0], deployment.connection.controller().units()[0]
    before = shm_bytes(unit_pid), status(unit_pid, "VmRSS")
    with rpc_client(unit.address, timeout=10) as raw:
        with pytest.raises(StateError, match=f"slots must be ones the controller placed.*"
                                              f"got slot {slot}"):
            raw.call("put", {"partition": "grants", "slots": np.array([slot]),
                             "columns": {"x": torch.ones(1, 3)}})
        with pytest.raises(StateError, match="controller placed"):  # a new partition too
            raw.call("put", {"partition": "other", "slots": np.array([0]),
                             "columns": {"x": torch.ones(1, 4)}})
    assert shm_bytes(unit_pid) == before[0]
    assert status(unit_pid, "VmRSS") - before[1] < 64 << 10  # kB: nothing was allocated
    # Placed rows still read back intact.
    assert torch.equal(deployment.kv.get_batch(keys, partition="grants")["x"], values(keys))


def test_puts_keep_working_as_placements_outgrow_the_first_grant(deployment):
    keys = [f"many_{i}" for i in range(300)]
    for i in range(0, 300, 50):  # several reserves, each beyond the last grant
        deployment.writer("growing").put(keys[i:i + 50], {"x": values(keys[i:i + 50])})
    assert torch.equal(deployment.kv.get_batch(keys, partition="growing")["x"], values(keys))


# -------------------------------------------------------------- message bounds


def test_the_controller_refuses_a_message_above_its_bound(deployment):
    pid = deployment.owner.pids[-1]
    peak = status(pid, "VmHWM")  # the most memory the controller ever held (kB)
    size = 128 << 20  # twice the controller's bound (64 MiB)
    if deployment.address.startswith("unix://"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        sock.connect(deployment.address[len("unix://"):])
        sock.sendall(struct.pack("<IQ", 1, size))  # announces 128 MiB: cut off at once
        assert sock.recv(16) == b""
        sock.close()
    else:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 10_000  # ms: closing waits until the message left (or was refused)
        sock.connect(deployment.address)
        sock.send_multipart([b"", b"\x00" * size])
        sock.close()
        ctx.term()
    keys = ["big_0"]
    deployment.writer("big").put(keys, {"x": values(keys)})  # still serves everyone
    assert deployment.kv.get_batch(keys, partition="big")["x"].shape == (1, 3)
    assert status(pid, "VmHWM") - peak < 64 << 10  # kB: never buffered


# ---------------------------------------------------------------- connections


def test_idle_connections_lock_no_client_out_and_cost_no_threads():
    stream = start_local(storage_units=1, transport="unix")
    idle = []
    try:
        pid = stream.owner.pids[-1]
        path = stream.address[len("unix://"):]
        threads = status(pid, "Threads")
        for _ in range(1200):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(path)
            idle.append(sock)
        keys = ["idle_0"]
        stream.writer("idle").put(keys, {"x": values(keys)})  # a new client gets in
        assert torch.equal(stream.kv.get_batch(keys, partition="idle")["x"], values(keys))
        assert status(pid, "Threads") <= threads + 2
    finally:
        for sock in idle:
            sock.close()
        stream.close()


class _Echo:
    RPC_TABLE = Methods({"echo"})

    def echo(self, value):
        return value


def test_an_idle_connection_is_closed_after_the_idle_timeout(tmp_path):
    address = f"unix://{tmp_path}/echo"
    with UnixRpcServer(_Echo(), address, idle_timeout=0.5) as server:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(tmp_path / "echo"))
        assert wait_until(lambda: server.connections == 1, 5)
        assert wait_until(lambda: server.connections == 0, 10)
        sock.settimeout(5)
        assert sock.recv(1) == b""  # closed by the server
        sock.close()
        with rpc_client(address, timeout=5) as client:  # clients simply reconnect
            assert client.call("echo", {"value": 3}) == 3


# ---------------------------------------------------------------------- fuzz


def _fuzz_unix(path: str, rng: random.Random, n: int) -> None:
    """Frames with random sizes (some huge, some lying) and random bodies."""
    for _ in range(n):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(2)
        sock.connect(path)
        count = rng.choice([1, 2, rng.randrange(1, 2**14), rng.randrange(2**32)])
        sizes = [rng.choice([0, 8, rng.randrange(2**20), rng.randrange(2**64)])
                 for _ in range(min(count, 4))]
        data = struct.pack("<I", count) + b"".join(struct.pack("<Q", s) for s in sizes)
        try:
            sock.sendall(data + rng.randbytes(rng.randrange(256)))
        except OSError:
            pass
        sock.close()


def _fuzz_zmq(address: str, rng: random.Random, n: int) -> None:
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.sndtimeo = 2000
        sock.connect(address)
        for _ in range(n):
            request = {"id": rng.randrange(2**31), "method": rng.choice(["put", "reserve"]),
                       "args": {"partition": "fz",
                                "slots": np.array([rng.randrange(2**31)]),
                                "columns": {"x": torch.ones(1, 4)}}}
            frames = [bytes(memoryview(f)) for f in encode(request)]
            if rng.random() < 0.3:
                frames.append(rng.randbytes(rng.randrange(1 << 16)))
            try:
                sock.send_multipart([b"", *frames])
            except zmq.Again:
                break
    finally:
        ctx.destroy(linger=0)


def test_random_input_stays_within_the_bounds(deployment):
    rng = random.Random(11)
    pids = deployment.owner.pids
    before = {p: (status(p, "VmRSS"), status(p, "Threads"), shm_bytes(p)) for p in pids}
    infos = deployment.connection.controller().units()
    for address in [deployment.address, infos[0].address]:
        if address.startswith("unix://"):
            _fuzz_unix(address[len("unix://"):], rng, 200)
        else:
            _fuzz_zmq(address, rng, 200)
    keys = ["fz_0"]
    deployment.writer("fz_after").put(keys, {"x": values(keys)})
    assert torch.equal(deployment.kv.get_batch(keys, partition="fz_after")["x"], values(keys))
    for p in pids:
        rss, threads, shm = before[p]
        assert status(p, "VmRSS") - rss < 128 << 10  # kB
        assert status(p, "Threads") <= threads + 2
        assert shm_bytes(p) <= shm + (1 << 20)
