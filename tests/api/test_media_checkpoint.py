"""Media pins in checkpoints (embedded): handles given out before ``save`` resolve and
release after a restore into a new deployment, whose pins the restored deployment
holds (``"restored from <holder>"`` in stats) until released, handed to rows or
cleared; a controller restarted in its deployment takes the pins as they were."""

from __future__ import annotations

import os

import pytest
import torch

import tq_stream as tq
from tests.api.test_media_refs import N, image_data, name_rows
from tests.controller.test_shared_fields import images
from tq_stream import framefile
from tq_stream.errors import CheckpointError, ConfigError, StateError

P = "agent"


def entries(stream: tq.Stream) -> int:
    return stream.stats()[P]["shared"]["entries"]


@pytest.fixture
def saved(tmp_path):
    """A saved deployment: media ``m0`` (the put's pin), ``m1`` (the put's pin and an
    explicit one), ``m2`` (released before the save); yields (path, refs)."""
    path = str(tmp_path / "ckpt")
    with tq.init(lease_timeout=0.4) as s:
        s.create_partition(P, consumers=["actor"])
        refs = {k: s.media.put(P, k, image_data(images(1, seed=i)[0]))
                for i, k in enumerate(["m0", "m1", "m2"])}
        refs["m1_pin"] = s.media.pin(refs["m1"])
        s.release(refs["m2"])
        s.save(path)
    return path, refs


def test_handles_resolve_and_release_after_a_restore(saved, caplog):
    path, refs = saved
    with caplog.at_level("WARNING", logger="tq_stream.controller.media_pins"), \
            tq.init(restore=path) as s:
        assert "restored 3 media pins of an earlier deployment" in caplog.text
        assert entries(s) == 2
        for i, k in enumerate(["m0", "m1"]):
            assert torch.equal(s.resolve(refs[k])["image"], images(1, seed=i)[0])
        media = s.stats()[P]["media"]
        assert media["entries"] == 2 and media["bytes"] > 0
        (holder, n), = media["pins"].items()
        assert holder.startswith("restored from ") and n == 3
        assert media["bytes_by_holder"] == {holder: media["bytes"]}
        with pytest.raises(StateError, match="released by"):
            s.resolve(refs["m2"])  # released before the save: still refused
        s.release(refs["m0"])
        assert entries(s) == 1
        with pytest.raises(StateError, match="ref must be released once"):
            s.release(refs["m0"])
        s.release(refs["m1"])
        assert entries(s) == 1  # m1's other pin holds it
        assert torch.equal(s.resolve(refs["m1_pin"])["image"], images(1, seed=1)[0])
        s.release(refs["m1_pin"])
        assert entries(s) == 0 and s.stats()[P]["media"] == {
            "entries": 0, "bytes": 0, "pins": {}, "bytes_by_holder": {}}


def test_a_restored_handle_is_handed_to_rows_and_freed_once_they_are_acked(saved):
    path, refs = saved
    with tq.init(restore=path, lease_timeout=0.4) as s:
        s.release(refs["m1"])
        s.release(refs["m1_pin"])
        mine = s.media.pin(refs["m0"])  # a handle of the new deployment on old media
        assert mine.deployment != refs["m0"].deployment
        name_rows(s, refs["m0"])  # the restored producer pin goes to the rows
        s.release(mine)
        assert s.stats()[P]["media"]["pins"] == {}
        c = s.client()
        c.register_task(P, "actor", ["image", "response"], batch_size=N)
        meta = c.get_meta(P, "actor", timeout=5)
        assert all(torch.equal(i, images(1, seed=0)[0])
                   for i in c.get_data(meta, ragged="list")["image"])
        c.ack(meta)
        assert entries(s) == 0
        with pytest.raises(StateError, match="the last row naming it was freed"):
            s.resolve(refs["m0"])


def test_restored_pins_never_lapse_and_clear_frees_them(saved):
    path, refs = saved
    with tq.init(restore=path, lease_timeout=0.4) as s:
        s.writer(P).put("x", {"y": torch.ones(1)})  # sweeps what lapsed: nothing
        assert entries(s) == 2
        s.kv.clear(partition=P)
        assert entries(s) == 0
        with pytest.raises(StateError, match="was freed: it was cleared"):
            s.resolve(refs["m0"])
        s.release(refs["m0"])  # accepted once, as for a live pin


def test_a_restarted_controller_keeps_its_deployment_and_pins():
    """``Controller.load_state_dict`` of its own ``state_dict`` (what a restarted
    controller does): same deployment id, the pins of the same sessions and holders."""
    with tq.init(lease_timeout=60) as s:  # no lapse meanwhile
        ref = s.media.put(P, "m0", image_data(images(1)[0]))
        state = s.connection.controller().state_dict()
        pins = s.stats()[P]["media"]["pins"]
    with tq.init() as fresh:
        ctrl = fresh.connection.controller()
        ctrl.load_state_dict(state)
        place = ctrl.media_lookup(partition=P, key="m0", index=ref.index,
                                  generation=ref.generation, pin=ref.pin,
                                  deployment=ref.deployment, fields=["image"])
        assert place.index.tolist() == [ref.index]
        assert fresh.stats()[P]["media"]["pins"] == pins


def test_a_checkpoint_with_crafted_media_pins_is_refused_and_loads_nothing(saved):
    path, _ = saved
    meta_file = os.path.join(path, "controller.tq")
    meta = framefile.load(meta_file)
    meta["controller"]["media"]["pins"]["row"][0] = 1 << 40  # no such row
    framefile.dump(meta, meta_file)
    with pytest.raises(CheckpointError, match="media pins of a checkpoint must name rows"):
        tq.init(restore=path)
    del meta["controller"]["media"]["pins"]["holder"]
    framefile.dump(meta, meta_file)
    with pytest.raises(CheckpointError, match="must be MediaPins.state_dict's"):
        tq.init(restore=path)


def test_a_checkpoint_without_media_pins_restores_its_media_unpinned(saved):
    """A checkpoint of an earlier version (no ``"media"``): its entries stay until
    cleared, its handles are refused as another deployment's."""
    path, refs = saved
    meta_file = os.path.join(path, "controller.tq")
    meta = framefile.load(meta_file)
    del meta["controller"]["media"]
    framefile.dump(meta, meta_file)
    with tq.init(restore=path) as s:
        assert entries(s) == 2 and s.stats()[P]["media"]["entries"] == 0
        with pytest.raises(ConfigError, match="ref must be a handle of this deployment"):
            s.resolve(refs["m0"])
