"""Early answers (``controller/waiters.py``) with a Controller served on a socket server:
what the committing thread does for a waiter must be what the waiter's own worker may
do (review of the early-answers change)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from tests.helpers.rpc_handler import wait_until
from tests.helpers.served import Served
from tests.helpers.stacks import stacks_on
from tq_stream.backends.memory import MemoryUnit
from tq_stream.controller.controller import Controller
from tq_stream.deploy.services import ControllerService, UnitService
from tq_stream.errors import WaitTimeout
from tq_stream.handling import ANSWERED, may_block
from tq_stream.samplers import Candidates, Sampler, Selection
from tq_stream.transport import InprocTransport
from tq_stream.transport.rpc import rpc_client, rpc_server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

P = "train"
X = {"x": {"kind": "dense", "dtype": "float32", "shape": [4]}}


class DropFirst(Sampler):
    """Discards the oldest ready row and hands out the next one (a staleness-like
    sampler: forming a step frees storage through the units)."""

    def sample(self, candidates: Candidates, batch_size: int) -> Selection:
        if candidates.count < 2:
            return Selection.wait()
        return Selection.split(candidates.index[1:2], 1,
                               discard={"old": candidates.index[:1]})


@contextlib.contextmanager
def _served(ctrl, address: str, tmp_path) -> Iterator[tuple]:
    """``ctrl`` served at ``address`` ("unix": a socket in ``tmp_path``): yields a
    producer's and a consumer's client; closes everything after."""
    if address == "unix":
        address = f"unix://{tmp_path}/ctrl.sock"
    srv = rpc_server(Served(ctrl), address, workers=4, backlog=8)
    try:
        with rpc_client(srv.address, timeout=10) as producer, \
                rpc_client(srv.address, timeout=30) as consumer:
            yield producer, consumer
    finally:
        srv.close()
        ctrl.close()


def _start_get_meta(ctrl, consumer, got: list) -> threading.Thread:
    """A consumer's get_meta of step 0 on its own thread, once it waits."""
    def wait() -> None:
        got.append(consumer.call("get_meta", {"partition": P, "task": "t", "step": 0,
                                              "timeout": 20.0}))

    th = threading.Thread(target=wait, daemon=True)
    th.start()
    wait_until(lambda: len(ctrl.waiters) == 1)
    return th


def _recording_controller(batch_size: int) -> tuple[Controller, list]:
    """A controller with task "t" on P, and the list of what each of its get_meta calls
    returned to its server (``ANSWERED`` when a commit answered it)."""
    ctrl = Controller(1)
    ctrl.create_partition(P, consumers=["t"])
    ctrl.register_task(P, "t", ["x"], batch_size=batch_size)
    returned: list = []
    get_meta = ctrl.get_meta

    def recorded(*args, **kwargs):
        out = get_meta(*args, **kwargs)
        returned.append(out)
        return out

    ctrl.get_meta = recorded  # type: ignore[method-assign]
    return ctrl, returned


def _put(client, key: str) -> None:
    """One row through reserve + commit (commit runs inline on the zmq IO thread)."""
    placed = client.call("reserve", {"partition": P, "keys": [key], "schemas": X,
                                     "timeout": 5.0})
    client.call("commit", {"partition": P, "index": np.asarray(placed["index"]),
                           "generation": np.asarray(placed["generation"]), "schemas": X})


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:0", "unix"])
def test_a_sampler_discard_never_frees_storage_on_the_io_thread(address, tmp_path):
    """The zmq server runs ``commit`` on its IO thread (``inline``: no I/O to another
    process). A waiter's step formed by that commit must not free the discarded rows'
    storage there (a call to a unit, up to 5 s, stalls every client of the server)."""
    frees: list[bool] = []  # may_block() in each free of storage

    def free(unit: int, partition: str, slots: np.ndarray) -> None:
        frees.append(may_block())

    ctrl = Controller(1, free=free)
    ctrl.create_partition(P, consumers=["t"])
    ctrl.register_task(P, "t", ["x"], batch_size=1, sampler=DropFirst())
    got: list = []
    with _served(ctrl, address, tmp_path) as (producer, consumer):
        _put(producer, "k0")  # one ready row: the sampler waits for a second
        th = _start_get_meta(ctrl, consumer, got)
        _put(producer, "k1")  # makes the step: k0 discarded, k1 handed out
        th.join(15)
    assert got and got[0]["keys"] == ["k1"]
    assert frees == [True]  # freed once, on a thread that may block


TOKEN = "owner-" + "t" * 26


class SlowGrantUnit(InprocTransport):
    """A unit served in process whose ``grant`` blocks until the test lets it go (a
    slow unit)."""

    def __init__(self) -> None:
        super().__init__(UnitService(MemoryUnit()), name="u0", owner_token=TOKEN)
        self.granting = threading.Event()
        self.go = threading.Event()

    def call(self, method, args=None, timeout=None):
        if method == "grant" and self.granting.is_set():
            self.go.wait(20)
        return super().call(method, args, timeout)


def test_a_waiting_consumer_is_answered_while_the_commit_grants_slots(tmp_path):
    """``ControllerService.commit_new`` grants new spare slots to a unit (a call to it)
    after the rows were committed. The waiting consumer's reply, given by that commit,
    must not wait for that call (before early answers it was woken at once)."""
    unit = SlowGrantUnit()
    ctrl = ControllerService(1, unit_client=lambda address: unit, unit_timeout=None,
                             owner_token=TOKEN)
    ctrl.attach_units([{"address": "u0", "host": "", "pid": -1}])
    ctrl.create_partition(P, consumers=["t"])
    ctrl.register_task(P, "t", ["x"], batch_size=1)
    placed = ctrl.reserve(P, ["k0"], X, spare=1)  # the producer's spare row
    spare = placed.spare
    srv = rpc_server(Served(ctrl), f"unix://{tmp_path}/ctrl.sock", workers=4, backlog=8)
    got: list = []
    try:
        with rpc_client(srv.address, timeout=30) as producer, \
                rpc_client(srv.address, timeout=30) as consumer:
            th = _start_get_meta(ctrl, consumer, got)
            unit.granting.set()
            put = threading.Thread(target=producer.call, daemon=True, args=(
                "commit_new", {"partition": P, "keys": ["k1"],
                               "index": [int(spare.index[0])],
                               "generation": [int(spare.generation[0])],
                               "schemas": X, "spare": 1000}))  # new spares need a grant
            put.start()
            try:
                wait_until(lambda: got, timeout=10)  # while the grant still waits
            finally:
                unit.go.set()
            put.join(10)
            th.join(10)
        assert got[0]["keys"] == ["k1"] and got[0]["units_epoch"] == ctrl._units_epoch
    finally:
        srv.close()
        ctrl.close()


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:0", "unix"])
def test_the_default_sampler_is_answered_early_by_any_commit(address, tmp_path):
    """With the default sampler a commit forms the waiter's step even on the zmq IO
    thread (it frees nothing), and the waiting handler sends nothing itself."""
    ctrl, returned = _recording_controller(batch_size=1)
    got: list = []
    with _served(ctrl, address, tmp_path) as (producer, consumer):
        th = _start_get_meta(ctrl, consumer, got)
        _put(producer, "k0")
        th.join(15)
    assert got[0]["keys"] == ["k0"] and returned == [ANSWERED]


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:0", "unix"])
def test_a_pool_of_waiting_consumers_gets_every_row_exactly_once(address, tmp_path):
    """Consumers of "the next batch" (step=None) waiting while rows arrive one at a time:
    every reply reaches its own caller once (no row lost, none handed out twice, no
    caller left waiting), whether the commit answered it or it formed its own step."""
    ctrl = Controller(1)
    ctrl.create_partition(P, consumers=["t"])
    ctrl.register_task(P, "t", ["x"], batch_size=1)
    n_rows, n_consumers = 40, 5
    seen: list[list[str]] = [[] for _ in range(n_consumers)]
    errors: list = []
    srv_address = f"unix://{tmp_path}/ctrl.sock" if address == "unix" else address
    srv = rpc_server(Served(ctrl), srv_address, workers=n_consumers + 3, backlog=16)

    def consume(i: int) -> None:
        try:
            with rpc_client(srv.address, timeout=30) as client:
                while True:
                    meta = client.call("get_meta", {"partition": P, "task": "t",
                                                    "timeout": 20.0, "session": f"s{i}"})
                    if meta["end"]:
                        return
                    seen[i] += meta["keys"]
                    client.call("ack", {"partition": P, "task": "t", "step": meta["step"],
                                        "dp_rank": 0, "index": meta["index"],
                                        "generation": meta["generation"]})
        except Exception as exc:  # noqa: BLE001 — the test asserts on it
            errors.append(exc)

    try:
        threads = [threading.Thread(target=consume, args=(i,), daemon=True)
                   for i in range(n_consumers)]
        for th in threads:
            th.start()
        wait_until(lambda: len(ctrl.waiters) == n_consumers, timeout=10)
        with rpc_client(srv.address, timeout=10) as producer, stacks_on(WaitTimeout):
            for k in range(n_rows):
                _put(producer, f"k{k}")
            producer.call("close_partition", {"partition": P})
        for th in threads:
            th.join(30)
        assert errors == []
        keys = [k for s in seen for k in s]
        assert sorted(keys) == sorted(f"k{k}" for k in range(n_rows))
        assert len(ctrl.waiters) == 0
    finally:
        srv.close()
        ctrl.close()


@pytest.mark.parametrize(("address", "early"), [("tcp://127.0.0.1:0", False),
                                                ("unix", True)])
def test_a_large_step_is_not_formed_on_the_io_thread(address, early, tmp_path):
    """A step of more than ``MAX_INLINE_STEP`` rows takes milliseconds to form and encode:
    a commit on the zmq IO thread leaves it to the waiter's own worker (every other
    caller of the server waits while the IO thread works); a unix worker forms it."""
    from tq_stream.controller.consuming import MAX_INLINE_STEP

    n = MAX_INLINE_STEP + 1
    ctrl, returned = _recording_controller(batch_size=n)
    got: list = []
    keys = [f"k{i}" for i in range(n)]
    with _served(ctrl, address, tmp_path) as (producer, consumer):
        th = _start_get_meta(ctrl, consumer, got)
        placed = producer.call("reserve", {"partition": P, "keys": keys, "schemas": X,
                                           "timeout": 5.0})
        producer.call("commit", {"partition": P, "index": np.asarray(placed["index"]),
                                 "generation": np.asarray(placed["generation"]),
                                 "schemas": X})
        th.join(15)
    assert sorted(got[0]["keys"]) == sorted(keys)
    assert (returned == [ANSWERED]) is early
