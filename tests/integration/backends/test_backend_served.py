"""The backend contract (``tests/helpers/backend_contract.py``) on a storage unit served over a
socket, as the client layer reaches it: ``RemoteUnit`` (another host: every byte on the
socket) and ``SameHostUnit`` (this host: dense fields through shared memory), each
over a ``UnitService`` served in this process, on unix sockets and on zmq."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.backend_contract import BackendContract
from tq_stream.backends.memory import MemoryUnit
from tq_stream.backends.shm import ShmUnit, shm_available
from tq_stream.connection.remote_unit import RemoteUnit
from tq_stream.connection.same_host import SameHostUnit
from tq_stream.deploy.grants import MAX_SLOT
from tq_stream.deploy.unit_service import UnitService
from tq_stream.transport.dispatch import OWNER_ARG
from tq_stream.transport.rpc import rpc_client, rpc_server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

TOKEN = "owner-" + "x" * 26
# Every partition the contract writes: the controller grants a unit the slots it places
# there, and a unit refuses a write to any other slot.
PARTITIONS = ["p", "q", "other", "gone", *(f"p{i}" for i in range(20))]
needs_shm = pytest.mark.skipif(not shm_available(), reason="needs a writable /dev/shm")
# (client, storage kind, transport)
SERVED = {
    "remote-memory-unix": (RemoteUnit, MemoryUnit, "unix"),
    "remote-shm-zmq": (RemoteUnit, ShmUnit, "zmq"),
    "same-host-shm-unix": (SameHostUnit, ShmUnit, "unix"),
    "same-host-memory-unix": (SameHostUnit, MemoryUnit, "unix"),  # no slabs: the socket
}


@pytest.fixture(params=[pytest.param(name, marks=[needs_shm] if kind is ShmUnit else [])
                        for name, (_, kind, _) in SERVED.items()])
def unit(request, tmp_path) -> Iterator[RemoteUnit | SameHostUnit]:
    client, kind, transport = SERVED[request.param]
    backend = kind()
    address = f"unix://{tmp_path}/unit.sock" if transport == "unix" else "tcp://127.0.0.1:0"
    server = rpc_server(UnitService(backend), address, workers=4, backlog=16,
                        owner_token=TOKEN)
    rpc = rpc_client(server.address, timeout=10)
    try:
        for partition in PARTITIONS:
            rpc.call("grant", {"partition": partition, "slots": MAX_SLOT, OWNER_ARG: TOKEN})
        remote = RemoteUnit(rpc, 10.0, TOKEN)
        yield SameHostUnit(remote) if client is SameHostUnit else remote
    finally:
        rpc.close()
        server.close()
        backend.close()


class TestServedUnitContract(BackendContract):
    pass
