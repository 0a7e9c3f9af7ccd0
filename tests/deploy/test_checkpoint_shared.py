"""A save while shared entries and rows naming them are being written restores a
consistent state: rows only with their entries' bytes, no put in flight at the save,
no entry freed during the save (embedded; tests/integration/deploy has local mode)."""

from __future__ import annotations

import torch

import tq_stream as tq
from tests.helpers.shared_checkpoint_cases import P, image, image_col, save_while_groups_stream
from tq_stream.backends.base import occupancy
from tq_stream.connection import placement
from tq_stream.controller.shared_entries import entry_key
from tq_stream.convert import schemas_of
from tq_stream.deploy import snapshot

RESP = {"response": torch.ones(2, 3)}


def committed_group(stream: tq.Stream, g: int) -> list[str]:
    w = stream.writer(P)
    w.put_shared(f"g{g}", {"image": image_col(g)})
    keys = [f"g{g}_{j}" for j in range(2)]
    w.put(keys, RESP, shared=[f"g{g}"] * 2)
    return keys


def check_only(stream: tq.Stream, keys: list[str], entries: int) -> None:
    """The restored partition holds exactly ``keys``, readable, and ``entries``."""
    rows = stream.kv.list(partition=P)
    assert [r["key"] for r in rows] == keys
    got = stream.kv.get_batch(keys, ["image"], partition=P, ragged="list")["image"]
    assert all(torch.equal(x, image(int(k[1]))) for k, x in zip(keys, got, strict=True))
    shared = stream.stats()[P]["shared"]
    assert (stream.stats()[P]["rows"], shared["entries"], shared["refs"]) == \
        (len(keys), entries, len(keys))


def test_rows_written_but_not_committed_at_the_save_are_not_restored(tmp_path):
    with tq.init() as stream:
        keys = committed_group(stream, 0)
        stream.writer(P).put_shared("g1", {"image": image_col(1)})
        ctrl = stream.connection.controller()  # a put of rows naming g1, bytes stored
        place = ctrl.reserve(P, ["g1_0", "g1_1"], schemas_of(RESP))
        placement.store(stream.connection.units(), P, place.unit, place.slot, RESP,
                        occupancy(place.index, place.generation))
        stream.save(str(tmp_path / "c"))
    with tq.init(restore=str(tmp_path / "c")) as stream:
        check_only(stream, keys, 2)  # g1 was committed: kept, and rows may name it now
        stream.writer(P).put(["g1_0"], {"response": torch.ones(1, 3)}, shared=["g1"])
        assert torch.equal(stream.kv.get("g1_0", partition=P)["image"], image(1))


def test_an_entry_claimed_but_not_committed_at_the_save_is_not_restored(tmp_path):
    with tq.init() as stream:
        keys = committed_group(stream, 0)
        schemas = schemas_of({"image": image_col(1)})
        stream.connection.controller().reserve_shared(
            P, ["g1"], schemas, digests=[{"image": "d" * 32}], nbytes=[10])
        stream.save(str(tmp_path / "c"))
    with tq.init(restore=str(tmp_path / "c")) as stream:
        check_only(stream, keys, 1)
        other = image(1) + 1  # its claim went with it: other bytes go in
        assert stream.writer(P).put_shared("g1", {"image": other}) == ["g1"]


def test_an_entry_reserved_before_its_claim_is_never_restored_as_a_row(tmp_path):
    with tq.init() as stream:
        keys = committed_group(stream, 0)
        stream.connection.controller().reserve(P, [entry_key("g1")],
                                               schemas_of({"image": image_col(1)}))
        stream.save(str(tmp_path / "c"))
    with tq.init(restore=str(tmp_path / "c")) as stream:
        check_only(stream, keys, 1)


class AckFirst:
    """A unit whose checkpoint copy starts after ``ack`` ran (once, for all units)."""

    def __init__(self, unit: object, ack: list) -> None:
        self._unit, self._ack = unit, ack

    def save_rows(self, request: dict) -> dict:
        while self._ack:
            self._ack.pop()()
        return self._unit.save_rows(request)


def test_an_entry_freed_with_its_rows_during_the_save_goes_with_them(tmp_path):
    with tq.init() as stream:
        stream.create_partition(P, consumers=["a"])
        freed = committed_group(stream, 0)
        keys = committed_group(stream, 1)
        client = stream.client()
        client.register_task(P, "a", ["response"], batch_size=2)
        meta = client.get_meta(P, "a")
        assert list(meta.keys) == freed
        units = [AckFirst(u, [lambda: client.ack(meta)]) for u in stream.connection.units()]
        snapshot.save(str(tmp_path / "c"), stream.connection.controller(), units)
        assert stream.stats()[P]["shared"]["entries"] == 1  # g0 went with its rows
    with tq.init(restore=str(tmp_path / "c")) as stream:
        check_only(stream, keys, 1)


def test_saves_while_groups_stream_restore_consistent_states(tmp_path):
    with tq.init() as stream:
        assert save_while_groups_stream(stream, str(tmp_path),
                                        lambda p: tq.init(restore=p)) > 0
