"""Images and video as fields (multi-ragged rows): written as lists of tensors, strided
nested tensors or ``MultiRagged`` columns, read back as written in every ``ragged=``
mode; a row that breaks the first write's ndim, dtype or fixed dims is refused and
nothing stored is lost."""

from __future__ import annotations

import pytest
import torch

import tq_stream as tq
from tq_stream.columns import coerce, concat, span, take
from tq_stream.errors import SchemaError, SerializationError
from tq_stream.schemas import FieldSchema
from tq_stream.serialization import decode, encode

P = "vlm"


def images(n: int, seed: int = 0) -> list[torch.Tensor]:
    """``n`` uint8 [3, H, W] images, H and W in 100..400."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(100, 401, (n, 2), generator=g).tolist()
    return [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g) for h, w in sizes]


def videos(n: int, seed: int = 0) -> list[torch.Tensor]:
    """``n`` uint8 [T, 3, H, W] clips, T, H and W per clip."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(2, 20, (n, 3), generator=g).tolist()
    return [torch.randint(0, 256, (t, 3, h, w), dtype=torch.uint8, generator=g)
            for t, h, w in sizes]


def keys(n: int, prefix: str = "k") -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def read(stream: tq.Stream, names: list[str], field: str, ragged: str = "list"):
    return stream.kv.get_batch(names, fields=[field], partition=P, ragged=ragged)


def same(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return len(got) == len(want) and all(
        a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        for a, b in zip(got, want, strict=True))


def test_images_of_varying_size_round_trip_in_every_read_mode(stream):
    imgs = images(6)
    stream.writer(P).put(keys(6), {"image": imgs})
    assert same(read(stream, keys(6), "image").get("image").tolist(), imgs)
    nested = read(stream, keys(6), "image", "nested")["image"]
    assert nested.is_nested and nested.layout == torch.strided
    assert same(list(nested.unbind()), imgs)
    padded = read(stream, keys(6), "image", "padded")
    shapes = padded["image_shape"]
    assert shapes.tolist() == [list(i.shape) for i in imgs]
    assert padded["image"].shape == (6, 3, *shapes[:, 1:].max(0).values.tolist())
    for row, img in zip(padded["image"], imgs, strict=True):
        assert torch.equal(row[:, :img.shape[1], :img.shape[2]], img)
        assert int(row.sum()) == int(img.sum())  # zeros beyond each image
    assert torch.equal(stream.kv.get("k3", partition=P)["image"], imgs[3])


def test_the_schema_records_fixed_and_varying_dims(stream):
    imgs = images(3)
    stream.writer(P).put(keys(3), {"image": tq.MultiRagged.from_list(imgs, fixed_dims=(0,))})
    schema = stream.kv.meta(keys(3), partition=P).schemas["image"]
    assert schema == FieldSchema("multiragged", "uint8", (3, -1, -1))
    assert schema.describe() == "multiragged uint8[3, *, *]"
    assert stream.stats()[P]["fields"]["image"] == "multiragged uint8[3, *, *]"


def test_images_put_one_row_at_a_time_after_the_field_is_declared(stream):
    imgs = images(4, seed=1)
    w = stream.writer(P)
    w.put("k0", {"image": tq.MultiRagged.from_list(imgs[:1], fixed_dims=(0,))})
    for i, img in enumerate(imgs[1:], 1):  # a plain tensor: its rows fit the field
        w.put(f"k{i}", {"image": img})
    assert same(read(stream, keys(4), "image").get("image").tolist(), imgs)


def test_a_strided_nested_tensor_is_a_multiragged_field(stream):
    imgs = images(3, seed=2)
    stream.writer(P).put(keys(3), {"image": torch.nested.nested_tensor(imgs)})
    assert same(read(stream, keys(3), "image").get("image").tolist(), imgs)


def test_video_frames_round_trip(stream):
    clips = videos(5)
    stream.writer(P).put(keys(5), {"video": tq.MultiRagged.from_list(clips, fixed_dims=(1,))})
    assert same(read(stream, keys(5), "video").get("video").tolist(), clips)
    assert stream.kv.meta(keys(1), partition=P).schemas["video"].describe() == \
        "multiragged uint8[*, 3, *, *]"
    padded = read(stream, keys(5), "video", "padded")
    assert padded["video_shape"].tolist() == [list(c.shape) for c in clips]


def test_token_sequences_stay_ragged(stream):
    rows = [torch.arange(n) for n in (3, 5, 2)]
    wide = [torch.ones(n, 4) for n in (3, 5, 2)]
    stream.writer(P).put(keys(3), {"ids": rows, "emb": wide})
    schemas = stream.kv.meta(keys(3), partition=P).schemas
    assert schemas["ids"].kind == schemas["emb"].kind == "ragged"
    got = read(stream, keys(3), "ids", "nested")["ids"]
    assert got.layout == torch.jagged


@pytest.mark.parametrize("rows, rule", [
    ([torch.zeros(4, 50, 60, dtype=torch.uint8)], "row 0 of shape \\[4, 50, 60\\]"),
    (images(1) + [torch.zeros(1, 50, 60, dtype=torch.uint8)], "row 1 of shape \\[1, 50, 60\\]"),
    ([torch.zeros(3, 50, 60, dtype=torch.float32)], "got ragged float32"),
    ([torch.zeros(50, 60, dtype=torch.uint8)], "got ragged uint8\\[\\*, 60\\]"),
    (torch.zeros(1, 3, 50, 60, dtype=torch.int16), "got dense int16"),
])
def test_a_row_breaking_the_fixed_schema_is_refused_and_nothing_is_lost(stream, rows, rule):
    imgs = images(3, seed=3)
    w = stream.writer(P)
    w.put(keys(3), {"image": tq.MultiRagged.from_list(imgs, fixed_dims=(0,))})
    new = keys(len(rows), "new")
    with pytest.raises(SchemaError, match=rf"field 'image'.*multiragged uint8\[3, \*, \*\]"
                                          rf".*{rule}"):
        w.put(new, {"image": rows})
    assert same(read(stream, keys(3), "image").get("image").tolist(), imgs)
    assert stream.kv.list(P, keys=new) == []


def test_rows_of_other_dtypes_or_ndims_in_one_put_are_refused(stream):
    with pytest.raises(SchemaError, match="field 'image' rows must share dtype and ndim"):
        stream.writer(P).put(keys(2), {"image": [torch.zeros(3, 4, 5), torch.zeros(3, 4)]})
    with pytest.raises(SchemaError, match="fixed dim 0"):
        tq.MultiRagged.from_list([torch.zeros(3, 4), torch.zeros(1, 4)], fixed_dims=(0,))


def test_a_malformed_multiragged_column_is_refused(stream):
    col = tq.MultiRagged(torch.zeros(10, dtype=torch.uint8),
                         torch.tensor([[3, 2, 2]]), (3, -1, -1))
    with pytest.raises(SchemaError, match="field 'image'.*12 elements, values has 10"):
        stream.writer(P).put(["a"], {"image": col})


def test_columns_take_span_concat_and_coerce():
    imgs = images(5, seed=4)
    col = tq.MultiRagged.from_list(imgs, fixed_dims=(0,))
    assert same(take(col, torch.tensor([4, 0, 2])).rows(), [imgs[4], imgs[0], imgs[2]])
    assert same(span(col, 1, 3).rows(), imgs[1:3])
    assert same(concat([span(col, 0, 2), span(col, 2, 5)]).rows(), imgs)
    fixed = FieldSchema("multiragged", "uint8", (3, -1, -1))
    dense = torch.stack([imgs[0], imgs[0]])
    assert same(coerce(dense, fixed).rows(), [imgs[0], imgs[0]])
    assert coerce(torch.zeros(2, 4, 5, 5, dtype=torch.uint8), fixed) is None


def test_the_wire_carries_multiragged_columns_without_pickle():
    imgs = images(3, seed=5)
    col = tq.MultiRagged.from_list(imgs, fixed_dims=(0,))
    got = decode([bytes(f) for f in encode({"c": col})])["c"]
    assert got.dims == (3, -1, -1) and same(got.rows(), imgs)
    with pytest.raises(SerializationError, match="well-formed"):
        encode({"c": tq.MultiRagged(col.values[:-1], col.shapes, col.dims)})


def test_save_and_restore_keeps_images(tmp_path):
    imgs, clips = images(4, seed=6), videos(4, seed=6)
    path = str(tmp_path / "ckpt")
    with tq.init() as stream:
        stream.writer(P).put(keys(4), {
            "image": tq.MultiRagged.from_list(imgs, fixed_dims=(0,)), "video": clips})
        stream.save(path)
    with tq.init(restore=path) as stream:
        got = stream.kv.get_batch(keys(4), partition=P, ragged="list")
        assert same(got.get("image").tolist(), imgs) and same(got.get("video").tolist(), clips)
        assert stream.kv.meta(keys(1), partition=P).schemas["image"].shape == (3, -1, -1)


def test_a_loader_reads_images(stream):
    imgs = images(4, seed=7)
    stream.writer(P).put(keys(4), {"image": imgs})
    stream.close_partition(P)
    ds = tq.StreamingDataset(stream, P, "t", ["image"], batch_size=2, ragged="list",
                             timeout=5.0)
    got = [row for batch in tq.StreamingDataLoader(ds) for row in batch.get("image").tolist()]
    assert sorted(int(r.sum()) for r in got) == sorted(int(i.sum()) for i in imgs)
