"""Media by reference in local mode: a handle pickled to a spawned process that
resolves it (views of the unit's shared memory from the first read on), and the media
freed in the units after an explicit release, after the rows naming it are acked, and
after the producer process is SIGKILLed and its session's lease lapses."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time

import pytest
import torch

import tq_stream as tq
from tests.controller.test_shared_fields import images
from tests.helpers.fault_kit import CONFIG, check_no_leftovers, faulty_local, wait_until
from tests.helpers.media_workers import image_data, put_and_hang, resolve
from tests.helpers.tq_fixtures import kill, local_stream, wait_gone
from tq_stream.errors import StateError

__all__ = ["local_stream"]

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
N = 4
CTX = mp.get_context("spawn")


def unit_rows(stream: tq.Stream, partition: str) -> int:
    return sum(u["partitions"].get(partition, {}).get("rows", 0)
               for u in stream.deployment_stats()["units"])


def resolve_in_child(ref: tq.MediaRef) -> dict:
    recv, send = CTX.Pipe(duplex=False)
    child = CTX.Process(target=resolve, args=(ref, send))
    child.start()
    try:
        assert recv.poll(60), "the child never resolved the handle"
        got = recv.recv()
        data, shape = got["image"]
        got["image"] = torch.frombuffer(bytearray(data), dtype=torch.uint8).reshape(shape)
        return got
    finally:
        child.join(30)
        assert child.exitcode == 0


def test_a_spawned_process_resolves_a_handle_and_release_frees_it(local_stream):
    p = "media_release"
    img = images(1, seed=3)[0]
    ref = local_stream.media.put(p, "m0", image_data(img))
    got = resolve_in_child(ref)
    assert torch.equal(got["image"], img)
    # the first resolve too: a view of the unit's shared memory, never a copy
    assert got["shm"] == [True] * 3 and len(set(got["ptrs"])) == 1
    assert unit_rows(local_stream, p) == 1
    local_stream.release(ref)
    assert unit_rows(local_stream, p) == 0
    assert local_stream.stats()[p]["shared"]["entries"] == 0
    with pytest.raises(StateError, match="released by"):
        local_stream.resolve(ref)


def test_media_named_by_rows_is_freed_once_they_are_acked(local_stream):
    p = "media_ack"
    local_stream.create_partition(p, consumers=["actor"])
    img = images(1, seed=4)[0]
    ref = local_stream.media.put(p, "g0", image_data(img))
    assert torch.equal(resolve_in_child(ref)["image"], img)  # the inference server
    keys = [f"g0_{j}" for j in range(N)]
    local_stream.writer(p).put(keys, {"response": torch.arange(N)},
                               tags=[{"uid": "g0"}] * N, shared=["g0"] * N)
    c = local_stream.client()
    c.register_task(p, "actor", ["image", "response"], batch_size=N)
    meta = c.get_meta(p, "actor", timeout=30)
    assert all(torch.equal(i, img) for i in c.get_data(meta, ragged="list")["image"])
    c.ack(meta)
    assert unit_rows(local_stream, p) == 0
    with pytest.raises(StateError, match="the last row naming it was freed"):
        local_stream.resolve(ref)


def test_media_of_a_killed_producer_is_freed_when_its_lease_lapses(local_stream):
    p = "media_killed"
    img = images(1, seed=5)[0]
    recv, send = CTX.Pipe(duplex=False)
    child = CTX.Process(target=put_and_hang, args=(local_stream.address, p, img, 0.5, send))
    child.start()
    try:
        assert recv.poll(60), "the producer never put its media"
        ref = recv.recv()
        time.sleep(1.5)  # three leases: the live producer's heartbeat renews its pin
        assert torch.equal(local_stream.resolve(ref)["image"], img)
        media = local_stream.stats()[p]["media"]
        producer = f"{socket.gethostname()}:{child.pid}"
        assert media["pins"] == {producer: 1}  # held by the producer
        assert media["bytes_by_holder"] == {producer: media["bytes"]} and media["bytes"] > 0
    finally:
        kill(child.pid)
        child.join(10)
    assert wait_gone([child.pid], 10) == []
    deadline = time.monotonic() + 30
    while True:
        try:
            local_stream.resolve(ref)
        except StateError as exc:
            assert "stopped renewing its lease of 0.5 s" in str(exc)
            break
        assert time.monotonic() < deadline, "media of a killed producer was never freed"
        time.sleep(0.2)
    assert unit_rows(local_stream, p) == 0
    assert local_stream.stats()[p]["media"] == {"entries": 0, "bytes": 0, "pins": {},
                                                 "bytes_by_holder": {}}


def test_handles_given_out_before_a_save_resolve_and_release_after_a_restore(
        local_stream, tmp_path):
    p = "media_saved"
    path = str(tmp_path / "ckpt")
    img = images(1, seed=6)[0]
    ref = local_stream.media.put(p, "m0", image_data(img))
    local_stream.save(path)
    with tq.init(mode="local", storage_units=2, restore=path) as restored:
        # the old handle names the old deployment's address: a pin on the restored
        # stream gives one of the new deployment, for other processes
        mine = restored.media.pin(ref)
        assert mine.address == restored.address != ref.address
        got = resolve_in_child(mine)
        assert torch.equal(got["image"], img) and got["shm"] == [True] * 3
        assert torch.equal(restored.resolve(ref)["image"], img)  # the old handle too
        me = f"{socket.gethostname()}:{os.getpid()}"  # put it, and pinned it again
        assert restored.stats()[p]["media"]["pins"] == {f"restored from {me}": 1, me: 1}
        restored.release(ref)
        assert unit_rows(restored, p) == 1  # still pinned by mine
        restored.release(mine)
        assert unit_rows(restored, p) == 0
        with pytest.raises(StateError, match="released by"):
            restored.resolve(ref)
    local_stream.release(ref)


def test_a_restarted_controller_keeps_the_pins_of_its_checkpoint():
    """The controller process killed and restarted from its periodic checkpoint: the
    handle (same deployment) still resolves, its pin is still this process's, renewed
    by its heartbeat, and its release frees the media."""
    stream = faulty_local(checkpoint_interval=0.5, restart_controller=True)
    old = list(stream.owner.pids)
    try:
        p = "media_restart"
        img = images(1, seed=7)[0]
        ref = stream.media.put(p, "m0", image_data(img))
        path = stream.owner.checkpoint_path
        assert wait_until(lambda: os.path.exists(path), 10.0), "no checkpoint written"
        mark = os.stat(path).st_mtime_ns
        assert wait_until(lambda: os.stat(path).st_mtime_ns != mark, 10.0)  # holds the pin
        kill(old[-1])
        assert wait_until(lambda: stream.owner.restarts, 30.0), "no restart"
        time.sleep(3 * CONFIG.lease_timeout)  # the heartbeat renews the pin meanwhile
        assert torch.equal(stream.resolve(ref)["image"], img)
        me = f"{socket.gethostname()}:{os.getpid()}"
        assert stream.stats()[p]["media"]["pins"] == {me: 1}
        stream.release(ref)
        assert unit_rows(stream, p) == 0
    finally:
        check_no_leftovers(stream, old)
