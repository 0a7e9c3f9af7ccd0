"""Memory budget and spilling in embedded mode (``backends/spill.py``): cold fields live
on disk and read back equal, a put past the budget waits within its timeout for acks
to free room, then fails loudly; spill files go with the deployment."""

from __future__ import annotations

import glob
import os
import threading
import urllib.request

import pytest
import torch

import tq_stream as tq
from tests.conftest import keys_of
from tq_stream.errors import ConfigError, MemoryBudgetExceeded, MemoryBudgetTooSmall

P = "train"
ROW = 4096  # floats per image row: 16 KiB


def images(n: int, base: int = 0) -> torch.Tensor:
    return torch.arange(base * ROW, (base + n) * ROW, dtype=torch.float32).reshape(n, ROW)


def unit_part(stream: tq.Stream) -> dict:
    return stream.deployment_stats()["units"][0]["partitions"].get(P, {})


def test_cold_fields_go_to_disk_and_read_back_equal(tmp_path):
    with tq.init(spill_dir=str(tmp_path)) as stream:
        stream.create_partition(P, memory_budget=1 << 20, cold=["image"])
        keys = keys_of("k", 64)  # 1 MiB of images: past the budget, all on disk
        stream.writer(P).put(keys, {"image": images(64), "reward": torch.ones(64)})
        part = unit_part(stream)
        assert set(part["fields"]) == {"reward"} and part["spilled"] >= 64 * ROW * 4
        assert part["budget"] == 1 << 20
        assert glob.glob(str(tmp_path / "tq_spill_*" / "*.col"))
        got = stream.kv.get(keys[37], partition=P)
        assert torch.equal(got["image"], images(1, 37)[0])
        loader = tq.StreamingDataLoader(tq.StreamingDataset(
            stream, P, "t", ["image", "reward"], batch_size=16, timeout=5))
        stream.close_partition(P)
        seen = torch.cat([b["image"] for b in loader])
        assert torch.equal(seen.sort(0).values, images(64).sort(0).values)
    assert not glob.glob(str(tmp_path / "tq_spill_*"))  # removed on close


def test_mark_cold_moves_rows_already_in_memory():
    with tq.init() as stream:
        stream.create_partition(P)
        keys = keys_of("k", 8)
        stream.writer(P).put(keys, {"prompt": images(8), "x": torch.ones(8)})
        stream.mark_cold(P, ["prompt"])
        assert set(unit_part(stream)["fields"]) == {"x"}
        assert torch.equal(stream.kv.get(keys[3], partition=P)["prompt"], images(1, 3)[0])


def test_a_put_past_the_budget_fails_after_its_timeout_naming_the_budget():
    with tq.init() as stream:
        stream.create_partition(P, memory_budget=256 << 10)
        with pytest.raises(MemoryBudgetExceeded, match="memory_budget of partition 'train'"):
            stream.writer(P).put(keys_of("k", 32), {"image": images(32)}, timeout=0.5)
        assert stream.stats()[P]["rows"] == 0  # nothing of it is visible
        stream.writer(P).put(keys_of("k", 2), {"image": images(2)})  # what fits is taken


def test_a_put_past_the_budget_waits_for_acks_to_free_room():
    with tq.init() as stream:
        # 16 rows fit (a slab holds 16 rows at first); 32 do not
        stream.create_partition(P, memory_budget=ROW * 4 * 16 + 1024, consumers=["t"])
        writer = stream.writer(P)
        writer.put(keys_of("a", 16), {"image": images(16)})
        loader = tq.StreamingDataLoader(tq.StreamingDataset(
            stream, P, "t", ["image"], batch_size=16, timeout=10))
        done = threading.Event()

        def consume() -> None:
            for _ in loader:  # acked when the next is asked for, or at break
                break
            done.set()

        thread = threading.Thread(target=consume)
        thread.start()
        writer.put(keys_of("b", 16), {"image": images(16, 16)}, timeout=10)  # waits
        thread.join(10)
        assert done.is_set()
        assert torch.equal(stream.kv.get("b3", partition=P)["image"], images(1, 19)[0])
        memory = sum(unit_part(stream)["fields"].values())
        assert memory <= ROW * 4 * 16 + 1024


def test_a_put_that_can_never_fit_fails_at_once_naming_budget_and_need():
    with tq.init() as stream:
        stream.create_partition(P, memory_budget=16 * 4096)  # 64 KiB; the put needs 1 MiB
        with pytest.raises(MemoryBudgetTooSmall) as info:
            stream.writer(P).put(keys_of("k", 64), {"image": images(64)}, timeout=30)
        message = str(info.value)
        assert "memory_budget of partition 'train' is 65536" in message
        assert f"{64 * ROW * 4} bytes" in message and "never fit" in message
        assert stream.stats()[P]["rows"] == 0
        stream.writer(P).put(keys_of("k", 1), {"x": torch.ones(1, 4)})  # 16 rows fit


def test_a_one_row_put_below_what_16_rows_need_says_so():
    with tq.init() as stream:
        stream.create_partition(P, memory_budget=4096)  # 16 rows of 16 KiB do not fit
        with pytest.raises(MemoryBudgetTooSmall, match="at least 16 rows"):
            stream.writer(P).put(keys_of("k", 1), {"image": images(1)}, timeout=30)


def test_the_budget_message_tells_live_rows_from_room_reserved():
    with tq.init() as stream:
        stream.create_partition(P, memory_budget=ROW * 4 * 16 + 1024)
        writer = stream.writer(P)
        writer.put(keys_of("a", 2), {"image": images(2)})  # a 16-row store, 2 rows live
        with pytest.raises(MemoryBudgetExceeded) as info:  # 18 rows: the store must double
            writer.put(keys_of("b", 16), {"image": images(16)}, timeout=0.3)
        assert not isinstance(info.value, MemoryBudgetTooSmall)  # it could fit after acks
        assert (f"take {ROW * 4 * 16} ({ROW * 4 * 2} held by live rows, "
                f"{ROW * 4 * 14} room reserved") in str(info.value)


def test_a_put_paused_by_the_budget_counts_in_blocked_seconds_and_metrics():
    parser = pytest.importorskip("prometheus_client.parser")
    with tq.init(metrics_port=0) as stream:
        stream.create_partition(P, memory_budget=ROW * 4 * 16 + 1024)
        writer = stream.writer(P)
        writer.put(keys_of("a", 16), {"image": images(16)})
        with pytest.raises(MemoryBudgetExceeded):  # puts again at least once, 0.2 s apart
            writer.put(keys_of("b", 16), {"image": images(16)}, timeout=1.0)
        waits = stream.stats()[P]["blocked_seconds"]
        assert waits["memory_budget"] > 0 and waits["capacity"] == 0
        text = urllib.request.urlopen(f"http://{stream.metrics_endpoint}/metrics",
                                      timeout=10).read().decode()
    samples = {tuple(sorted(s.labels.items())): s.value
               for fam in parser.text_string_to_metric_families(text) for s in fam.samples
               if s.name == "tq_stream_writer_blocked_seconds_total"}
    assert samples[(("partition", P), ("reason", "memory_budget"))] == waits["memory_budget"]


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"memory_budget": 0}, "memory_budget"), ({"memory_budget": "1GB"}, "memory_budget"),
    ({"memory_budget": 10}, "memory_budget must be a number of bytes of at least 4096"),
    ({"cold": "image"}, "cold"), ({"cold": [3]}, "cold")])
def test_bad_settings_name_their_argument(kwargs, name):
    with tq.init() as stream, pytest.raises(ConfigError, match=name):
        stream.create_partition(P, **kwargs)


def test_a_bad_spill_dir_names_it(tmp_path):
    afile = tmp_path / "f"
    afile.write_text("")
    with pytest.raises(ConfigError, match="spill_dir"):
        tq.init(spill_dir=str(afile))
    with pytest.raises(ConfigError, match="spill_dir"):
        tq.init(spill_dir="relative/dir")
    assert os.path.exists(afile)


def test_a_checkpoint_keeps_the_budget_and_cold_fields(tmp_path):
    path = str(tmp_path / "ckpt")
    keys = keys_of("k", 8)
    with tq.init() as stream:
        stream.create_partition(P, memory_budget=1 << 20, cold=["image"],
                                consumers=["gen", "train"])
        stream.writer(P).put(keys, {"image": images(8), "x": torch.ones(8),
                                    "prompt": images(8, 8)})
        stream.save(path)
    with tq.init(restore=path) as stream:
        part = unit_part(stream)
        assert part["budget"] == 1 << 20 and set(part["fields"]) == {"x", "prompt"}
        assert torch.equal(stream.kv.get(keys[6], partition=P)["image"], images(1, 6)[0])
        loader_of(stream, "train", ["x"]).dataset.register()
        read_all(stream, "gen", ["prompt"], 1)  # the restored controller still hints
        assert set(unit_part(stream)["fields"]) == {"x"}


def loader_of(stream: tq.Stream, task: str, fields: list[str]) -> tq.StreamingDataLoader:
    return tq.StreamingDataLoader(tq.StreamingDataset(
        stream, P, task, fields, batch_size=8, timeout=5))


def read_all(stream: tq.Stream, task: str, fields: list[str], n_batches: int) -> list:
    loader = loader_of(stream, task, fields)
    out = []
    for i, batch in enumerate(loader):
        out.append(batch)
        if i == n_batches - 1:
            break  # acks the last batch too
    return out


def test_fields_every_declared_reader_finished_spill_and_read_back(tmp_path):
    with tq.init(spill_dir=str(tmp_path)) as stream:
        stream.create_partition(P, consumers=["gen", "train"], memory_budget=64 << 20)
        keys = keys_of("k", 32)
        stream.writer(P).put(keys, {"prompt": images(32), "response": images(32, 100)})
        loader_of(stream, "train", ["response"]).dataset.register()  # reads no prompt
        read_all(stream, "gen", ["prompt"], 4)  # gen is done with every prompt
        part = unit_part(stream)
        assert set(part["fields"]) == {"response"}  # prompt's store went
        assert part["spilled"] >= 32 * ROW * 4
        assert torch.equal(stream.kv.get(keys[5], partition=P)["prompt"], images(1, 5)[0])
        read_all(stream, "train", ["response"], 4)  # every row done: freed, files gone
        assert unit_part(stream) == {}
        assert not glob.glob(str(tmp_path / "tq_spill_*" / "*.col"))


def test_a_field_another_reader_still_needs_stays_in_memory():
    with tq.init() as stream:
        stream.create_partition(P, consumers=["gen", "score", "train"],
                                memory_budget=64 << 20)
        keys = keys_of("k", 16)
        stream.writer(P).put(keys, {"prompt": images(16), "response": images(16, 50)})
        loader_of(stream, "score", ["prompt", "response"]).dataset.register()
        loader_of(stream, "train", ["response"]).dataset.register()
        read_all(stream, "gen", ["prompt"], 2)  # score reads prompt too: it stays
        assert set(unit_part(stream)["fields"]) == {"prompt", "response"}
        read_all(stream, "score", ["prompt", "response"], 2)  # now prompt may go;
        assert set(unit_part(stream)["fields"]) == {"response"}  # train reads response
        got = stream.kv.get(keys[9], partition=P)
        assert torch.equal(got["prompt"], images(1, 9)[0])
        assert torch.equal(got["response"], images(1, 59)[0])


def test_without_a_budget_nothing_spills():
    with tq.init() as stream:
        stream.create_partition(P, consumers=["gen", "train"])
        stream.writer(P).put(keys_of("k", 8), {"prompt": images(8), "x": torch.ones(8)})
        loader_of(stream, "train", ["x"]).dataset.register()
        read_all(stream, "gen", ["prompt"], 1)
        assert unit_part(stream)["spilled"] == 0


def test_a_field_half_spilled_reads_back_in_order():
    with tq.init() as stream:
        stream.create_partition(P, consumers=["gen", "train"], memory_budget=64 << 20)
        keys = keys_of("k", 32)
        stream.writer(P).put(keys, {"prompt": images(32), "x": torch.ones(32)})
        loader_of(stream, "train", ["x"]).dataset.register()
        read_all(stream, "gen", ["prompt"], 2)  # half the prompts done
        part = unit_part(stream)
        assert "prompt" in part["fields"] and part["spilled"] >= 16 * ROW * 4
        got = stream.kv.get_batch(keys[::-1], partition=P)["prompt"]
        assert torch.equal(got, images(32).flip(0))


def test_a_restore_keeps_spilled_rows_on_disk(tmp_path):
    path = str(tmp_path / "ckpt")
    with tq.init() as stream:
        stream.create_partition(P, consumers=["gen", "train"], memory_budget=2 << 20)
        keys = keys_of("k", 64)
        for i in range(0, 64, 16):
            stream.writer(P).put(keys[i:i + 16], {"prompt": images(16, i),
                                                  "x": torch.ones(16)})
        loader_of(stream, "train", ["x"]).dataset.register()
        read_all(stream, "gen", ["prompt"], 8)
        assert set(unit_part(stream)["fields"]) == {"x"}
        stream.save(path)
    with tq.init(restore=path) as stream:  # the prompts stay on disk
        part = unit_part(stream)
        assert set(part["fields"]) == {"x"} and part["spilled"] >= 64 * ROW * 4
        got = stream.kv.get_batch(keys, partition=P)["prompt"]
        assert torch.equal(got, images(64))
