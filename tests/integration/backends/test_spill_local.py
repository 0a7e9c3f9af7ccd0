"""Memory budget and spilling in local mode: units in their own processes keep a
partition's shared memory within its budget while more than the budget streams through,
cold fields go to the unit's disk and read back equal, spill files go with the
deployment."""

from __future__ import annotations

import glob
import os
import threading
import time

import pytest
import torch

import tq_stream as tq
from tests.helpers.tq_fixtures import segments_of, start_local
from tq_stream.backends.shm import EPOCH, SHM_DIR
from tq_stream.errors import MemoryBudgetTooSmall

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

P = "rollouts"
ROW = 64 << 10  # floats per row: 256 KiB
BUDGET = 8 << 20


def rows(n: int, base: int) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float32)[:, None] + base) * torch.ones(1, ROW)


def shm_bytes(pids: list[int]) -> int:
    """Bytes the units' data segments hold in /dev/shm (pages written, not sizes)."""
    total = 0
    for name in segments_of(pids):
        if f"_{EPOCH}_" not in name:
            try:
                total += os.stat(os.path.join(SHM_DIR, name)).st_blocks * 512
            except FileNotFoundError:
                continue
    return total


def test_a_partition_larger_than_its_budget_streams_through_within_it():
    stream = start_local(storage_units=1)
    pids = list(stream._owner.pids)
    try:
        stream.create_partition(P, memory_budget=BUDGET, consumers=["train"])
        total, batch = 128, 8  # 32 MiB through a budget of 8 MiB
        peak, stop = [0], threading.Event()

        def watch() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], shm_bytes(pids))
                stop.wait(0.005)

        def produce() -> None:
            writer = stream.writer(P)
            for b in range(0, total, batch):
                writer.put([f"k{b + i}" for i in range(batch)], {"x": rows(batch, b)},
                           timeout=60)
            stream.close_partition(P)

        threads = [threading.Thread(target=watch), threading.Thread(target=produce)]
        for t in threads:
            t.start()
        # A slab of 16 rows (4 MiB) fits; growing it to 32 would not: the producer waits
        # (its put made again every 0.2 s) until the loader's acks free rows.
        deadline = time.monotonic() + 30
        while stream.stats()[P]["rows"] < 16 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(1.0)
        assert stream.stats()[P]["rows"] == 16
        loader = tq.StreamingDataLoader(tq.StreamingDataset(
            stream, P, "train", ["x"], batch_size=batch, timeout=60))
        seen = []
        for b in loader:
            x = b["x"]
            assert torch.equal(x, x[:, :1] * torch.ones(1, ROW))  # each row whole
            seen += x[:, 0].tolist()
        stop.set()
        for t in threads:
            t.join(60)
        assert sorted(seen) == list(range(total))
        assert 0 < peak[0] <= BUDGET + (1 << 20), peak[0]  # + tokens and flags
        assert stream.stats()[P]["blocked_seconds"]["memory_budget"] > 0  # it waited 1 s
    finally:
        stream.close()


def test_a_put_that_can_never_fit_fails_across_processes_without_waiting():
    stream = start_local(storage_units=1)
    try:
        stream.create_partition(P, memory_budget=BUDGET)  # 16 rows: 4 MiB; 64 rows: 16
        with pytest.raises(MemoryBudgetTooSmall, match=f"is {BUDGET} bytes, less than"):
            stream.writer(P).put([f"k{i}" for i in range(64)], {"x": rows(64, 0)}, timeout=60)
        assert stream.stats()[P]["blocked_seconds"]["memory_budget"] == 0
        stream.writer(P).put(["a"], {"x": rows(1, 0)})  # what fits is taken
        assert stream.stats()[P]["rows"] == 1
    finally:
        stream.close()


def test_cold_fields_spill_to_the_units_disk_and_go_on_close(tmp_path):
    stream = start_local(storage_units=2, spill_dir=str(tmp_path))
    pids = list(stream._owner.pids)
    try:
        stream.create_partition(P, memory_budget=1 << 20, cold=["image"])
        keys = [f"k{i}" for i in range(48)]  # 12 MiB of images, a budget of 1 MiB
        stream.writer(P).put(keys, {"image": rows(48, 0), "reward": torch.arange(48.0)})
        assert len(glob.glob(str(tmp_path / "tq_spill_*"))) == 2  # one folder per unit
        units = stream.deployment_stats()["units"]
        assert sum(u["partitions"][P]["spilled"] for u in units) >= 48 * ROW * 4
        assert all(set(u["partitions"][P]["fields"]) == {"reward"} for u in units)
        assert shm_bytes(pids) <= 2 << 20
        for k in (0, 17, 47):
            got = stream.kv.get(keys[k], partition=P)
            assert torch.equal(got["image"], rows(1, k)[0]) and got["reward"] == k
        stream.mark_cold(P, ["reward"])
        assert stream.kv.get(keys[5], partition=P)["reward"] == 5
    finally:
        stream.close()
    assert not glob.glob(str(tmp_path / "tq_spill_*"))


def test_spill_files_go_under_the_deployment_s_folder_by_default():
    stream = start_local(storage_units=1)
    try:
        stream.create_partition(P, cold=["image"])
        stream.writer(P).put(["a"], {"image": rows(1, 0)})
        folder = os.path.dirname(stream.address.removeprefix("unix://"))
        assert glob.glob(os.path.join(folder, "tq_spill_*", "*.col"))
    finally:
        stream.close()
    assert not os.path.exists(folder)


def test_fields_every_reader_finished_spill_from_shared_memory():
    stream = start_local(storage_units=1)
    pids = list(stream._owner.pids)
    try:
        stream.create_partition(P, consumers=["gen", "train"], memory_budget=64 << 20)
        keys = [f"k{i}" for i in range(32)]
        stream.writer(P).put(keys, {"prompt": rows(32, 0), "x": torch.arange(32.0)})
        tq.StreamingDataset(stream, P, "train", ["x"], batch_size=8).register()
        before = shm_bytes(pids)
        loader = tq.StreamingDataLoader(tq.StreamingDataset(
            stream, P, "gen", ["prompt"], batch_size=8, timeout=30))
        for i, _ in enumerate(loader):
            if i == 3:
                break  # every prompt read and acked
        part = stream.deployment_stats()["units"][0]["partitions"][P]
        assert set(part["fields"]) == {"x"} and part["spilled"] >= 32 * ROW * 4
        assert shm_bytes(pids) <= before - 32 * ROW * 4
        got = stream.kv.get_batch(keys[::-1], partition=P)
        assert torch.equal(got["prompt"], rows(32, 0).flip(0))
    finally:
        stream.close()


def test_a_same_host_reader_reads_half_spilled_images_and_tensors():
    stream = start_local(storage_units=1)
    try:
        stream.create_partition(P, consumers=["gen", "train"], memory_budget=64 << 20)
        keys = [f"k{i}" for i in range(32)]
        imgs = [torch.full((3, 4 + i % 5, 6), i, dtype=torch.uint8) for i in range(32)]
        dense = torch.arange(32.0)[:, None] * torch.ones(1, 1000)
        stream.writer(P).put(keys, {"d": dense, "x": torch.ones(32),
                                    "img": tq.MultiRagged.from_list(imgs, fixed_dims=(0,))})
        stream.kv.get_batch(keys, partition=P, ragged="list")  # the reader knows the layout
        tq.StreamingDataset(stream, P, "train", ["x"], batch_size=8).register()
        loader = tq.StreamingDataLoader(tq.StreamingDataset(
            stream, P, "gen", ["d", "img"], batch_size=8, timeout=30))
        for i, _ in enumerate(loader):
            if i == 1:
                break  # half the rows' d and img spill, half stay in shared memory
        assert stream.deployment_stats()["units"][0]["partitions"][P]["spilled"] > 0
        got = stream.kv.get_batch(keys[::-1], partition=P, ragged="list")
        assert torch.equal(got.get("d"), dense.flip(0))
        assert all(torch.equal(a, b) for a, b in zip(got.get("img").tolist(), imgs[::-1],
                                                     strict=True))
    finally:
        stream.close()
