"""The end of a closed partition for a pool of workers (``get_meta(step=None)``): two
live workers that each hold a share and ask for the next batch (a worker fetching ahead,
or two loaders of one task) do not wait for each other; a worker still waits for a share
whose holder may have died; and a wait that runs out because another live session holds
rows names that holder, its rows and steps, and the lease's age. Embedded mode;
tests/integration/controller/test_claims_local.py replays the two workers as processes."""

from __future__ import annotations

import threading

import pytest

import tq_stream as tq
from tests.conftest import keys_of, put_rows
from tq_stream.errors import WaitTimeout

P = "train"


def closed_pool(stream: tq.Stream, rows: int = 4) -> None:
    stream.create_partition(P, consumers=["reward"])
    put_rows(stream, keys_of("k", rows))
    stream.close_partition(P)
    stream.client().register_task(P, "reward", ["x"], batch_size=2)


def test_two_workers_each_holding_a_share_both_reach_the_end(stream):
    """The replay: each worker holds one batch and asks for the next before acking it;
    both waited for the other's share until their timeout (WaitTimeout)."""
    closed_pool(stream)
    workers = [tq.Client(stream.connection, consumer="reward") for _ in range(2)]
    held = [w.get_meta(P, "reward") for w in workers]
    assert {m.step for m in held} == {0, 1}
    got: dict[int, object] = {}

    def ask_next(i: int) -> None:
        try:
            got[i] = workers[i].get_meta(P, "reward", timeout=5.0)
            workers[i].ack(held[i])  # a worker acks the batch it trained after fetching
        except Exception as exc:  # noqa: BLE001 — checked below
            got[i] = exc

    threads = [threading.Thread(target=ask_next, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert all(isinstance(m, tq.BatchMeta) and m.end for m in got.values()), got
    assert stream.stats()[P]["rows"] == 0


def test_a_wait_for_a_live_holders_share_names_the_holder(stream):
    """A worker at the end waits while another live worker trains its batch; if that
    outlasts the timeout, the WaitTimeout says who holds what, and since when."""
    closed_pool(stream)
    slow = tq.Client(stream.connection, consumer="critic")
    held = slow.get_meta(P, "reward")
    fast = tq.Client(stream.connection, consumer="reward")
    fast.ack(fast.get_meta(P, "reward"))
    with pytest.raises(WaitTimeout) as err:
        fast.get_meta(P, "reward", timeout=0.3)
    text = str(err.value)
    assert slow.session[:12] in text and "'critic'" in text, text
    assert f"step {held.step}" in text and "2 rows" in text and "lease age" in text, text
    slow.ack(held)
    assert fast.get_meta(P, "reward", timeout=5.0).end
