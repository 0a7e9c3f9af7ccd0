"""More waiting consumers than a server has workers: the calls that end their waits
still run (a server caps its long-polls per wait class and parks the rest, see
``tq_stream.transport.wait_slots``). Before, 140 consumers waiting on a controller of
128 workers blocked the producer's put until the waits timed out, and 128 of them got
WaitTimeout although their rows had arrived."""

from __future__ import annotations

import tempfile
import threading

import pytest
import torch

from tests.helpers.tq_fixtures import start_local
from tq_stream.transport.handler import Methods
from tq_stream.transport.unix_client import UnixRpcClient
from tq_stream.transport.unix_server import UnixRpcServer
from tq_stream.transport.zeromq import RpcClient, RpcServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


class Gate:
    """``wait`` blocks until ``open`` is called (a consumer's long-poll and the put
    that ends it)."""

    RPC_TABLE = Methods({"wait", "open"}, waits={"wait": "consume"})

    def __init__(self) -> None:
        self._event = threading.Event()

    def wait(self, timeout: float) -> bool:
        return self._event.wait(timeout)

    def open(self) -> bool:
        self._event.set()
        return True


def _servers():
    unix = "unix://" + tempfile.mkdtemp() + "/gate"
    return [(lambda h, caps: UnixRpcServer(h, unix, workers=3, wait_caps=caps).start(),
             UnixRpcClient),
            (lambda h, caps: RpcServer(h, workers=3, wait_caps=caps).start(), RpcClient)]


@pytest.mark.parametrize("kind", [0, 1], ids=["unix", "zmq"])
def test_waits_beyond_the_cap_are_parked_and_the_opening_call_runs(kind):
    start, client_cls = _servers()[kind]
    gate = Gate()
    server = start(gate, {"consume": 2})
    results: list[object] = []
    try:
        def wait() -> None:
            with client_cls(server.address, timeout=60) as c:
                results.append(c.call("wait", {"timeout": 30.0}))

        waiters = [threading.Thread(target=wait) for _ in range(5)]  # 3 workers only
        for t in waiters:
            t.start()
        with client_cls(server.address, timeout=10) as c:
            assert c.call("open", {}) is True  # a worker is left for it
        for t in waiters:
            t.join(60)
        assert results == [True] * 5  # parked waits ran once their turn came
    finally:
        gate.open()
        server.close()


def test_more_waiting_consumers_than_controller_workers_all_get_their_rows():
    stream = start_local(storage_units=1)
    try:
        stream.create_partition("p")
        client = stream.client()
        n = 140  # the controller runs 128 workers
        client.register_task("p", "t", ["x"], batch_size=1, dp_size=n)
        got: dict[int, object] = {}

        def wait(rank: int) -> None:
            try:
                got[rank] = client.get_meta("p", "t", 0, dp_rank=rank, timeout=60).keys
            except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                got[rank] = exc

        threads = [threading.Thread(target=wait, args=(r,)) for r in range(n)]
        for t in threads:
            t.start()
        keys = [f"k{i}" for i in range(n)]
        stream.writer("p").put(keys, {"x": torch.zeros(n, 2)}, timeout=30)
        for t in threads:
            t.join(90)
        errors = [v for v in got.values() if isinstance(v, Exception)]
        assert not errors and len(got) == n, errors[:3]
        assert sorted(k for v in got.values() for k in v) == sorted(keys)
    finally:
        stream.close()
