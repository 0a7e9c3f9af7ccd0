"""Shared fields in local mode: entries in shared-memory units, read by two consumer
ranks through DataLoader workers, freed in the units once every row naming them is
acked."""

from __future__ import annotations

import pytest
import torch

import tq_stream as tq
from tests.controller.test_shared_fields import images
from tests.helpers.tq_fixtures import local_stream

__all__ = ["local_stream"]

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

G, N = 8, 4  # groups, responses per group


def unit_rows(stream: tq.Stream, partition: str) -> int:
    return sum(u["partitions"].get(partition, {}).get("rows", 0)
               for u in stream.deployment_stats()["units"])


def unit_bytes(stream: tq.Stream, partition: str) -> int:
    return sum(sum(u["partitions"].get(partition, {}).get("fields", {}).values())
               for u in stream.deployment_stats()["units"])


def test_two_ranks_read_shared_images_and_the_units_free_them(local_stream):
    p = "shared_local"
    local_stream.create_partition(p, consumers=["actor"])
    imgs = images(G, seed=7)
    w = local_stream.writer(p)
    uids = [f"p{g}" for g in range(G)]
    w.put_shared(uids, {"image": tq.MultiRagged.from_list(imgs, fixed_dims=(0,)),
                        "prompt": torch.arange(G * 3).reshape(G, 3)})
    assert w.put_shared(uids[:2], {"image": tq.MultiRagged.from_list(imgs[:2],
                                                                       fixed_dims=(0,)),
                                   "prompt": torch.arange(6).reshape(2, 3)}) == []
    keys = [f"p{g}_{j}" for g in range(G) for j in range(N)]
    w.put(keys, {"response": torch.arange(G * N)},
          tags=[{"uid": f"p{g}"} for g in range(G) for _ in range(N)],
          shared=[f"p{g}" for g in range(G) for _ in range(N)])
    local_stream.close_partition(p)
    held = unit_rows(local_stream, p)
    assert held == G + G * N  # one slot per entry and per row
    assert unit_bytes(local_stream, p) > sum(i.numel() for i in imgs)
    assert local_stream.stats()[p]["shared"]["entries"] == G

    seen: dict[str, torch.Tensor] = {}
    for rank in range(2):
        ds = tq.StreamingDataset(local_stream, p, "actor", ["image", "prompt", "response"],
                                 batch_size=N, dp_rank=rank, dp_size=2, ragged="list",
                                 sampler=tq.samplers.GroupSampler(group_size=N), timeout=30)
        for batch in tq.StreamingDataLoader(ds, num_workers=1):
            meta = tq.batch_meta(batch)
            for key, img, prompt in zip(meta.keys, batch["image"], batch["prompt"],
                                        strict=True):
                g = int(key[1:].split("_")[0])
                assert torch.equal(img, imgs[g])
                assert prompt.tolist() == [3 * g, 3 * g + 1, 3 * g + 2]
                seen[key] = img
    assert sorted(seen) == sorted(keys)
    stats = local_stream.stats()[p]
    assert stats["rows"] == 0 and stats["shared"]["entries"] == 0
    assert unit_rows(local_stream, p) == 0
    assert unit_bytes(local_stream, p) == 0


def test_an_indexed_read_across_processes_loads_each_entry_once(local_stream):
    p = "shared_index"
    imgs = images(2, seed=8)
    w = local_stream.writer(p)
    w.put_shared(["a", "b"], {"image": tq.MultiRagged.from_list(imgs, fixed_dims=(0,))})
    w.put(["a0", "b0", "a1"], {"r": torch.arange(3)}, shared=["a", "b", "a"])
    td = local_stream.kv.get_batch(["a0", "b0", "a1"], fields=["image", "r"], partition=p,
                                   ragged="list", shared="index")
    assert td["image_index"].tolist() == [0, 1, 0]
    assert [tuple(x.shape) for x in td["image"]] == [tuple(i.shape) for i in imgs]
    assert all(torch.equal(x, i) for x, i in zip(td["image"], imgs, strict=True))


def test_a_loader_worker_hands_over_an_indexed_batch(local_stream):
    p = "shared_index_loader"
    imgs = images(2, seed=9)
    w = local_stream.writer(p)
    w.put_shared(["a", "b"], {"image": tq.MultiRagged.from_list(imgs, fixed_dims=(0,))})
    w.put(["a0", "a1", "b0", "b1"], {"r": torch.arange(4)},
          tags=[{"uid": u} for u in "aabb"], shared=["a", "a", "b", "b"])
    local_stream.close_partition(p)
    ds = tq.StreamingDataset(local_stream, p, "actor", ["image", "r"], batch_size=4,
                             ragged="list", shared="index", timeout=30)
    (batch,) = list(tq.StreamingDataLoader(ds, num_workers=1))
    index = batch["image_index"].tolist()
    assert len(batch["image"]) == 2 and sorted(set(index)) == [0, 1]
    for key, i in zip(tq.batch_meta(batch).keys, index, strict=True):
        assert torch.equal(batch["image"][i], imgs["ab".index(key[0])])

