"""ReadyQueue: oldest-ready first, returned rows in front, lazy deletion, compaction."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tq_stream.controller.fifo import ReadyQueue


def arr(*r: int) -> np.ndarray:
    return np.asarray(r, dtype=np.int64)


def test_order_and_remove():
    q = ReadyQueue(10)
    q.push(arr(3, 1, 4))
    q.push(arr(5))
    q.remove(arr(1))
    assert q.ordered().tolist() == [3, 4, 5] and q.count == 3
    assert q.ordered(limit=2).tolist() == [3, 4]


def test_returned_rows_come_first():
    q = ReadyQueue(10)
    q.push(arr(0, 1, 2, 3))
    q.remove(arr(0, 1))          # leased
    q.push(arr(1, 0), front=True)  # handed back
    assert q.ordered().tolist() == [1, 0, 2, 3]
    assert q.ordered(limit=1).tolist() == [1]
    q.remove(arr(1))
    q.push(arr(1))               # a row pushed again is valid only at its newest place
    assert q.ordered().tolist() == [0, 2, 3, 1]


def test_compaction_keeps_order_and_bounds_memory():
    q = ReadyQueue(100_000)
    live: list[int] = []
    for i in range(0, 60_000, 600):
        rows = np.arange(i, i + 600, dtype=np.int64)
        q.push(rows)
        live += rows.tolist()
        gone = np.asarray(live[:550], dtype=np.int64)
        q.remove(gone)
        live = live[550:]
        assert q.ordered(limit=5).tolist() == live[:5]
    assert q.ordered().tolist() == live and q.count == len(live)
    assert q.rows.shape[0] <= 8 * max(len(live), 1024)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["push", "push_row", "front", "remove", "order",
                                           "oldest"]),
                          st.lists(st.integers(0, 40), max_size=6, unique=True)),
                max_size=60))
def test_matches_a_list_model(ops):
    q = ReadyQueue(41)
    front: list[int] = []
    back: list[int] = []
    for op, rows in ops:
        avail = set(front) | set(back)
        if op == "push_row":  # the one-row push (a one-row put's offer)
            rows = [r for r in rows if r not in avail][:1]
            for r in rows:
                q.push_row(r)
            back.extend(rows)
        elif op == "oldest":  # ordered(1) as an int, without arrays (a one-row step)
            assert q.oldest() == (front + back or [None])[0]
        elif op in ("push", "front"):
            rows = [r for r in rows if r not in avail]
            q.push(np.asarray(rows, dtype=np.int64), front=op == "front")
            (front if op == "front" else back).extend(rows)
        elif op == "remove":
            q.remove(np.asarray(rows, dtype=np.int64))
            front = [r for r in front if r not in rows]
            back = [r for r in back if r not in rows]
        else:
            limit = len(rows) or None
            want = (front + back)[:limit] if limit else front + back
            assert q.ordered(limit).tolist() == want
        assert q.count == len(front) + len(back) == int(q.avail.sum())
    assert q.ordered().tolist() == front + back


def test_oldest_skips_an_entry_of_a_row_that_was_pushed_again():
    q = ReadyQueue(8)
    q.push(np.asarray([1, 2], dtype=np.int64))
    q.remove(np.asarray([1], dtype=np.int64))  # the one-row remove
    q.push_row(1)  # back again, now behind 2: its old entry is stale
    assert q.oldest() == 2 and q.ordered().tolist() == [2, 1]
    q.remove(np.asarray([2], dtype=np.int64))
    assert q.oldest() == 1 and q.count == 1
    q.remove(np.asarray([1], dtype=np.int64))
    assert q.oldest() is None and q.count == 0
