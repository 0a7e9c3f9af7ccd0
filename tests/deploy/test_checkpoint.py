"""stream.save(path) + tq.init(restore=path): rows, tags, schemas and consumption survive."""

from __future__ import annotations

import pytest
import torch

import tq_stream as tq
from tests.conftest import assert_same_snapshot, keys_of, nested, snapshot
from tq_stream.errors import ConfigError, StateError

P = "train"


def fill(stream: tq.Stream, n: int = 12) -> list[str]:
    keys = keys_of("k", n)
    stream.create_partition(P, capacity=64)
    stream.writer(P).put(keys, {
        "x": torch.arange(n * 2, dtype=torch.float32).reshape(n, 2),
        "r": nested([torch.arange(i % 4 + 1) for i in range(n)]),
        "s": [f"row{i}" for i in range(n)],
    }, tags=[{"uid": f"g{i // 2}", "v": i, "w": i / 2} for i in range(n)])
    stream.writer(P).put(keys[:4], {"reward": torch.ones(4)}, tags=[{"late": True}] * 4)
    return keys


def make_loader(stream: tq.Stream) -> tq.StreamingDataLoader:
    return tq.StreamingDataLoader(tq.StreamingDataset(
        stream, P, "actor", ["x", "r", "s"], batch_size=2, timeout=3.0, prefetch=2))


def test_save_and_restore(tmp_path):
    path = str(tmp_path / "ckpt.tq")
    with tq.init() as stream:
        keys = fill(stream)
        ld = make_loader(stream)
        acked = []
        for i, batch in enumerate(ld):
            acked += tq.batch_meta(batch).keys
            if i == 1:
                break
        ld.ack()  # steps 0 and 1 acked (state_dict acks nothing)
        state = ld.state_dict()  # prefetched steps were handed back when the loop broke
        client = stream.client()
        leased = client.get_meta(P, "actor", state["step"])  # step 2 leased, never acked
        before = snapshot(stream)
        fields_before = stream.stats()[P]["fields"]
        stream.save(path)

    with tq.init(restore=path) as stream:
        assert_same_snapshot(before, snapshot(stream))  # rows, tags, fields, values
        assert stream.stats()[P]["fields"] == fields_before
        assert stream.stats()[P]["capacity"] == 64
        with pytest.raises(ConfigError, match="checkpointed settings"):
            tq.StreamingDataLoader(tq.StreamingDataset(
                stream, P, "actor", ["x"], batch_size=2)).dataset.register()
        stream.close_partition(P)
        resumed = make_loader(stream)
        resumed.load_state_dict(state)
        batches = [tq.batch_meta(b).keys for b in resumed]
        assert batches[0] == leased.keys  # the unacked lease is delivered again first
        later = [k for b in batches for k in b]
        assert not set(later) & set(acked)  # acked rows never come again
        assert sorted(acked + later) == sorted(keys)
        assert stream.stats()[P]["tasks"]["actor"]["acked"] == len(keys)


def test_restore_keeps_schemas_enforced(tmp_path):
    path = str(tmp_path / "ckpt.tq")
    with tq.init() as stream:
        fill(stream, 4)
        stream.save(path)
    with tq.init(restore=path) as stream:
        with pytest.raises(tq.errors.SchemaError, match="'x'"):
            stream.writer(P).put(["new"], {"x": torch.ones(1, 3)})
        stream.writer(P).put(["new"], {"x": torch.ones(1, 2), "r": nested([torch.ones(
            2, dtype=torch.int64)]), "s": ["n"]})
        assert stream.kv.get("new", partition=P)["s"] == "n"


def test_save_needs_the_owning_stream_and_restore_a_checkpoint(tmp_path):
    with tq.init() as stream:
        handle = tq.Stream(stream.connection)
        with pytest.raises(StateError, match="tq.init"):
            handle.save(str(tmp_path / "x"))
    bogus = tmp_path / "bogus"
    bogus.write_bytes(b"not a checkpoint")
    with pytest.raises(tq.errors.TQError):
        tq.init(restore=str(bogus))
