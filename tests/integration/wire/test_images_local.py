"""Images and video in local mode: byte-exact through unit processes, and read by a
same-host client as views of the unit's shared memory (no copy)."""

from __future__ import annotations

import pytest
import torch

import tq_stream as tq
from tests.helpers.shm_maps import in_shm
from tests.helpers.tq_fixtures import local_stream
from tests.wire.test_images import images, keys, same, videos

__all__ = ["local_stream"]

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_images_and_video_are_byte_exact_across_processes(local_stream):
    imgs, clips = images(8, seed=10), videos(6, seed=10)
    p = "img_exact"
    w = local_stream.writer(p)
    w.put(keys(8), {"image": tq.MultiRagged.from_list(imgs, fixed_dims=(0,))})
    w.put(keys(6, "v"), {"video": clips})
    got = local_stream.kv.get_batch(keys(8), fields=["image"], partition=p, ragged="list")
    assert same(got.get("image").tolist(), imgs)  # rows of both units, in key order
    nested = local_stream.kv.get_batch(keys(8), fields=["image"], partition=p)["image"]
    assert same(list(nested.unbind()), imgs)
    vid = local_stream.kv.get_batch(keys(6, "v"), fields=["video"], partition=p,
                                    ragged="padded")
    assert vid["video_shape"].tolist() == [list(c.shape) for c in clips]
    for row, clip in zip(vid["video"], clips, strict=True):
        t, c, h, w_ = clip.shape
        assert torch.equal(row[:t, :c, :h, :w_], clip)
    with pytest.raises(tq.errors.SchemaError, match="row 0 of shape \\[1, 5, 5\\]"):
        w.put(["bad"], {"image": [torch.zeros(1, 5, 5, dtype=torch.uint8)]})
    assert same(local_stream.kv.get_batch(keys(8), fields=["image"], partition=p,
                                          ragged="list").get("image").tolist(), imgs)


def test_same_host_reads_are_views_of_shared_memory(local_stream):
    imgs = images(6, seed=11)
    p = "img_views"
    local_stream.writer(p, unit=0).put(keys(6), {"image": imgs})

    def read() -> list[torch.Tensor]:
        return local_stream.kv.get_batch(keys(6), fields=["image"], partition=p,
                                         ragged="list").get("image").tolist()

    first = read()  # views from the first read on: the unit's spans say where rows lie
    assert same(first, imgs)
    assert all(in_shm(r) for r in first), "a first read must be views of the unit's segments"
    again, third = read(), read()
    assert same(again, imgs)
    assert all(in_shm(r) for r in again), "rows must be views of the unit's segments"
    assert [r.data_ptr() for r in again] == [r.data_ptr() for r in third]  # no copy
    sub = local_stream.kv.get_batch(keys(6)[2:4], fields=["image"], partition=p,
                                    ragged="list").get("image").tolist()
    assert same(sub, imgs[2:4]) and sub[0].data_ptr() == again[2].data_ptr()
    # rows out of order: one copy out of shared memory, still exact
    mixed = local_stream.kv.get_batch(["k4", "k1"], fields=["image"], partition=p,
                                      ragged="list").get("image").tolist()
    assert same(mixed, [imgs[4], imgs[1]])
    local_stream.kv.clear(keys(6)[:3], partition=p)
    assert same(again, imgs)  # views of live and freed rows keep their bytes


def test_save_and_restore_keeps_images_in_local_mode(tmp_path):
    imgs = images(4, seed=12)
    path = str(tmp_path / "ckpt")
    with tq.init(mode="local", storage_units=2) as stream:
        stream.writer("p").put(keys(4), {"image": tq.MultiRagged.from_list(imgs, (0,))})
        stream.save(path)
    with tq.init(mode="local", storage_units=2, restore=path) as stream:
        got = stream.kv.get_batch(keys(4), partition="p", ragged="list")
        assert same(got.get("image").tolist(), imgs)
        assert stream.stats()["p"]["fields"]["image"] == "multiragged uint8[3, *, *]"
