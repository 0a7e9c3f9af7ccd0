"""len(loader) / len(dataset): known for closed partitions or a declared epoch."""

from __future__ import annotations

import threading

import pytest
import torch

import tq_stream as tq
from tq_stream.datasets.length import steps_for_rows
from tq_stream.errors import ConfigError, LengthUnknownError
from tq_stream.samplers import PartitionSampler

P = "train"


def put(stream, n, partition=P, prefix="k"):
    stream.writer(partition).put([f"{prefix}{i}" for i in range(n)], {"x": torch.arange(n)})


def make(stream, batch_size=4, **kw) -> tq.StreamingDataLoader:
    return tq.StreamingDataLoader(tq.StreamingDataset(stream, kw.pop("partition", P), "t",
                                                      ["x"], batch_size, timeout=5, **kw))


def test_open_partition_has_no_length(stream):
    put(stream, 8)
    loader = make(stream)
    with pytest.raises(TypeError, match="must be closed .* or the dataset must declare "
                                        "rows_per_epoch=N") as e:
        len(loader)
    assert isinstance(e.value, LengthUnknownError)
    assert bool(loader) and bool(loader.dataset)  # truthiness does not ask for len()
    with pytest.raises(LengthUnknownError, match="'nothing_yet' must be closed"):
        len(make(stream, partition="nothing_yet"))


@pytest.mark.parametrize("rows, drop_last, expected", [(20, False, 5), (22, False, 6),
                                                       (22, True, 5), (3, False, 1)])
def test_closed_partition_length_matches_the_batches(stream, rows, drop_last, expected):
    put(stream, rows)
    stream.close_partition(P)
    loader = make(stream, drop_last=drop_last)
    assert len(loader) == len(loader.dataset) == expected
    n = 0
    for _ in loader:
        n += 1
        assert len(loader) == expected  # steps formed + steps left: constant while reading
    assert n == expected and len(loader) == expected


def test_closed_partition_length_with_two_ranks(stream):
    put(stream, 23)  # 2 full steps of 2 x 4 rows, then 7 rows: a short step of 3 + 3
    stream.close_partition(P)
    counts = {}

    def rank(r):
        ld = make(stream, dp_rank=r, dp_size=2)
        counts[r] = (len(ld), sum(1 for _ in ld))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert counts == {0: (3, 3), 1: (3, 3)}


def test_declared_epoch_sets_the_length_and_ends_each_pass(stream):
    put(stream, 40)  # still open: more rows may come
    loader = make(stream, rows_per_epoch=10)  # ceil(10 / 4) = 3 steps an epoch
    assert len(loader) == 3
    first = [tq.batch_meta(b).keys for b in loader]
    second = [tq.batch_meta(b).keys for b in loader]
    assert len(first) == len(second) == 3
    keys = [k for ks in first + second for k in ks]
    assert keys == [f"k{i}" for i in range(24)]  # the second epoch continues the stream
    assert len(make(stream, rows_per_epoch=10, drop_last=True)) == 2
    with pytest.raises(ConfigError, match="rows_per_epoch must be an int >= 1, got 0"):
        make(stream, rows_per_epoch=0)


def test_partition_sampler_length_is_the_sum(stream):
    put(stream, 8, "a", "a")
    put(stream, 6, "b", "b")
    for p in ("a", "b"):
        stream.close_partition(p)
    loader = make(stream, batch_size=2, partition=None,
                  sampler=PartitionSampler(weights={"a": 1, "b": 1}))
    assert len(loader) == 7
    assert sum(1 for _ in loader) == 7


def test_steps_for_rows():
    assert steps_for_rows(0, 4, 2, False) == 0
    assert steps_for_rows(9, 4, 2, False) == 1  # 1 row left: fewer than one per rank
    assert steps_for_rows(10, 4, 2, False) == 2
    assert steps_for_rows(10, 4, 2, True) == 1
