"""The wire format: round trips, zero copy, strict rejection of bad input, files."""

from __future__ import annotations

import collections
import enum
import math
import os
import warnings
from dataclasses import dataclass

import msgspec
import numpy as np
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tq_stream.columns import Ragged
from tq_stream.errors import SerializationError
from tq_stream.framefile import dump, load
from tq_stream.serialization import VERSION, decode, encode

TORCH_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]
NUMPY_DTYPES = ["bool", "int8", "uint8", "int16", "uint32", "int64", "float16", "float32", "<f8"]
NUMPY_DTYPES += [">i4", ">f8", "complex64", "complex128", "uint64"]

pytestmark = pytest.mark.timeout(60)


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (works for dtypes without ==, e.g. float8)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    raw = [t.contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
    return torch.equal(raw[0], raw[1])


def same(a, b) -> bool:
    """Deep equality that also compares tensor/array dtypes and container types."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return same_tensor(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, Ragged):
        return same_tensor(a.values, b.values) and same_tensor(a.offsets, b.offsets)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


def roundtrip(obj, as_type=bytes):
    return decode([as_type(f) for f in encode(obj)])


def address(buf) -> tuple[int, int]:
    """[start, end) address range of a buffer."""
    arr = np.frombuffer(buf, dtype=np.uint8)
    return arr.ctypes.data, arr.ctypes.data + arr.nbytes


def make_tensor(dtype: torch.dtype, shape=(3, 4)) -> torch.Tensor:
    if dtype.is_floating_point and dtype.itemsize == 1:  # float8: no arange
        return torch.randn(shape).to(dtype)
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype)
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    return torch.arange(math.prod(shape)).reshape(shape).to(dtype)


# ------------------------------------------------------------------ round trips


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("frame_type", [bytes, bytearray, memoryview])
def test_tensor_roundtrip_every_dtype(dtype, frame_type):
    t = make_tensor(dtype)
    out = roundtrip({"x": t}, frame_type)
    assert same_tensor(out["x"], t)


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_ndarray_roundtrip_every_dtype(dtype):
    a = (np.arange(12) % 2).astype(dtype).reshape(3, 4)
    out = roundtrip([a])[0]
    assert isinstance(out, np.ndarray)
    assert same(out, a)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.zeros(0),
        torch.zeros(0, 5, dtype=torch.bfloat16),
        torch.zeros(3, 0, dtype=torch.int8),
        torch.tensor(2.5),  # 0-d
        torch.tensor(True),
        torch.arange(20.0).reshape(4, 5).t(),  # transposed
        torch.arange(20).reshape(4, 5)[::2, 1:4],  # strided slice with offset
        torch.arange(10.0)[3:],  # storage offset, contiguous
        torch.randn(2, 3, dtype=torch.complex64).conj(),  # lazy conjugate
        torch.ones(3, requires_grad=True),
        torch.randn(4, 6).to(torch.bfloat16)[:, ::3],
    ],
    ids=lambda t: f"{t.dtype}{list(t.shape)}",
)
def test_tensor_roundtrip_shapes_and_layouts(tensor):
    out = roundtrip(tensor)
    assert same_tensor(out, tensor.detach().resolve_conj())
    assert out.is_contiguous()


def test_ndarray_zero_size_zero_dim_and_non_contiguous():
    cases = [np.zeros((0, 3), np.float32), np.array(7, np.int16), np.arange(20).reshape(4, 5).T]
    for a in cases:
        out = roundtrip(a)
        assert out.shape == a.shape and out.dtype == a.dtype
        assert np.array_equal(out, a)


def test_nested_structure_with_all_leaf_kinds():
    ragged = Ragged.from_list([torch.arange(3), torch.arange(0), torch.arange(2)])
    obj = {
        "str": "héllo",
        "int": -(2**63),
        "uint": 2**64 - 1,
        "float": 1.5,
        "nan": float("nan"),
        "bool": [True, False],
        "none": None,
        "bytes": b"\x00\xff",
        "empty": {"d": {}, "l": [], "t": ()},
        "tuple": (1, ("a", (2.0, None)), [3]),
        "tensors": [torch.ones(2), {"deep": torch.zeros(1, dtype=torch.int64)}],
        "tuple_of_tensors": (torch.ones(1), np.ones(2)),
        "ragged": ragged,
        "ragged_2d": Ragged(torch.ones(5, 3, dtype=torch.bfloat16), torch.tensor([0, 2, 5])),
        "array": np.arange(6, dtype=np.int32).reshape(2, 3),
    }
    assert same(roundtrip(obj), obj)
    assert same(roundtrip(obj, bytearray), obj)


def test_tuples_are_preserved_and_lists_stay_lists():
    out = roundtrip({"shape": (2, 3), "keys": ["a", "b"], "pair": ((1,), [()])})
    assert out == {"shape": (2, 3), "keys": ["a", "b"], "pair": ((1,), [()])}
    assert type(out["pair"][1]) is list and type(out["pair"][1][0]) is tuple


def test_subclasses_of_plain_types_decode_as_the_plain_type():
    class Color(enum.Enum):
        RED = "red"

    class Level(enum.IntEnum):
        HIGH = 3

    Point = collections.namedtuple("Point", "x y")
    obj = {
        "ordered": collections.OrderedDict(a=1),
        "point": Point(1, 2),
        "color": Color.RED,
        "level": Level.HIGH,
        "buf": bytearray(b"ab"),
        "view": memoryview(b"cd"),
    }
    out = roundtrip(obj)
    assert (out.pop("buf"), out.pop("view")) == (b"ab", b"cd")  # bytes-like come back as bytes
    assert out == {"ordered": {"a": 1}, "point": (1, 2), "color": "red", "level": 3}
    assert type(out["ordered"]) is dict and type(out["point"]) is tuple


def test_frame_layout_header_then_one_raw_frame_per_tensor():
    t, a = torch.arange(6, dtype=torch.int32), np.zeros(3, np.float64)
    frames = encode({"t": t, "l": [a, "x"], "r": Ragged.from_list([t, t])})
    assert len(frames) == 1 + 2 + 2  # header, t, a, ragged values + offsets
    assert isinstance(frames[0], bytes)
    header = msgspec.msgpack.decode(frames[0])
    assert header[:3] == ["tqs", VERSION, 5]
    assert [memoryview(f).nbytes for f in frames[1:3]] == [24, 24]


def test_zmq_frames_are_accepted():
    t = torch.randn(4, 4)
    frames = [zmq.Frame(bytes(f)) for f in encode({"t": t})]
    assert torch.equal(decode(frames)["t"], t)


# ------------------------------------------------------------------ zero copy


def test_encode_does_not_copy_contiguous_tensors_or_arrays():
    t = torch.arange(1000, dtype=torch.float32)
    bf = torch.ones(10, 10, dtype=torch.bfloat16)
    a = np.arange(50, dtype=np.int64)
    frames = encode([t, bf, a])
    assert address(frames[1])[0] == t.data_ptr()
    assert address(frames[2])[0] == bf.data_ptr()
    assert address(frames[3])[0] == a.ctypes.data


def test_decode_builds_tensors_inside_the_received_buffer():
    t = torch.randn(64, 32).to(torch.bfloat16)
    a = np.arange(100, dtype=np.float32)
    header, *buffers = encode({"t": t, "a": a})
    received = [bytearray(b) for b in buffers]
    out = decode([header, *received])
    start, end = address(received[0])
    assert start <= out["t"].data_ptr() < end
    assert out["a"].ctypes.data == address(received[1])[0]
    received[0][:2] = b"\x00\x00"  # shared memory: a write to the frame shows in the tensor
    assert out["t"].reshape(-1)[0].item() == 0.0


def test_decoded_tensor_keeps_its_buffer_alive():
    t = torch.arange(100000, dtype=torch.int64)
    header, buf = encode(t)
    received = bytearray(buf)
    out = decode([header, received])
    del received, buf
    assert torch.equal(out, t)


def test_read_only_frames_decode_without_warnings():
    frames = [bytes(f) for f in encode({"t": torch.ones(3), "a": np.ones(3)})]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = decode(frames)
    assert torch.equal(out["t"], torch.ones(3))
    assert not out["a"].flags.writeable  # numpy keeps read-only memory read-only


def test_large_message_is_copy_free():
    tensors = {f"f{i}": torch.empty(1024, 8192, dtype=torch.float32) for i in range(9)}
    frames = encode(tensors)
    assert len(frames) == 1 + len(tensors)  # one raw frame per tensor, beside the header
    out = decode(frames)
    for name, t in tensors.items():
        assert out[name].data_ptr() == t.data_ptr()  # neither side copied 302 MB


# ------------------------------------------------------------------ unsupported values


@dataclass
class Point:
    x: int


UNSUPPORTED = {  # what to encode -> words the error message must contain
    "object": (lambda: object(), "object"),
    "set": (lambda: {1, 2}, "set"),
    "dataclass": (lambda: Point(1), "Point"),
    "numpy scalar": (lambda: np.float32(1.0), "numpy scalar"),
    "numpy float64 scalar": (lambda: np.float64(1.0), r"\.item\(\)"),
    "str array": (lambda: np.array(["a", "b"]), "dtype"),
    "object array": (lambda: np.array([object()]), "dtype"),
    "structured array": (lambda: np.zeros(2, dtype=[("a", "i4")]), "dtype"),
    "complex32": (lambda: torch.zeros(4, dtype=torch.int8).view(torch.complex32), "dtype"),
    "sparse": (lambda: torch.zeros(3).to_sparse(), "strided"),
    "int key": (lambda: {1: "int key"}, "keys must be str"),
    "function": (lambda: {"k": len}, "builtin_function"),
    "int beyond 64 bits": (lambda: 2**64, "encode"),
    "ragged of lists": (lambda: Ragged([1, 2], [0, 2]), "Ragged"),
}


@pytest.mark.parametrize("case", UNSUPPORTED)
def test_unsupported_values_raise(case):
    make, words = UNSUPPORTED[case]
    with pytest.raises(SerializationError, match=words):
        encode({"field": [make()]})


@pytest.mark.parametrize("case", ["numpy scalar", "int key", "function", "set", "dataclass",
                                  "int beyond 64 bits"])
def test_unsupported_values_inside_a_column_of_dicts_raise(case):
    make, words = UNSUPPORTED[case]
    with pytest.raises(SerializationError, match=words):
        encode({"field": [{"ok": 1}, {"v": make()}, ["x"]]})


def test_a_column_of_flat_dicts_and_lists_roundtrips_as_written():
    rows = [{"acc": 1.0, "turns": 3, "src": "a", "none": None, "raw": b"x"}, [1, "two", True],
            "s", 4, {"pair": (1, 2)}, {}, [], ({"k": 1},)]
    out = roundtrip({"col": rows})
    assert out == {"col": rows}
    assert type(out["col"][4]["pair"]) is tuple and type(out["col"][7]) is tuple


def test_too_deep_nesting_raises():
    obj: list = []
    for _ in range(200):
        obj = [obj, torch.zeros(1)]
    with pytest.raises(SerializationError, match="nested deeper"):
        encode(obj)


# ------------------------------------------------------------------ malformed messages


def header(*parts) -> bytes:
    return msgspec.msgpack.encode(list(parts))


def ext(code: int, payload) -> msgspec.msgpack.Ext:
    return msgspec.msgpack.Ext(code, msgspec.msgpack.encode(payload))


@pytest.mark.parametrize(
    "frames, words",
    [
        ([], "no frames"),
        ([b""], "malformed"),
        ([b"\xc1"], "malformed"),
        ([b"garbage bytes"], "malformed"),
        ([msgspec.msgpack.encode({"a": 1})], "malformed"),
        ([header("tqs", 1, 1)], "not a tq_stream message"),
        ([header("xyz", 1, 1, None)], "not a tq_stream message"),
        ([header("tqs", 99, 1, None)], "version 99"),
        # a bad envelope is named even when its body would fail to decode too
        ([header("tqs", 4, 1, ext(6, ["<f4", [0, 2**63], b""]))], "format version 4"),
        ([header("tqs", 1, 2, ext(6, ["<f4", [0, 2**63], b""]))], "announces 2 frames"),
        ([header("tqs", "1", 1, None)], "malformed"),
        ([header("tqs", 1, 2, None)], "announces 2 frames, got 1"),
        ([header("tqs", 1, 2, None), b"x"], "not referenced"),
        ([header("tqs", 1, 1, ext(9, 0))], "unknown ext type 9"),
        ([header("tqs", 1, 2, ext(1, ["float33", [1], 4, 1])), bytes(4)], "dtype 'float33'"),
        ([header("tqs", 1, 2, ext(2, ["O", [1], 8, 1])), bytes(8)], "dtype 'O'"),
        ([header("tqs", 1, 2, ext(1, ["float32", [2], 4, 1])), bytes(4)], "takes 8 bytes"),
        ([header("tqs", 1, 2, ext(1, ["float32", [-1], -4, 1])), bytes(4)], "invalid shape"),
        ([header("tqs", 1, 2, ext(1, ["float32", [2], 8, 1])), bytes(4)], "has 4 bytes"),
        ([header("tqs", 1, 2, ext(1, ["float32", [1], 4, 5])), bytes(4)], "frame 5"),
        ([header("tqs", 1, 2, ext(1, ["float32", [1], 4, 0])), bytes(4)], "frame 0"),
        ([header("tqs", 1, 2, [ext(1, ["int8", [1], 1, 1])] * 2), b"x"], "used twice"),
        ([header("tqs", 1, 1, ext(1, "not a list"))], "malformed"),
        ([header("tqs", 1, 1, ext(3, [1, 2]))], "malformed"),
        ([header("tqs", 1, 1, ext(4, {"a": 1}))], "tuple payload"),
        ([header("tqs", 1, 1, None), 42], "frame 1 must be bytes-like"),
        ([123], "frame 0 must be bytes-like"),
    ],
)
def test_malformed_messages_raise_serialization_error(frames, words):
    with pytest.raises(SerializationError, match=words):
        decode(frames)


def test_ragged_of_arrays_is_rejected():
    values = ext(2, ["<f4", [1], 4, 1])
    offsets = ext(2, ["<i8", [2], 16, 2])
    frames = [header("tqs", 1, 3, ext(3, [values, offsets])), bytes(4), bytes(16)]
    with pytest.raises(SerializationError, match="two tensors"):
        decode(frames)


def test_deeply_nested_garbage_raises_serialization_error():
    body = b"\x91" * 100_000 + b"\xc0"  # 100k nested one-element arrays
    with pytest.raises(SerializationError):
        decode([b"\x94\xa3tqs\x01\x01" + body])


VALID = encode(
    {"t": torch.arange(12.0).reshape(3, 4), "r": Ragged.from_list([torch.ones(2)]), "s": ("x", 1)}
)


@pytest.mark.parametrize("cut", range(len(VALID[0])))
def test_every_truncation_of_a_valid_header_raises(cut):
    with pytest.raises(SerializationError):
        decode([VALID[0][:cut], *VALID[1:]])


def test_dropped_added_and_shortened_frames_raise():
    frames = [bytes(f) for f in VALID]
    for bad in (frames[:-1], [*frames, b""], [frames[0], *frames[2:]], frames + frames[1:]):
        with pytest.raises(SerializationError, match="frames"):
            decode(bad)
    with pytest.raises(SerializationError, match="bytes"):
        decode([frames[0], frames[1][:-1], *frames[2:]])


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.lists(st.binary(max_size=200), max_size=5))
def test_fuzz_random_frames_raise_only_serialization_error(frames):
    try:
        decode(frames)
    except SerializationError:
        pass


@FUZZ
@given(st.data())
def test_fuzz_mutated_valid_messages_raise_only_serialization_error(data):
    frames = [bytearray(f) for f in VALID]
    i = data.draw(st.integers(0, len(frames) - 1))
    if frames[i]:
        pos = data.draw(st.integers(0, len(frames[i]) - 1))
        frames[i][pos] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        frames.insert(data.draw(st.integers(0, len(frames))), bytearray(data.draw(st.binary())))
    if data.draw(st.booleans()) and len(frames) > 1:
        del frames[data.draw(st.integers(0, len(frames) - 1))]
    try:
        decode(frames)
    except SerializationError:
        pass


@FUZZ
@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**64 - 1)
        | st.floats()
        | st.text()
        | st.binary(),
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.tuples(inner, inner)
            | st.dictionaries(st.text(max_size=5), inner, max_size=4)
        ),
        max_leaves=20,
    )
)
def test_fuzz_plain_values_roundtrip(value):
    assert same(roundtrip(value), value)


# ------------------------------------------------------------------ files


def test_dump_load_roundtrip(tmp_path):
    obj = {"t": torch.randn(5, 7).to(torch.bfloat16), "a": np.arange(9), "meta": ("v", 1)}
    path = tmp_path / "ckpt.tqs"
    dump(obj, path)
    assert same(load(path), obj)
    loaded = load(str(path), mmap=True)
    assert same(loaded, obj)
    loaded["t"].zero_()  # copy-on-write: the file is unchanged
    assert same(load(path), obj)
    assert os.listdir(tmp_path) == ["ckpt.tqs"]  # no temporary file left behind


def test_dump_aligns_every_buffer_to_64_bytes(tmp_path):
    path = tmp_path / "x.tqs"
    dump([torch.ones(3, dtype=torch.int8), torch.ones(5)], path)
    raw = path.read_bytes()
    count = int.from_bytes(raw[8:16], "little")
    offsets = [int.from_bytes(raw[16 + 24 * i : 24 + 24 * i], "little") for i in range(count)]
    assert count == 3 and all(o % 64 == 0 for o in offsets)


def test_dump_replaces_atomically_and_failed_dump_keeps_old_file(tmp_path):
    path = tmp_path / "state.tqs"
    dump({"v": 1}, path)
    dump({"v": 2}, path)
    assert load(path) == {"v": 2}
    with pytest.raises(SerializationError):
        dump({"v": object()}, path)
    assert load(path) == {"v": 2}
    assert os.listdir(tmp_path) == ["state.tqs"]


@pytest.mark.parametrize("mmap", [False, True])
def test_load_rejects_corrupt_files(tmp_path, mmap):
    path = tmp_path / "x.tqs"
    dump({"t": torch.ones(100)}, path)
    raw = path.read_bytes()
    for bad, words in [
        (b"", "too short"),
        (b"NOTADUMP" + raw[8:], "not a tq_stream dump"),
        (raw[:-10], "truncated"),
        (raw[:8] + (10**9).to_bytes(8, "little") + raw[16:], "announces"),
    ]:
        path.write_bytes(bad)
        with pytest.raises(SerializationError, match=words):
            load(path, mmap=mmap)


@pytest.mark.parametrize("array", [
    np.array([7], dtype=np.int64), np.arange(64, dtype=np.int64), np.zeros(0, np.int64),
    np.arange(20, dtype=np.int64)[::3], np.array([-(2**63), 2**63 - 1], dtype=np.int64),
    np.array([3], dtype=np.int32), np.array([-(2**31), 2**31 - 1], dtype=np.int32),
])
def test_small_int_vectors_inline_roundtrip_as_private_writable_arrays(array):
    frames = encode({"index": array}, inline=4096)
    assert len(frames) == 1  # inline: no buffer frame
    buf = bytearray(frames[0])
    got = decode([buf])["index"]
    assert got.dtype == array.dtype and got.shape == array.shape and np.array_equal(got, array)
    buf[:] = bytes(len(buf))  # the receive buffer is reused for the next message
    assert np.array_equal(got, array) and got.flags.writeable
    if array.size:  # without inline: its own frame, as before
        assert len(encode({"index": array})) == 2


@pytest.mark.parametrize("payload", [b"q" + b"\x01" * 7, b"i\x01\x02", b"", b"f" + bytes(8)])
def test_a_malformed_int_vector_payload_raises(payload):
    header = msgspec.msgpack.encode(["tqs", VERSION, 1, msgspec.msgpack.Ext(7, payload)])
    with pytest.raises(SerializationError, match="dtype letter"):
        decode([header])


def test_lazy_conjugate_and_negated_views_are_sent_with_their_values():
    v = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    f = torch.tensor([1.5, -2.5])
    got = decode([bytes(x) for x in encode({"c": v.conj(), "f": torch._neg_view(f)})])
    assert got["c"].tolist() == [1 - 2j, 3 + 4j] and got["f"].tolist() == [-1.5, 2.5]


def test_messages_of_format_version_1_are_still_read():
    """Version 2 added ext 7 (a reader that knows only 1 says "unsupported format
    version 2"); what a version-1 writer sent, or a file it dumped, reads as before."""
    body = {"index": msgspec.msgpack.Ext(7, b"q" + (5).to_bytes(8, "little")), "n": 1}
    got = decode([msgspec.msgpack.encode(["tqs", 1, 1, body])])
    assert got["index"].tolist() == [5] and got["n"] == 1
    assert decode([msgspec.msgpack.encode(["tqs", 2, 1, body])])["n"] == 1  # nor does 2's
    assert msgspec.msgpack.decode(bytes(encode({"a": 1})[0]))[1] == VERSION == 3
