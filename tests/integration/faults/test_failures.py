"""Failures in local mode: a consumer killed mid-lease, a storage unit restarted, a
controller that is gone, and garbage on the sockets."""

from __future__ import annotations

import random
import socket
import struct
import time

import numpy as np
import pytest
import torch
import zmq

import tq_stream as tq
from tests.helpers.tq_fixtures import (
    alive,
    kill,
    killed_consumer,
    local_stream,
    segments_of,
    start_local,
    wait_gone,
)
from tests.helpers.tq_workers import values
from tq_stream.deploy.services import UNIT_LOST
from tq_stream.errors import StateError, WaitTimeout
from tq_stream.serialization import encode
from tq_stream.transport.rpc import rpc_client

__all__ = ["local_stream"]  # the module-scoped fixture, imported for pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


# ------------------------------------------------------------ a consumer dies


@pytest.mark.timeout(90)
def test_rows_of_a_killed_consumer_are_delivered_again_after_the_lease(local_stream):
    part, lease = "lease", 2.0
    keys = [f"l_{i}" for i in range(8)]
    client = local_stream.client()
    client.register_task(part, "t", ["x"], batch_size=4, lease_timeout=lease)
    local_stream.writer(part).put(keys, {"x": values(keys)})
    held = killed_consumer(local_stream, part)
    leased_at = time.monotonic()
    other = client.get_meta(part, "t", step=1, timeout=10)  # the rows nobody holds
    assert set(other.keys) == set(keys) - set(held)
    client.ack(other)
    assert local_stream.stats()[part]["tasks"]["t"]["leased"] == len(held)
    # The controller runs in another process, so no fake clock: let the lease run out.
    time.sleep(max(0.0, leased_at + lease + 0.5 - time.monotonic()))
    again = client.get_meta(part, "t", step=0, timeout=10)  # the replacement consumer
    assert sorted(again.keys) == sorted(held), "the dead consumer's rows must come back"
    assert torch.equal(client.get_data(again)["x"], values(list(again.keys)))
    client.ack(again)
    local_stream.close_partition(part)
    assert client.get_meta(part, "t", step=2, timeout=10).end
    stats = local_stream.stats()[part]["tasks"]["t"]
    # handed out once, then again (same share) to the replacement after the expiry
    assert stats["acked"] == len(keys) and stats["handed_out"] == len(keys)
    assert stats["redelivered"] == len(held) and stats["expired"] >= 1


# ------------------------------------------------------------ a unit restarts


def test_small_puts_after_a_unit_restart_reach_the_new_unit():
    """A writer that copied rows into a unit's shared memory must not keep copying into
    the memory of a unit that died and was replaced at the same address."""
    stream = start_local(storage_units=2)
    try:
        w = stream.writer("again")
        before = [f"b_{i}" for i in range(40)]
        for k in before:  # one row per put: straight into both units' shared memory
            w.put([k], {"x": values([k])})
        assert any(u._writes for u in stream.connection.units())  # layouts cached for writes
        dead = stream.processes()[2].pid  # unit 1
        kill(dead)  # a crash: the unit cannot tell anyone its memory is gone
        assert wait_gone([dead], 20.0) == []
        stream.owner.restart_unit(1)
        after = [f"a_{i}" for i in range(40)]
        for k in after:
            w.put([k], {"x": values([k])})
        meta = stream.kv.meta(after, partition="again")
        assert set(meta.unit.tolist()) == {0, 1}  # some rows went to the new unit
        assert torch.equal(stream.kv.get_batch(after, partition="again")["x"], values(after))
        for k in after:
            assert torch.equal(stream.kv.get(k, partition="again")["x"], values([k])[0])
    finally:
        stream.close()


def test_unit_restart_drops_its_rows_and_serves_again(local_stream):
    part = "restart"
    keys = [f"u_{i}" for i in range(12)]
    local_stream.create_partition(part, consumers=["t"])
    client = local_stream.client()
    client.register_task(part, "t", ["x"], batch_size=4)
    for i in range(0, len(keys), 2):  # puts of 2 rows: one row on each unit
        pair = keys[i : i + 2]
        local_stream.writer(part).put(pair, {"x": values(pair)})
    where = local_stream.kv.meta(keys, partition=part)
    on_1 = [k for k, u in zip(keys, where.unit.tolist(), strict=True) if u == 1]
    assert 0 < len(on_1) < len(keys)
    step0 = client.get_meta(part, "t", step=0)
    assert torch.equal(client.get_data(step0)["x"], values(list(step0.keys)))  # maps slabs
    owner = local_stream.owner
    old_pid = owner.pids[1]

    assert owner.restart_unit(1)[part] == len(on_1)

    assert not alive(old_pid) and segments_of([old_pid]) == []
    stats = local_stream.stats()[part]
    assert stats["rows"] == len(keys) - len(on_1)
    assert stats["tasks"]["t"]["discarded"] == {UNIT_LOST: len(on_1)}
    assert set(step0.keys) & set(on_1)
    with pytest.raises(StateError):  # not the dead unit's bytes, still mapped here
        client.get_data(step0)
    client.ack(step0)  # rows that were lost are simply gone
    kept = [k for k in keys if k not in on_1]
    unread = [k for k in kept if k not in step0.keys]  # acked rows of step 0 were freed
    assert [r["key"] for r in local_stream.kv.list(partition=part)] == unread
    assert torch.equal(local_stream.kv.get_batch(unread, partition=part)["x"], values(unread))
    fresh = [f"u_{i}" for i in range(100, 108)]
    local_stream.writer(part).put(fresh, {"x": values(fresh)})
    assert set(local_stream.kv.meta(fresh, partition=part).unit.tolist()) == {0, 1}
    assert torch.equal(local_stream.kv.get_batch(fresh, partition=part)["x"], values(fresh))
    local_stream.close_partition(part)
    ds = tq.StreamingDataset(local_stream, part, "t", ["x"], batch_size=4)
    ds.start_step = 1
    rest = [k for b in tq.StreamingDataLoader(ds) for k in tq.batch_meta(b).keys]
    delivered = rest + [k for k in step0.keys if k not in on_1]
    assert sorted(delivered) == sorted(kept + fresh)


# ------------------------------------------------------- the controller is gone


def test_a_dead_controller_gives_a_timeout_naming_its_address():
    quick = tq.StreamConfig(timeout=1.0)
    stream = start_local(storage_units=1, config=quick)
    try:
        address, ctrl_pid = stream.address, stream.processes()[0].pid
        client = stream.client()
        client.register_task("p", "t", ["x"], batch_size=1)
        kill(ctrl_pid)
        assert wait_gone([ctrl_pid], 10) == []
        for call in (lambda: tq.connect(address, config=quick),
                     stream.stats,
                     lambda: client.get_meta("p", "t", step=0, timeout=1.0)):
            started = time.monotonic()
            with pytest.raises(WaitTimeout, match=address.replace(".", r"\.")):
                call()
            assert time.monotonic() - started < 10
    finally:
        stream.close()


# ------------------------------------------------------------------ fuzzing


def _junk(rng: random.Random, depth: int = 0) -> object:
    kinds = ["int", "str", "bytes", "float", "none", "bool"] + (["list", "dict"] if depth < 2
                                                                else [])
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.choice([-1, 2**40, -(2**62), 7, 10**30 % 2**63])
    if kind == "str":
        return rng.choice(["", "x", "p", "\x00", "ü" * 50])
    if kind == "bytes":
        return rng.randbytes(rng.randint(0, 16))
    if kind == "float":
        return rng.choice([float("nan"), -0.0, 1e308, 3.5])
    if kind == "none":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "list":
        return [_junk(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["partition", "slots", "keys", "a"]): _junk(rng, depth + 1)
            for _ in range(rng.randint(0, 3))}


def _garbage(rng: random.Random, methods: list[str]) -> list[bytes]:
    """One malformed or hostile message (without the DEALER's empty delimiter)."""
    kind = rng.randrange(6)
    if kind == 0:  # random frames
        return [rng.randbytes(rng.randint(0, 64)) for _ in range(rng.randint(1, 4))]
    request = {"id": rng.randint(1, 2**31), "method": rng.choice(methods + ["__init__", "x"]),
               "args": {k: _junk(rng) for k in rng.sample(
                   ["partition", "slots", "keys", "fields", "columns", "unit", "timeout",
                    "generations", "schemas", "state"], rng.randint(0, 4))},
               "timeout": 1.0}
    if kind == 1:  # an array where a tensor frame is announced
        request["args"]["slots"] = np.arange(4)
    frames = [bytes(memoryview(f)) for f in encode(request)]
    if kind == 2:  # truncated header
        frames[0] = frames[0][: rng.randrange(max(1, len(frames[0])))]
    elif kind == 3:  # a buffer frame missing or extra
        frames = frames[:1] if len(frames) > 1 else frames + [b"\x00" * 8]
    elif kind == 4:  # the header's bytes flipped
        head = bytearray(frames[0])
        for _ in range(3):
            head[rng.randrange(len(head))] = rng.randrange(256)
        frames[0] = bytes(head)
    return frames


def _send_garbage_zmq(ctx: zmq.Context, address: str, messages: list[list[bytes]],
                      rng: random.Random) -> None:
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(address)
    for frames in messages:
        with_delimiter = rng.random() < 0.9
        sock.send_multipart(([b""] if with_delimiter else []) + frames)
    sock.close()


def _send_garbage_unix(address: str, messages: list[list[bytes]], rng: random.Random) -> None:
    """Each message framed as the unix transport frames it, some with lying sizes or
    cut short; a connection the server hangs up on is replaced."""
    path = address[len("unix://"):]
    sock = None
    for frames in messages:
        head = struct.pack("<I", len(frames)) + b"".join(struct.pack("<Q", len(f))
                                                         for f in frames)
        data = head + b"".join(frames)
        if rng.random() < 0.1:
            data = data[: rng.randrange(len(data))]  # cut: the server sees the next one
        elif rng.random() < 0.05:
            data = struct.pack("<I", rng.randrange(2**32)) + rng.randbytes(16)
        if sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(2)
            sock.connect(path)
        try:
            sock.sendall(data)
        except OSError:
            sock.close()
            sock = None
    if sock is not None:
        sock.close()


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_servers_keep_serving_through_random_and_truncated_frames(transport):
    stream = start_local(storage_units=1, transport=transport)
    ctx = zmq.Context()
    try:
        rng = random.Random(1234)
        ctrl = stream.address
        unit = stream.connection.controller().units()[0].address
        assert ctrl.startswith(f"{transport}://") and unit.startswith(f"{transport}://")
        targets = {ctrl: ["reserve", "commit", "get_meta", "ack", "lookup", "clear",
                          "register_task", "stats", "attach_units", "load_state_dict"],
                   unit: ["put", "get", "free", "drop", "layout", "nbytes", "ping"]}
        for address, methods in targets.items():
            messages = [_garbage(rng, methods) for _ in range(300)]
            if transport == "unix":
                _send_garbage_unix(address, messages, rng)
            else:
                _send_garbage_zmq(ctx, address, messages, rng)
        keys = [f"z_{i}" for i in range(4)]  # both servers still answer valid calls
        stream.writer("after").put(keys, {"x": values(keys)})
        assert torch.equal(stream.kv.get_batch(keys, partition="after")["x"], values(keys))
        with rpc_client(unit, timeout=10) as probe:
            assert probe.call("ping")["pid"] == stream.processes()[1].pid  # unit 0
        assert all(alive(p.pid) for p in stream.processes())
    finally:
        ctx.destroy(linger=0)
        stream.close()
