"""Under load, answers come or say why (local mode): with busy-loop processes hogging
the CPUs, many clients put (small and growing bulk batches, some aborted right after
their reserve), consume and ack at once; every call answers within its timeout, and
every row put is either delivered once or still stored."""

from __future__ import annotations

import os
import threading
import time
import traceback

import pytest
import torch

import tq_stream as tq
from tests.helpers.tq_fixtures import start_local, wait_gone
from tq_stream.convert import schemas_of
from tq_stream.transport.rpc import rpc_client

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

HOGS = 3  # busy-loop processes (the machine this was written on has 2 cores)
LOAD_SECONDS = 6.0  # how long the clients run
RANKS = 3
BATCH = 4


def _hog() -> int:
    """A busy-loop child; it ends when killed, when this process dies, or after 120 s."""
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child spins
        deadline = time.monotonic() + 120
        while os.getppid() == parent and time.monotonic() < deadline:
            pass
        os._exit(0)
    return pid


class Load:
    """The clients' shared bookkeeping: what went in, what came out, what failed."""

    def __init__(self, stream: tq.Stream) -> None:
        self.stream = stream
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.put_keys: list[str] = []
        self.acked: list[str] = []
        self.errors: list[BaseException] = []

    def run(self, fn, *args) -> threading.Thread:
        def body() -> None:
            try:
                fn(self, *args)
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                with self.lock:
                    self.errors.append(exc)
                self.stop.set()

        thread = threading.Thread(target=body, daemon=True)
        thread.start()
        return thread


def _producer(load: Load, name: str, rows: int, width: int) -> None:
    writer = load.stream.writer("load")
    i = 0
    while not load.stop.is_set():
        keys = [f"{name}-{i + j}" for j in range(rows)]
        writer.put(keys, {"x": torch.full((rows, width), float(i))})
        with load.lock:
            load.put_keys += keys
        i += rows


def _aborter(load: Load, name: str) -> None:
    """Reserves rows and aborts them, racing the other puts for the same slots."""
    ctrl = load.stream.connection.controller()
    schemas = schemas_of({"x": torch.zeros(1, 8)})
    i = 0
    while not load.stop.is_set():
        keys = [f"{name}-{i + j}" for j in range(16)]
        place = ctrl.reserve(partition="load", keys=keys, schemas=schemas, timeout=30.0)
        ctrl.abort(partition="load", index=place.index, generation=place.generation)
        i += 16


def _consumer(load: Load, rank: int) -> None:
    client = load.stream.client()
    step = 0
    while not load.stop.is_set():
        try:
            meta = client.get_meta("load", "train", step, dp_rank=rank, timeout=1.0)
        except tq.errors.WaitTimeout:
            continue  # nothing new yet (a bounded long-poll), ask again
        assert client.get_data(meta)["x"].shape[0] == len(meta.keys)
        client.ack(meta)
        with load.lock:
            load.acked += list(meta.keys)
        step += 1


def _observer(load: Load) -> None:
    while not load.stop.is_set():
        assert "load" in load.stream.stats()


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_every_call_answers_under_cpu_load(transport):
    stream = start_local(storage_units=2, transport=transport,
                         config=tq.StreamConfig(timeout=30.0))
    hogs = [_hog() for _ in range(HOGS)]
    load = Load(stream)
    try:
        stream.client().register_task("load", "train", ["x"], batch_size=BATCH,
                                      dp_size=RANKS)
        threads = [load.run(_producer, f"small{n}", 1, 8) for n in range(4)]
        threads += [load.run(_producer, f"bulk{n}", 256, 8) for n in range(2)]
        threads += [load.run(_aborter, f"abort{n}") for n in range(2)]
        threads += [load.run(_consumer, r) for r in range(RANKS)]
        threads += [load.run(_observer)]
        load.stop.wait(LOAD_SECONDS)
        load.stop.set()
        for thread in threads:
            thread.join(60)
        assert not [t for t in threads if t.is_alive()], "a client never got an answer"
        assert not load.errors, "".join(traceback.format_exception(load.errors[0]))
    finally:
        for pid in hogs:
            os.kill(pid, 9)
        assert wait_gone(hogs, 10) == []
        for pid in hogs:
            os.waitpid(pid, 0)
    try:
        assert len(load.acked) == len(set(load.acked)), "a row was delivered twice"
        assert set(load.acked) <= set(load.put_keys)
        stored = set(load.put_keys) - set(load.acked)
        found = stream.kv.get_batch(sorted(stored), partition="load")["x"] if stored else None
        assert found is None or found.shape[0] == len(stored), "a row put was lost"
    finally:
        stream.close()


def test_a_put_that_waits_for_an_open_direct_write_does_not_block_the_unit():
    """A put that must grow a slab while a same-host direct write is open waits for it
    to finish; the wait must not hold the zmq server's IO thread, which has to run
    the ``finish_write`` that ends it (before: both stalled until GROWTH_WAIT)."""
    stream = start_local(storage_units=1, transport="tcp")
    try:
        ctrl = stream.connection.controller()
        keys = [f"g_{i}" for i in range(100)]
        schemas = schemas_of({"x": torch.zeros(1, 3)})
        place = ctrl.reserve(partition="g", keys=keys, schemas=schemas)  # slots granted
        slots = place.slot
        unit = ctrl.units()[0].address
        with rpc_client(unit, timeout=20) as raw:
            raw.call("put", {"partition": "g", "slots": slots[:16],
                             "columns": {"x": torch.zeros(16, 3)}})
            plan = raw.call("prepare_write", {"partition": "g", "slots": slots[:1],
                                              "generations": None,
                                              "fields": {"x": ["float32", [3]]}})
            grown: list[BaseException | None] = []

            def grow() -> None:  # slot 99 is beyond the slab: it must grow
                try:
                    raw.call("put", {"partition": "g", "slots": slots[99:],
                                     "columns": {"x": torch.ones(1, 3)}})
                    grown.append(None)
                except BaseException as exc:  # noqa: BLE001 - asserted below
                    grown.append(exc)

            thread = threading.Thread(target=grow)
            thread.start()
            with rpc_client(unit, timeout=20) as other:  # another client, same server
                other.call("finish_write", {"partition": "g", "ticket": plan["ticket"]})
            thread.join(30)
            assert grown == [None]
            got = raw.call("get", {"partition": "g", "slots": slots[99:], "fields": ["x"]})
            assert torch.equal(got["x"], torch.ones(1, 3))
    finally:
        stream.close()
