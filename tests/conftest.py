"""Shared fixtures of the core tests: an embedded stream, a fake clock, small data builders."""

from __future__ import annotations

import gc
import time as _time
from collections.abc import Iterator, Sequence

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import tq_stream as tq
from tq_stream.controller import Controller


@pytest.fixture(autouse=True)
def _collect_own_garbage() -> Iterator[None]:
    """A test's cyclic garbage is collected as it ends, on the main thread, then frozen
    with what survives (later collections skip it: cheap). Left to chance, a collection
    ran in a later test's server thread while it held that test's controller lock, and
    a dropped DataLoader iterator's ``__del__`` joined its workers there for 10 s (the
    commit of tests/integration/controller/test_early_answers_controller.py timed out
    in the full suite, never alone)."""
    yield
    gc.collect()
    gc.freeze()


@pytest.fixture
def stream() -> Iterator[tq.Stream]:
    """An embedded stream (short default timeout), closed at teardown."""
    s = tq.init(config=tq.StreamConfig(timeout=5.0))
    try:
        yield s
    finally:
        s.close()


class FakeClock:
    """Wall-clock seconds a controller reads for leases, reservations and write times
    (handed to it: ``Controller(clock=clock.time)`` or ``set_clock``); its waits stay
    bounded by the real ``time.monotonic``. ``advance`` moves time forward."""

    def __init__(self) -> None:
        self.now = _time.time()

    def time(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(stream: tq.Stream) -> FakeClock:
    """A FakeClock the embedded ``stream``'s controller reads."""
    c = FakeClock()
    ctrl = stream.connection.controller()
    assert isinstance(ctrl, Controller)  # embedded: the controller itself
    ctrl.set_clock(c.time)
    return c


# ------------------------------------------------------------------ data builders


def keys_of(prefix: str, n: int, start: int = 0) -> list[str]:
    return [f"{prefix}{i}" for i in range(start, start + n)]


def key_values(keys: Sequence[str]) -> torch.Tensor:
    """A float per key, derived from the key, so a test can check which row it got."""
    return torch.tensor([float(sum(map(ord, k)) * 1000 + len(k)) for k in keys])


def dense_batch(keys: Sequence[str], width: int = 4) -> TensorDict:
    """``x``: [n, width] float rows whose first column identifies the key."""
    n = len(keys)
    x = torch.zeros(n, width)
    x[:, 0] = key_values(keys)
    return TensorDict({"x": x}, [n])


def ragged_rows(n: int, seed: int = 0, max_len: int = 7) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (n,), generator=gen).tolist()
    return [torch.arange(k, dtype=torch.int64) + 100 * i for i, k in enumerate(lengths)]


def nested(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.nested_tensor(rows, layout=torch.jagged)


def group_tags(keys: Sequence[str], group_size: int) -> list[dict]:
    return [{"uid": f"g{i // group_size}"} for i in range(len(keys))]


def put_rows(stream: tq.Stream, keys: Sequence[str], partition: str = "train",
             tags: list | None = None) -> None:
    """Write rows of a dense ``x`` field (plus tags)."""
    stream.writer(partition).put(list(keys), dense_batch(keys), tags=tags)


def snapshot(stream: tq.Stream, partition: str = "train") -> tuple[list, dict]:
    """Everything stored in ``partition``: kv.list() and every row's values."""
    rows = stream.kv.list(partition=partition)
    values = {}
    for r in rows:
        got = stream.kv.get(r["key"], partition=partition)
        values[r["key"]] = {f: v.clone() if isinstance(v, torch.Tensor) else v
                            for f, v in got.items()}
    return rows, values


def assert_same_snapshot(a: tuple[list, dict], b: tuple[list, dict]) -> None:
    assert a[0] == b[0]
    assert a[1].keys() == b[1].keys()
    for key, fields in a[1].items():
        other = b[1][key]
        assert fields.keys() == other.keys(), key
        for f, v in fields.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, other[f]), (key, f)
            else:
                assert v == other[f], (key, f)


def as_set(meta: tq.BatchMeta) -> set[str]:
    return set(meta.keys)


def rows_array(meta: tq.BatchMeta) -> np.ndarray:
    return np.asarray(meta.index)
