"""Media by reference (embedded): a producer stores media and gets a picklable handle,
another holder resolves it; the media is freed when its pins end and no row names it
(released, handed to rows that are acked or dropped by a filter, a session lapsed),
and a released, freed or foreign handle is refused naming what happened."""

from __future__ import annotations

import dataclasses
import pickle
import time

import pytest
import torch

import tq_stream as tq
from tests.controller.test_shared_fields import images
from tq_stream.connection.connection import Connection
from tq_stream.errors import ClosedError, ConfigError, KeyConflictError, StateError
from tq_stream.media import holder

P = "agent"
N = 4  # responses per group


@pytest.fixture
def stream():
    s = tq.init(lease_timeout=0.4)
    yield s
    s.close()


def image_data(img: torch.Tensor) -> dict:
    return {"image": tq.MultiRagged.from_list([img], fixed_dims=(0,)),
            "prompt": torch.tensor([1, 2, 3])}


def entries(stream: tq.Stream) -> int:
    return stream.stats()[P]["shared"]["entries"]


def name_rows(stream: tq.Stream, ref: tq.MediaRef, reward: float | None = None) -> list[str]:
    keys = [f"{ref.key}_{j}" for j in range(N)]
    tags = [{"uid": ref.key, "reward": float(j) if reward is None else reward}
            for j in range(N)]
    stream.writer(P).put(keys, {"response": torch.arange(N)}, tags=tags,
                         shared=[ref.key] * N)
    return keys


def test_a_handle_pickles_resolves_and_shows_in_stats(stream):
    img = images(1)[0]
    ref = stream.media.put(P, "m0", image_data(img))
    assert isinstance(ref, tq.MediaRef) and set(ref.fields) == {"image", "prompt"}
    again = pickle.loads(pickle.dumps(ref))
    assert again == ref and tq.MediaRef.from_dict(ref.to_dict()) == ref
    got = stream.resolve(again)
    assert torch.equal(got["image"], img) and got["prompt"].tolist() == [1, 2, 3]
    assert stream.resolve(ref, ["image"]).keys() == {"image"}
    media = stream.stats()[P]["media"]
    assert media["entries"] == 1 and media["bytes"] >= img.numel()
    assert media["pins"] == {holder(): 1}  # this process ("host:pid")
    assert media["bytes_by_holder"] == {holder(): media["bytes"]}
    assert entries(stream) == 1


def test_release_frees_media_and_a_released_handle_is_refused(stream):
    ref = stream.media.put(P, "m0", image_data(images(1)[0]))
    stream.release(ref)
    assert entries(stream) == 0
    assert stream.stats()[P]["media"] == {"entries": 0, "bytes": 0, "pins": {},
                                                 "bytes_by_holder": {}}
    with pytest.raises(StateError, match="released by .*:"):
        stream.resolve(ref)
    with pytest.raises(StateError, match="ref must be released once.*released by"):
        stream.release(ref)


def test_rows_naming_media_take_it_over_and_free_it_once_acked(stream):
    stream.create_partition(P, consumers=["actor"])
    img = images(1)[0]
    ref = stream.media.put(P, "g0", image_data(img))
    name_rows(stream, ref)
    assert stream.stats()[P]["media"]["pins"] == {}  # handed to the rows
    assert torch.equal(stream.resolve(ref)["image"], img)  # the rows hold it
    c = stream.client()
    c.register_task(P, "actor", ["image", "response"], batch_size=N)
    meta = c.get_meta(P, "actor", timeout=5)
    assert all(torch.equal(i, img) for i in c.get_data(meta, ragged="list")["image"])
    c.ack(meta)
    assert entries(stream) == 0
    with pytest.raises(StateError, match="was freed: the last row naming it was freed"):
        stream.resolve(ref)
    stream.release(ref)  # the producer's own release after the hand-over: accepted once
    with pytest.raises(StateError, match="released once"):
        stream.release(ref)


def test_a_pin_keeps_media_after_its_rows_are_acked_until_released(stream):
    stream.create_partition(P, consumers=["actor"])
    img = images(1)[0]
    ref = stream.media.put(P, "g0", image_data(img))
    server_ref = stream.media.pin(ref)
    assert server_ref.pin != ref.pin
    name_rows(stream, ref)
    c = stream.client()
    c.register_task(P, "actor", ["response"], batch_size=N)
    c.ack(c.get_meta(P, "actor", timeout=5))
    assert entries(stream) == 1 and list(stream.stats()[P]["media"]["pins"].values()) == [1]
    assert torch.equal(stream.resolve(server_ref)["image"], img)
    stream.release(server_ref)
    assert entries(stream) == 0
    with pytest.raises(StateError, match="released by"):
        stream.resolve(server_ref)


def test_a_group_dropped_by_a_filter_releases_its_media(stream):
    stream.create_partition(P, consumers=["actor"])
    flat = stream.media.put(P, "flat", image_data(images(1)[0]))
    kept = stream.media.put(P, "kept", image_data(images(1, seed=1)[0]))
    name_rows(stream, flat, reward=1.0)  # zero variance: dropped
    name_rows(stream, kept)
    sampler = tq.samplers.DynamicFilterSampler(tq.samplers.GroupSampler(group_size=N))
    c = stream.client()
    c.register_task(P, "actor", ["image", "response"], batch_size=N, sampler=sampler)
    meta = c.get_meta(P, "actor", timeout=5)
    assert {t["uid"] for t in meta.tags} == {"kept"}
    assert stream.stats()[P]["tasks"]["actor"]["discarded"]["zero_variance"] == N
    assert entries(stream) == 1
    with pytest.raises(StateError, match="was freed: the last row naming it"):
        stream.resolve(flat)
    c.ack(meta)
    assert entries(stream) == 0


def test_media_of_a_session_that_stops_renewing_is_freed(stream):
    producer = tq.Stream(Connection(stream.connection.backend, stream.config, "embedded"))
    ref = producer.media.put(P, "m0", image_data(images(1)[0]))
    named = producer.media.put(P, "m1", image_data(images(1, seed=2)[0]))
    name_rows(stream, named)  # rows hold it: the lapse does not free it
    producer.connection.keeper().stop()  # the producer died: its heartbeat stops
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            stream.resolve(ref)
        except StateError as exc:
            assert "stopped renewing its lease" in str(exc)
            break
        time.sleep(0.1)
    else:
        pytest.fail("media of a dead session was never released")
    assert entries(stream) == 1
    assert stream.resolve(named)["prompt"].tolist() == [1, 2, 3]


def test_a_live_session_keeps_its_media(stream):
    ref = stream.media.put(P, "m0", image_data(images(1)[0]))
    time.sleep(1.2)  # three leases: the heartbeat renews the pin
    assert stream.resolve(ref)["prompt"].tolist() == [1, 2, 3]


def test_a_handle_of_another_deployment_or_no_handle_is_refused(stream):
    ref = stream.media.put(P, "m0", image_data(images(1)[0]))
    with tq.init() as other:
        other.media.put(P, "m0", image_data(images(1)[0]))
        with pytest.raises(ConfigError, match="ref must be a handle of this deployment"):
            other.resolve(ref)
        with pytest.raises(ConfigError, match="ref must be a MediaRef"):
            other.resolve(ref.to_dict())  # type: ignore[arg-type]
    with pytest.raises(KeyConflictError, match="ref must name media put"):
        stream.media.pin(tq.MediaRef(P, "nope", ("image",), 0, 0, "x", ref.deployment))
    with pytest.raises(ConfigError, match="ref must be a MediaRef's dict"):
        tq.MediaRef.from_dict({"key": "m0"})


def test_an_embedded_handle_used_in_another_process_is_refused_naming_both(stream):
    """An embedded deployment lives in its process: its handles carry that process
    (``embedded://host:pid``) and another process is told so, instead of joining
    whatever deployment ``tq.connect`` finds by name."""
    ref = stream.media.put(P, "m0", image_data(images(1)[0]))
    assert ref.address == f"embedded://{holder()}"
    moved = dataclasses.replace(pickle.loads(pickle.dumps(ref)),
                                address="embedded://otherhost:1")  # as another process sees it
    for call in (stream.resolve, stream.media.pin, stream.release):
        with pytest.raises(ConfigError, match=r"otherhost:1\), got it in .*mode='local' or 'ray'"):
            call(moved)
    with pytest.raises(ConfigError, match="address must be a local or Ray deployment's"):
        tq.connect(ref.address)
    assert stream.stats()[P]["media"]["pins"] == {holder(): 1}  # nothing changed


def test_a_cleared_partition_frees_pinned_media_and_says_so(stream):
    ref = stream.media.put(P, "m0", image_data(images(1)[0]))
    stream.kv.clear(partition=P)
    assert entries(stream) == 0 and stream.stats()[P]["media"]["entries"] == 0
    with pytest.raises(StateError, match="was freed: it was cleared"):
        stream.resolve(ref)
    stream.release(ref)  # the pin of cleared media ends quietly, once
    with pytest.raises(StateError, match="released once"):
        stream.release(ref)


def test_an_old_handle_does_not_resolve_media_put_again_under_its_key(stream):
    old = stream.media.put(P, "m0", image_data(images(1)[0]))
    stream.release(old)
    new = stream.media.put(P, "m0", image_data(images(1, seed=9)[0]))
    assert new.generation != old.generation or new.pin != old.pin
    assert torch.equal(stream.resolve(new)["image"], images(1, seed=9)[0])
    with pytest.raises(StateError, match="released by"):
        stream.resolve(old)


def test_a_handle_of_freed_media_never_resolves_media_put_later_under_its_key(stream):
    stream.create_partition(P, consumers=["actor"])
    old = stream.media.put(P, "g0", image_data(images(1)[0]))
    keep = stream.media.put(P, "other", image_data(images(1, seed=3)[0]))  # takes a row
    name_rows(stream, old)
    c = stream.client()
    c.register_task(P, "actor", ["response"], batch_size=N)
    c.ack(c.get_meta(P, "actor", timeout=5))  # old's media freed with its rows
    new = stream.media.put(P, "g0", image_data(images(1, seed=9)[0]))
    assert torch.equal(stream.resolve(new)["image"], images(1, seed=9)[0])
    with pytest.raises(StateError, match="was freed: the last row naming it"):
        stream.resolve(old)
    stream.release(keep)


def test_media_whose_producer_dies_between_its_put_and_its_hold_is_freed(stream):
    producer = tq.Stream(Connection(stream.connection.backend, stream.config, "embedded"))
    conn = producer.connection
    session = conn.keeper().producer_session(P, conn.config.lease_timeout)
    conn.controller().media_hold(partition=P, keys=["m0"], session=session, holder="dying",
                                 lease=0.4, producer=True, pending=5.0)  # Media.put's first step
    producer.writer(P).put_shared("m0", image_data(images(1)[0]))  # its second
    conn.keeper().stop()  # and it dies before the third (the hold)
    assert entries(stream) == 1
    deadline = time.monotonic() + 10
    while entries(stream) and time.monotonic() < deadline:
        stream.writer(P).put("x", {"y": torch.ones(1)})  # a put sweeps what lapsed
        time.sleep(0.1)
    assert entries(stream) == 0


def test_a_failed_put_leaves_no_pin(stream):
    stream.media.put(P, "m0", image_data(images(1)[0]))
    with pytest.raises(ConfigError, match="written once"):
        stream.media.put(P, "m0", image_data(images(1, seed=1)[0]))  # other bytes
    assert list(stream.stats()[P]["media"]["pins"].values()) == [1]
    with pytest.raises(ConfigError, match="pins must be the live pending pins"):
        stream.connection.controller().media_hold(
            partition=P, keys=["m0"], session="s", holder="h", lease=1.0, producer=True,
            pins=["nope"])


def test_media_put_into_a_closed_partition_names_the_key_as_written(stream):
    """The refusal shows the media key the user gave, not the entry's reserved key."""
    stream.create_partition("closed")
    stream.close_partition("closed")
    with pytest.raises(ClosedError, match=r"""got new keys \["shared 'p1'"\]"""):
        stream.media.put("closed", "p1", {"image": torch.ones(3, 4, 4, dtype=torch.uint8)})
