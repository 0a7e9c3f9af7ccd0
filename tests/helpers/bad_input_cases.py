"""The last bad-input gaps (issue 11, item 7), as cases both modes run.

Each case is ``(id, call, error, match)``: ``call(stream)`` must raise ``error`` (a
TQError) whose message matches ``match`` (argument, rule and value), and leave
``stream.stats()`` and the partitions exactly as they were.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import tq_stream as tq
from tq_stream.errors import ConfigError, SchemaError

P = "gaps"


def _sparse_csr() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "sparse CSR support is in beta"
        return torch.ones(2, 3).to_sparse_csr()


def _put(partition: str, data: dict[str, Any]) -> Callable[[tq.Stream], Any]:
    return lambda s: s.writer(partition).put([f"n{i}" for i in range(2)], data)


CASES: list[tuple[str, Callable[[tq.Stream], Any], type, str]] = [
    ("meta tensor", _put(P, {"x": torch.ones(2, 3, device="meta")}), SchemaError,
     r"field 'x' must be a tensor with data.*got a tensor on device meta"),
    ("meta tensor, new partition", _put("fresh", {"x": torch.ones(2, 3, device="meta")}),
     SchemaError, "device meta"),
    ("sparse coo", _put(P, {"x": torch.ones(2, 3).to_sparse()}), SchemaError,
     r"field 'x' must be a dense \(strided\) tensor, got layout torch.sparse_coo"),
    ("sparse csr", _put(P, {"x": _sparse_csr()}), SchemaError,
     "field 'x' must be a dense.*torch.sparse_csr"),
    ("sparse row", _put(P, {"r": [torch.ones(2).to_sparse(), torch.ones(1).to_sparse()]}),
     SchemaError, "field 'r' must be a dense.*sparse_coo"),
    ("ack None", lambda s: s.client().ack(None), ConfigError,
     "meta must be a BatchMeta from get_meta, got None"),
    ("release None", lambda s: s.client().release(None), ConfigError,
     "meta must be a BatchMeta from get_meta, got None"),
    ("renew str", lambda s: s.client().renew("step0"), ConfigError,
     "meta must be a BatchMeta from get_meta, got 'step0'"),
    ("sampler object", lambda s: s.client().register_task(P, "t2", ["x"], 2, sampler=object()),
     ConfigError, "sampler must be a tq_stream.samplers.Sampler, got <object"),
    ("timeout str", lambda s: s.client().get_meta(P, "t", 0, timeout="1"), ConfigError,
     "timeout must be a number of seconds > 0, got '1'"),
    ("timeout negative", lambda s: s.client().get_meta(P, "t", 0, timeout=-1), ConfigError,
     "timeout must be a number of seconds > 0, got -1"),
]


def fill(stream: tq.Stream) -> None:
    """Partition ``P`` with rows and a task ``t`` that has a step leased."""
    keys = [f"k{i}" for i in range(4)]
    stream.writer(P).put(keys, {"x": torch.arange(12.0).reshape(4, 3),
                                "r": [torch.ones(i + 1) for i in range(4)]})
    client = stream.client()
    client.register_task(P, "t", ["x"], batch_size=2)
    client.get_meta(P, "t", 0, timeout=5.0)


def observed(stream: tq.Stream) -> tuple[list[str], dict[str, Any]]:
    """What a rejected call must not change: partitions and stats (minus clocks: the
    time, ages and rates move by themselves)."""
    stats = stream.stats()
    for part in stats.values():
        for task in part["tasks"].values():
            for clock in ("at", "oldest_ready_age", "rates"):
                task.pop(clock, None)
            for lease in task.get("leases", []):
                for clock in ("age", "heartbeat_age", "expires_in"):
                    lease.pop(clock, None)
    return stream.connection.controller().partitions(), stats


def rejected_unchanged(stream: tq.Stream, call: Callable[[tq.Stream], Any], error: type,
                       match: str) -> None:
    """``call(stream)`` raises ``error`` matching ``match`` and changes nothing observed."""
    before = observed(stream)
    with pytest.raises(error, match=match):
        call(stream)
    assert observed(stream) == before


def restore_of_missing_path_fails(path: str, **init_args: Any) -> None:
    with pytest.raises(tq.errors.CheckpointError,
                       match="restore must name a checkpoint folder.*missing"):
        tq.init(restore=path, **init_args)


# dtypes torch cannot index_copy_ on CPU: stored as same-size ints, read back exactly.
ODD_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64]


def round_trip_odd_columns(stream: tq.Stream) -> None:
    """float8 / uint16-64 and zero-width fields go in and come back bit-exact, through
    the key-value API and a StreamingDataLoader."""
    n = 6
    keys = [f"o{i}" for i in range(n)]
    data = {f"d{i}": (torch.arange(n * 4, dtype=torch.float32).reshape(n, 4) / 8).to(d)
            for i, d in enumerate(ODD_DTYPES)}
    data["empty"] = torch.ones(n, 0)
    data["r16"] = [torch.arange(i + 1).to(torch.uint16) for i in range(n)]
    stream.writer("odd").put(keys, data)
    stream.writer("odd").put(["o0", "o5"], {"d0": data["d0"][[5, 0]]})  # overwrite 2 rows
    data["d0"] = data["d0"][[5, 1, 2, 3, 4, 0]]
    rev = list(range(n))[::-1]
    got = stream.kv.get_batch([keys[i] for i in rev], partition="odd")  # a gather
    for f, v in data.items():
        if isinstance(v, list):
            assert [t.tolist() for t in got[f].unbind()] == [v[i].tolist() for i in rev]
            continue
        want = v[torch.tensor(rev)]
        assert got[f].dtype == want.dtype and got[f].shape == want.shape, f
        assert bits(got[f]).equal(bits(want)), f
    stream.close_partition("odd")
    ds = tq.StreamingDataset(stream, "odd", "reader", list(data), batch_size=3, timeout=10.0)
    seen = []
    for batch in tq.StreamingDataLoader(ds):
        meta = tq.batch_meta(batch)
        pos = [int(k[1:]) for k in meta.keys]
        assert bits(batch["d1"]).equal(bits(data["d1"][pos]))
        assert batch["empty"].shape == (3, 0)
        seen += meta.keys
    assert sorted(seen) == keys


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (float8 has no torch.equal)."""
    return t.contiguous().view(torch.uint8)
