"""Shared fields: a group's prompt and image written once under the group's key, named
by each response row, read as the row's own (materialized, or once with an index),
ready only once written, and freed with the last row that names them."""

from __future__ import annotations

import pytest
import torch

import tq_stream as tq
from tq_stream.errors import ConfigError, KeyConflictError, SchemaError, WaitTimeout
from tq_stream.messages.puts import Committed

P = "vlm"
G, N = 3, 4  # groups, responses per group


def images(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(10, 41, (n, 2), generator=g).tolist()
    return [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g) for h, w in sizes]


def uids(g: int = G) -> list[str]:
    return [f"p{i}" for i in range(g)]


def put_groups(stream: tq.Stream, g: int = G, n: int = N,
               image: bool = True) -> tuple[list[str], list[torch.Tensor]]:
    """``g`` shared entries (prompt, image) and ``g * n`` response rows naming them."""
    w = stream.writer(P)
    imgs = images(g)
    data = {"prompt": torch.arange(g * 2).reshape(g, 2)}
    if image:
        data["image"] = tq.MultiRagged.from_list(imgs, fixed_dims=(0,))
    w.put_shared(uids(g), data)
    keys = [f"p{i}_{j}" for i in range(g) for j in range(n)]
    tags = [{"uid": f"p{i}", "reward": float(j)} for i in range(g) for j in range(n)]
    w.put(keys, {"response": torch.arange(g * n)}, tags=tags,
          shared=[f"p{i}" for i in range(g) for _ in range(n)])
    return keys, imgs


def unit_bytes(stream: tq.Stream) -> int:
    return sum(u["nbytes"] for u in stream.deployment_stats()["units"])


def test_rows_read_their_entry_s_fields_as_their_own(stream):
    keys, imgs = put_groups(stream)
    td = stream.kv.get_batch(keys, fields=["prompt", "image", "response"], partition=P,
                             ragged="list")
    assert td.batch_size == torch.Size([G * N])
    for r, key in enumerate(keys):
        g = int(key[1])
        assert torch.equal(td["prompt"][r], torch.tensor([2 * g, 2 * g + 1]))
        assert torch.equal(td["image"][r], imgs[g])
        assert int(td["response"][r]) == r
    rows = td["image"]  # "list": views of the one entry read, no copy per row
    assert rows[0].data_ptr() == rows[N - 1].data_ptr() != rows[N].data_ptr()
    one = stream.kv.get(keys[5], partition=P)
    assert torch.equal(one["image"], imgs[1]) and set(one) == {"prompt", "image", "response"}
    assert [r["fields"] for r in stream.kv.list(P)][0] == ["prompt", "image", "response"]
    assert len(stream.kv.list(P)) == G * N  # entries are no rows


def test_an_indexed_read_gives_each_entry_once(stream):
    keys, imgs = put_groups(stream)
    sel = [keys[1], keys[9], keys[2]]  # groups 0, 2, 0
    td = stream.kv.get_batch(sel, fields=["image", "response"], partition=P,
                             ragged="list", shared="index")
    assert td["image_index"].tolist() == [0, 1, 0]
    assert len(td["image"]) == 2
    assert torch.equal(td["image"][0], imgs[0]) and torch.equal(td["image"][1], imgs[2])
    assert td["response"].tolist() == [1, 9, 2]
    with pytest.raises(ConfigError, match="shared must be one of"):
        stream.kv.get_batch(sel, fields=["image"], partition=P, shared="once")


def test_a_row_is_ready_only_once_its_entry_has_the_field(stream):
    keys, _ = put_groups(stream, g=1, image=False)
    client = stream.client()
    client.register_task(P, "actor", fields=["image", "response"], batch_size=N)
    with pytest.raises(WaitTimeout):
        client.get_meta(P, "actor", step=0, timeout=0.3)
    img = images(1, seed=5)[0]
    stream.writer(P).put_shared("p0", {"image": tq.MultiRagged.from_list([img],
                                                                         fixed_dims=(0,))})
    meta = client.get_meta(P, "actor", step=0, timeout=5)
    td = client.get_data(meta, ragged="list")
    assert sorted(meta.keys) == keys
    assert all(torch.equal(x, img) for x in td["image"])


def test_group_sampler_steps_carry_their_group_s_image(stream):
    keys, imgs = put_groups(stream)
    ds = tq.StreamingDataset(stream, P, "actor", ["prompt", "image", "response"],
                             batch_size=N, sampler=tq.samplers.GroupSampler(group_size=N),
                             ragged="list", timeout=5)
    stream.close_partition(P)
    seen = 0
    for batch in tq.StreamingDataLoader(ds):
        uid = {t["uid"] for t in tq.batch_meta(batch).tags}
        assert len(uid) == 1
        g = int(uid.pop()[1:])
        assert all(torch.equal(x, imgs[g]) for x in batch["image"])
        seen += 1
    assert seen == G


def test_an_entry_is_freed_once_every_declared_consumer_acked_its_rows(stream):
    stream.create_partition(P, consumers=["old_logp", "actor"])
    keys, _ = put_groups(stream)
    client = stream.client()
    for task in ("old_logp", "actor"):
        client.register_task(P, task, fields=["image", "response"], batch_size=N,
                             sampler=tq.samplers.GroupSampler(group_size=N))
    full = unit_bytes(stream)
    assert stream.stats()[P]["shared"]["entries"] == G
    assert stream.stats()[P]["shared"]["refs"] == G * N
    metas = [client.get_meta(P, "old_logp", step=s, timeout=5) for s in range(G)]
    for m in metas:
        client.ack(m)
    assert stream.stats()[P]["shared"]["entries"] == G  # "actor" still reads them
    first = client.get_meta(P, "actor", step=0, timeout=5)
    client.ack(first)
    shared = stream.stats()[P]["shared"]
    assert shared["entries"] == G - 1 and shared["refs"] == (G - 1) * N
    for s in range(1, G):
        client.ack(client.get_meta(P, "actor", step=s, timeout=5))
    assert stream.stats()[P]["shared"] == {"entries": 0, "bytes": 0, "refs": 0,
                                           "fields": ["image", "prompt"]}
    assert stream.stats()[P]["rows"] == 0
    assert full > 0 and unit_bytes(stream) == 0


def test_an_entry_is_freed_when_a_filter_discards_its_group(stream):
    stream.create_partition(P, consumers=["actor"])
    put_groups(stream, g=2)
    w = stream.writer(P)  # group p2: every reward equal -> discarded, entry freed
    w.put_shared("p2", {"prompt": torch.tensor([9, 9]),
                        "image": images(1, seed=3)[0]})
    flat = [f"p2_{j}" for j in range(N)]
    w.put(flat, {"response": torch.arange(N)}, tags=[{"uid": "p2", "reward": 1.0}] * N,
          shared=["p2"] * N)
    sampler = tq.samplers.DynamicFilterSampler(tq.samplers.GroupSampler(group_size=N))
    client = stream.client()
    client.register_task(P, "actor", fields=["image", "response"], batch_size=N,
                         sampler=sampler)
    metas = [client.get_meta(P, "actor", step=s, timeout=5) for s in range(2)]
    assert stream.stats()[P]["tasks"]["actor"]["discarded"]["zero_variance"] == N
    assert stream.stats()[P]["shared"]["entries"] == 2  # p2 freed with its rows
    assert "p2" not in {t["uid"] for m in metas for t in m.tags}


def test_clear_frees_an_entry_with_its_last_row(stream):
    keys, _ = put_groups(stream)
    stream.kv.clear(keys[:N - 1], partition=P)
    assert stream.stats()[P]["shared"]["entries"] == G
    assert stream.stats()[P]["shared"]["refs"] == G * N - (N - 1)
    stream.kv.clear(keys[N - 1], partition=P)
    assert stream.stats()[P]["shared"]["entries"] == G - 1
    stream.kv.clear(partition=P)
    assert stream.stats()[P]["shared"]["entries"] == 0
    assert unit_bytes(stream) == 0


def test_the_same_bytes_again_write_nothing_and_other_bytes_are_refused(stream):
    w = stream.writer(P)
    assert w.put_shared("p0", {"prompt": torch.tensor([1, 2])}) == ["p0"]
    assert w.put_shared("p0", {"prompt": torch.tensor([1, 2])}) == []
    with pytest.raises(ConfigError, match="written once.*'prompt'"):
        w.put_shared("p0", {"prompt": torch.tensor([1, 3])})
    w.put("r0", {"response": torch.tensor(0)}, shared="p0")
    assert stream.kv.get("r0", partition=P)["prompt"].tolist() == [1, 2]
    assert stream.stats()[P]["shared"]["entries"] == 1


def test_bad_shared_input_is_refused_and_nothing_is_stored(stream):
    w = stream.writer(P)
    w.put_shared("p0", {"prompt": torch.tensor([1, 2])})
    with pytest.raises(KeyConflictError, match="shared must name entries.*'nope'"):
        w.put(["a", "b"], {"response": torch.arange(2)}, shared=["p0", "nope"])
    assert stream.kv.list(P) == [] and stream.stats()[P]["shared"]["refs"] == 0
    with pytest.raises(ConfigError, match="shared must give, for each of the 2 rows"):
        w.put(["a", "b"], {"response": torch.arange(2)}, shared=["p0"])
    with pytest.raises(SchemaError, match="'prompt'.*is a shared field"):
        w.put(["a"], {"prompt": torch.tensor([[1, 2]])})
    w.put(["a"], {"response": torch.arange(1)}, shared=["p0"])
    with pytest.raises(SchemaError, match="'response'.*is a field of its rows"):
        w.put_shared("p1", {"response": torch.tensor(1)})
    w.put_shared("p1", {"prompt": torch.tensor([3, 4])})
    with pytest.raises(ConfigError, match="names one entry for the row's life"):
        w.put(["a"], {"response": torch.arange(1)}, shared=["p1"])
    with pytest.raises(ConfigError, match="keys must not start with"):
        w.put(["\x00shared:p0"], {"response": torch.arange(1)})
    assert [r["key"] for r in stream.kv.list(P)] == ["a"]
    assert stream.kv.get("a", partition=P)["prompt"].tolist() == [1, 2]


def test_save_and_restore_keep_entries_and_their_references(tmp_path):
    path = str(tmp_path / "ckpt")
    with tq.init() as stream:
        stream.create_partition(P, consumers=["actor"])
        keys, imgs = put_groups(stream)
        before = stream.stats()[P]["shared"]
        stream.save(path)
    with tq.init(restore=path) as stream:
        assert stream.stats()[P]["shared"] == before
        td = stream.kv.get_batch(keys, fields=["image"], partition=P, ragged="list")
        assert all(torch.equal(td["image"][r], imgs[r // N]) for r in range(len(keys)))
        with pytest.raises(ConfigError, match="written once"):
            stream.writer(P).put_shared("p0", {"prompt": torch.tensor([7, 7])})
        client = stream.client()
        client.register_task(P, "actor", fields=["image", "response"], batch_size=N,
                             sampler=tq.samplers.GroupSampler(group_size=N))
        for s in range(G):
            client.ack(client.get_meta(P, "actor", step=s, timeout=5))
        assert stream.stats()[P]["shared"]["entries"] == 0
        assert unit_bytes(stream) == 0


def test_ragged_and_plain_shared_fields_read_as_written(stream):
    prompts = [torch.arange(n) for n in (3, 5)]
    w = stream.writer(P)
    w.put_shared(["a", "b"], {"ids": torch.nested.nested_tensor(prompts, layout=torch.jagged),
                              "text": ["first", "second"]})
    w.put(["a0", "b0", "a1", "b1"], {"r": torch.arange(4)}, shared=["a", "b", "a", "b"])
    td = stream.kv.get_batch(["b0", "a0", "a1"], fields=["ids", "text"], partition=P,
                             ragged="list")
    assert [t.tolist() for t in td["ids"]] == [[0, 1, 2, 3, 4], [0, 1, 2], [0, 1, 2]]
    assert td["text"] == ["second", "first", "first"]
    padded = stream.kv.get_batch(["b0", "a0"], fields=["ids"], partition=P, ragged="padded")
    assert padded["ids"].tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 0]]
    idx = stream.kv.get_batch(["b0", "a0", "b1"], fields=["text"], partition=P,
                              shared="index")
    assert idx["text"] == ["first", "second"] and idx["text_index"].tolist() == [1, 0, 1]


def test_a_loader_reads_shared_fields_once_per_entry_with_shared_index(stream):
    keys, imgs = put_groups(stream)
    stream.close_partition(P)
    ds = tq.StreamingDataset(stream, P, "actor", ["image", "response"], batch_size=2 * N,
                             sampler=tq.samplers.GroupSampler(group_size=N),
                             ragged="list", shared="index", timeout=5)
    batches = list(tq.StreamingDataLoader(ds))
    first = batches[0]
    assert first["image_index"].tolist() == [0] * N + [1] * N
    uids = [t["uid"] for t in tq.batch_meta(first).tags]
    assert [torch.equal(x, imgs[int(u[1:])]) for x, u in zip(
        [first["image"][i] for i in first["image_index"].tolist()], uids, strict=True)] \
        == [True] * 2 * N
    with pytest.raises(ConfigError, match="shared must be one of"):
        tq.StreamingDataset(stream, P, "actor", ["image"], batch_size=N, shared="once")


def test_select_split_and_minibatches_of_an_indexed_batch_keep_each_row_s_entry(stream):
    keys, _ = put_groups(stream)
    stream.close_partition(P)
    ds = tq.StreamingDataset(stream, P, "actor", ["image", "prompt", "response"],
                             batch_size=G * N, ragged="list", shared="index", timeout=5)
    loader = tq.StreamingDataLoader(ds)
    batch = next(iter(loader))

    def same_as_materialized(part) -> None:
        rows = stream.kv.get_batch(list(tq.batch_meta(part).keys), partition=P,
                                   fields=["image", "prompt", "response"], ragged="list")
        assert part["response"].tolist() == rows["response"].tolist()
        for r in range(len(rows["response"])):
            assert torch.equal(part["image"][int(part["image_index"][r])], rows["image"][r])
            assert torch.equal(part["prompt"][int(part["prompt_index"][r])], rows["prompt"][r])
        # every entry kept, not copied: the index still points into them
        assert part["image"][0].data_ptr() == batch["image"][0].data_ptr()

    same_as_materialized(tq.select_rows(batch, [9, 0, 5]))
    row = batch[5]  # tensordict's indexing keeps the entries whole too
    assert torch.equal(row["image"][int(row["image_index"])],
                       batch["image"][int(batch["image_index"][5])])
    same_as_materialized(tq.select_rows(batch, torch.arange(G * N) % 2 == 1))
    parts = tq.split_rows(batch, 5)
    assert [len(tq.batch_meta(p)) for p in parts] == [5, 5, 2]
    for part in parts:
        same_as_materialized(part)
    mbs = list(loader.minibatches(batch, minibatch_size=4, epochs=2, shuffle=True))
    assert len(mbs) == 2 * G
    for mb in mbs:
        same_as_materialized(mb)


def test_a_padded_indexed_read_gives_each_entry_s_shape(stream):
    keys, imgs = put_groups(stream)
    sel = [keys[9], keys[1], keys[10]]  # groups 2, 0, 2
    td = stream.kv.get_batch(sel, fields=["image", "response"], partition=P,
                             ragged="padded", shared="index")
    index = td["image_index"].tolist()
    assert index[0] == index[2] != index[1]
    shapes = td["image_shape"]  # int64 [entries, ndim], as ragged="padded" gives per row
    assert shapes.shape == (2, 3) and td["image"].shape[0] == 2
    for row, key in zip(index, sel, strict=True):
        c, h, w = shapes[row].tolist()
        assert torch.equal(td["image"][row, :c, :h, :w], imgs[int(key[1])])
    batch = next(iter(tq.StreamingDataLoader(tq.StreamingDataset(
        stream, P, "actor", ["image"], batch_size=2 * N, ragged="padded", shared="index",
        timeout=5))))
    part = tq.select_rows(batch, [N + 1])
    assert torch.equal(part["image_shape"], batch["image_shape"])  # entries kept whole
    c, h, w = part["image_shape"][int(part["image_index"][0])].tolist()
    assert torch.equal(part["image"][int(part["image_index"][0]), :c, :h, :w], imgs[1])
    stream.writer(P).put(["x"], {"image_shape": torch.zeros(1, 3)}, shared=["p0"])
    with pytest.raises(SchemaError, match="image_shape"):
        stream.kv.get_batch(["x"], fields=["image", "image_shape"], partition=P,
                            ragged="padded", shared="index")


def test_rows_naming_an_entry_lost_with_its_unit_are_lost_too():
    with tq.init(storage_units=2, config=tq.StreamConfig(timeout=5.0)) as stream:
        stream.create_partition(P, consumers=["actor"])
        stream.writer(P, unit=0).put_shared("p0", {"prompt": torch.tensor([1, 2])})
        stream.writer(P, unit=1).put(["a", "b"], {"r": torch.arange(2)}, shared=["p0"] * 2)
        client = stream.client()
        client.register_task(P, "actor", fields=["prompt", "r"], batch_size=2)
        assert stream.connection.controller().unit_lost(0) == {P: 2}
        stats = stream.stats()[P]
        assert stats["rows"] == 0 and stats["shared"]["entries"] == 0
        assert stats["tasks"]["actor"]["discarded"] == {"unit_lost": 2}


def test_commit_new_leaves_a_row_put_of_a_shared_field_to_reserve(stream):
    from tq_stream.convert import schemas_of, single_row

    stream.writer(P).put_shared("a", {"prompt": torch.tensor([1, 2])})
    ctrl = stream.connection.controller()
    place = ctrl.reserve(P, ["x"], schemas_of({"r": torch.zeros(1)}), spare=1)
    spare = place.spare
    done = ctrl.commit_new(P, ["y"], spare.index, spare.generation,
                           schemas_of(single_row({"prompt": torch.tensor([5, 6])})))
    assert done == Committed(ok=False, reason="schema")


def test_a_shared_put_a_unit_did_not_take_is_put_again(stream, monkeypatch):
    from tq_stream.connection import placement
    from tq_stream.errors import Unreachable

    w = stream.writer(P)
    w.put_shared("p0", {"prompt": torch.tensor([1, 2])})
    w.put(["r0"], {"r": torch.arange(1)}, shared=["p0"])
    store, calls = placement.store, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise Unreachable("storage unit 0 did not answer")
        return store(*args, **kwargs)

    monkeypatch.setattr(placement, "store", flaky)
    img = images(1)[0]
    assert w.put_shared("p0", {"image": tq.MultiRagged.from_list([img], fixed_dims=(0,))}) \
        == ["p0"]
    assert len(calls) == 2
    assert torch.equal(stream.kv.get("r0", partition=P)["image"], img)


def test_a_controller_state_dict_keeps_entries_and_references(stream):
    from tq_stream.controller.controller import Controller

    stream.create_partition(P, consumers=["actor"])
    keys, _ = put_groups(stream)
    stream.kv.clear(keys[:N], partition=P)  # group p0 gone with its rows
    state = stream.connection.controller().state_dict()
    again = Controller(n_units=1)
    again.load_state_dict(state)
    assert again.stats()[P]["shared"] == stream.stats()[P]["shared"]
    assert again.stats()[P]["shared"]["entries"] == G - 1
    assert again.lookup(P, keys[N:], ["image"]).shared.pos.tolist() == \
        [0] * N + [1] * N
    again.register_task(P, "actor", ["image", "response"], batch_size=N)
    meta = again.get_meta(P, "actor", step=0, timeout=1)
    again.ack(P, "actor", 0, 0, meta.index, meta.generation)
    assert again.stats()[P]["shared"]["entries"] == G - 2


def test_a_waiting_reader_wakes_when_the_entry_gets_its_field(stream):
    import threading

    keys, _ = put_groups(stream, g=1, image=False)
    client = stream.client()
    client.register_task(P, "actor", fields=["image", "response"], batch_size=N)
    got = []
    reader = threading.Thread(target=lambda: got.append(
        client.get_meta(P, "actor", step=0, timeout=10)))
    reader.start()
    img = images(1, seed=6)[0]
    stream.writer(P).put_shared("p0", {"image": tq.MultiRagged.from_list([img],
                                                                         fixed_dims=(0,))})
    reader.join(timeout=10)
    assert not reader.is_alive() and sorted(got[0].keys) == keys


# ------------------------------------------------------------ review findings (races, losses)
def _row_schema(**cols: torch.Tensor) -> dict:
    from tq_stream.convert import schemas_of, single_row

    return schemas_of(single_row(cols))


def test_a_put_of_other_bytes_while_a_claim_is_in_flight_is_refused(stream, monkeypatch):
    from tq_stream.connection import placement

    w = stream.writer(P)
    store = placement.store
    seen: list[int] = []

    def interleaved(*a, **k):  # while A's bytes are on their way, B puts other bytes
        if not seen:
            seen.append(1)
            with pytest.raises(ConfigError, match="'p0'"):
                w.put_shared("p0", {"prompt": torch.tensor([9, 9])})
        return store(*a, **k)

    monkeypatch.setattr(placement, "store", interleaved)
    assert w.put_shared("p0", {"prompt": torch.tensor([1, 2])}) == ["p0"]
    monkeypatch.setattr(placement, "store", store)
    assert seen
    w.put(["r0"], {"r": torch.zeros(1)}, shared=["p0"])
    assert stream.kv.get("r0", partition=P)["prompt"].tolist() == [1, 2]
    assert w.put_shared("p0", {"prompt": torch.tensor([1, 2])}) == []


def test_a_claim_an_aborted_put_left_may_be_put_with_other_bytes():
    from tq_stream.controller.controller import Controller

    c = Controller(n_units=1)
    sch = _row_schema(prompt=torch.zeros(2))
    a = c.reserve_shared(P, ["g"], sch, [{"prompt": "A"}], [16])
    c.abort(P, a.index, a.generation)
    b = c.reserve_shared(P, ["g"], sch, [{"prompt": "B"}], [16])
    c.commit(P, b.index, b.generation, sch)
    assert c.stats()[P]["shared"]["entries"] == 1


def test_a_claim_of_a_row_freed_after_its_reserve_is_refused():
    from tq_stream.controller.controller import Controller
    from tq_stream.controller.shared_puts import reserve_shared
    from tq_stream.errors import StateError

    c = Controller(n_units=1)
    row = _row_schema(r=torch.zeros(1))
    pl = c.reserve(P, ["keep"], row)
    c.commit(P, pl.index, pl.generation, row)
    sch = _row_schema(prompt=torch.zeros(2))
    a = c.reserve_shared(P, ["g"], sch, [{"prompt": "A"}], [16])

    def reserve_then_a_aborts(*args, **kw):
        out = c.reserve(*args, **kw)
        c.abort(P, a.index, a.generation)  # A's store failed meanwhile
        return out

    with pytest.raises(StateError):
        reserve_shared(c.lock, lambda p: c.book.part(p, create=True), reserve_then_a_aborts,
                       c.abort, P, ["g"], sch, [{"prompt": "A"}], [16], {})
    pl = c.reserve(P, ["x"], row)
    c.commit(P, pl.index, pl.generation, row)
    assert c.stats()[P]["rows"] == 2 and c.stats()[P]["shared"]["entries"] == 0
    c.register_task(P, "t", ["r"], batch_size=2)
    assert sorted(c.get_meta(P, "t", step=0, timeout=1).keys) == ["keep", "x"]


def test_a_commit_that_fails_after_naming_an_entry_leaves_no_half_row():
    from tq_stream.controller.controller import Controller
    from tq_stream.convert import schemas_of

    c = Controller(n_units=1)
    sch = _row_schema(prompt=torch.zeros(2))
    e = c.reserve_shared(P, ["g"], sch, [{"prompt": "d"}], [16])
    c.commit(P, e.index, e.generation, sch)
    c.create_partition(P, consumers=["t"])
    c.register_task(P, "t", ["prompt", "response"], batch_size=1)
    fl = schemas_of({"response": torch.zeros(1)})
    it = schemas_of({"response": torch.zeros(1, dtype=torch.int64)})
    a, b = c.reserve(P, ["a"], fl), c.reserve(P, ["b"], it)  # two first puts of "response"
    c.commit(P, a.index, a.generation, fl)
    with pytest.raises(SchemaError):
        c.commit(P, b.index, b.generation, it, shared=["g"])
    c.abort(P, b.index, b.generation)  # what the Writer does
    assert c.stats()[P]["rows"] == 1 and c.stats()[P]["shared"]["refs"] == 0


def test_a_restart_reconcile_loses_the_rows_naming_a_lost_entry_and_frees_their_bytes():
    import numpy as np

    from tq_stream.deploy.meta_checkpoint import reconcile

    with tq.init(storage_units=2, config=tq.StreamConfig(timeout=2.0)) as stream:
        stream.create_partition(P, consumers=["actor"])
        stream.writer(P, unit=0).put_shared("p0", {"prompt": torch.tensor([1, 2])})
        stream.writer(P, unit=1).put(["a", "b"], {"r": torch.arange(2)}, shared=["p0"] * 2)
        ctrl = stream.connection.controller()
        stream.client().register_task(P, "actor", fields=["prompt", "r"], batch_size=2)
        part = ctrl.book.parts[P]
        with ctrl.lock:  # unit 0 came back empty
            gone, _ = reconcile(part, 0, {"slots": np.zeros(0, np.int64),
                                          "tokens": np.zeros(0, np.int64)})
            assert ctrl.unit_map.lose_rows(part, gone, 0) == 2
        ctrl.unit_map.free_pending()  # what Recovery.reconcile does after the lock
        stats = stream.stats()[P]
        assert stats["rows"] == 0 and stats["shared"]["entries"] == 0
        assert stats["tasks"]["actor"]["discarded"] == {"unit_lost": 2}
        assert stream.deployment_stats()["units"][1]["nbytes"] == 0


def test_rows_on_a_live_unit_naming_a_lost_entry_free_their_bytes():
    with tq.init(storage_units=2, config=tq.StreamConfig(timeout=5.0)) as stream:
        stream.create_partition(P, consumers=["actor"])
        stream.writer(P, unit=0).put_shared("p0", {"prompt": torch.tensor([1, 2])})
        stream.writer(P, unit=1).put(["a", "b", "c", "d"], {"r": torch.arange(4)},
                                     shared=["p0"] * 4)
        assert stream.deployment_stats()["units"][1]["nbytes"] > 0
        assert stream.connection.controller().unit_lost(0) == {P: 4}
        assert stream.deployment_stats()["units"][1]["nbytes"] == 0


def test_clear_refuses_shared_entries_keys(stream):
    w = stream.writer(P)
    w.put_shared("p0", {"prompt": torch.tensor([1, 2])})
    w.put(["a"], {"r": torch.zeros(1)}, shared=["p0"])
    with pytest.raises(ConfigError, match="shared:p0"):
        stream.client().clear(["\x00shared:p0"], partition=P)
    with pytest.raises(ConfigError, match="shared:p0"):
        stream.connection.controller().clear(P, ["\x00shared:p0"])
    assert stream.stats()[P]["shared"]["entries"] == 1
    assert stream.kv.get("a", partition=P)["prompt"].tolist() == [1, 2]


def test_clear_of_a_partition_counts_rows_not_entries_and_the_partition_is_reused(stream):
    put_groups(stream, g=2, n=2, image=False)
    assert stream.kv.clear(partition=P) == 4
    keys, _ = put_groups(stream, g=2, n=2, image=False)  # the next iteration's groups
    assert stream.kv.get(keys[3], partition=P)["prompt"].tolist() == [2, 3]


def test_the_never_written_wait_error_counts_rows_not_entries(stream):
    put_groups(stream, g=2, n=2, image=False)
    client = stream.client()
    client.register_task(P, "t", fields=["nope"], batch_size=1)
    with pytest.raises(WaitTimeout, match="any of its 4 rows"):
        client.get_meta(P, "t", step=0, timeout=0.1)


def test_a_row_put_and_a_first_shared_put_of_one_field_cannot_both_commit():
    from tq_stream.controller.controller import Controller

    c = Controller(n_units=1)
    sch = _row_schema(x=torch.zeros(2))
    row = c.reserve(P, ["r"], sch)  # a row put of "x" in flight
    e = c.reserve_shared(P, ["g"], sch, [{"x": "d"}], [16])
    c.commit(P, e.index, e.generation, sch)
    with pytest.raises(SchemaError, match="'x'"):
        c.commit(P, row.index, row.generation, sch)
    c.abort(P, row.index, row.generation)
    assert c.stats()[P]["rows"] == 0


def test_an_aborted_claim_and_a_cleared_partition_forget_shared_field_names():
    from tq_stream.controller.controller import Controller

    c = Controller(n_units=1)
    sch = _row_schema(x=torch.zeros(2))
    e = c.reserve_shared(P, ["g"], sch, [{"x": "d"}], [16])
    c.abort(P, e.index, e.generation)  # its store failed
    c.create_partition(P)
    pl = c.reserve(P, ["r"], sch)  # "x" may be a row field now
    c.commit(P, pl.index, pl.generation, sch)
    c.clear(P)
    y = _row_schema(y=torch.zeros(2))
    e = c.reserve_shared(P, ["g"], y, [{"y": "d"}], [16])
    c.commit(P, e.index, e.generation, y)
    c.clear(P)
    pl = c.reserve(P, ["r"], y)  # a cleared partition forgot its shared fields
    c.commit(P, pl.index, pl.generation, y)
    assert c.stats()[P]["rows"] == 1


def test_write_times_and_stats_ages_read_the_controller_s_clock():
    from tq_stream.controller.controller import Controller

    c = Controller(n_units=1, clock=lambda: 1000.0)
    sch = _row_schema(x=torch.zeros(2))
    p = c.reserve("p", ["a"], sch, spare=1)
    c.commit("p", p.index, p.generation, sch)
    s = p.spare
    assert c.commit_new("p", ["b"], [int(s.index[0])], [int(s.generation[0])], sch).ok
    c.register_task("p", "t", ["x"], batch_size=1)
    stats = c.stats()["p"]["tasks"]["t"]
    assert stats["oldest_ready_age"] == 0.0 and stats["at"] == 1000.0


def test_a_claim_whose_reservation_lapsed_leaves_no_shared_field():
    from tq_stream.controller.controller import Controller

    now = [0.0]
    c = Controller(n_units=1, clock=lambda: now[0])
    c.create_partition(P)
    sch = _row_schema(x=torch.zeros(2))
    c.reserve_shared(P, ["g"], sch, [{"x": "d"}], [16], session="s" * 32, lease=1.0,
                     timeout=1.0)  # its producer dies before the commit
    now[0] = 100.0
    pl = c.reserve(P, ["r"], sch)  # aborts the lapsed reservation first
    c.commit(P, pl.index, pl.generation, sch)
    assert c.stats()[P]["rows"] == 1 and c.stats()[P]["shared"]["entries"] == 0
