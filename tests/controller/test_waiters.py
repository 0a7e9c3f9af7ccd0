"""A commit forms the steps of waiting get_meta calls and gives them to their server
(``controller/waiters.py``, ``transport/answers.py``), in embedded mode: a test plays
the servers with ``answers.serving`` and hands each get_meta its request's handle as
a server's dispatcher does."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.conftest import keys_of, put_rows
from tests.helpers.rpc_handler import wait_until
from tq_stream.controller.waiters import Waiter
from tq_stream.errors import WaitTimeout
from tq_stream.handling import ANSWERED
from tq_stream.samplers import Candidates, Sampler, Selection
from tq_stream.transport.answers import serving
from tq_stream.transport.dispatch import Dispatcher
from tq_stream.transport.handler import Methods

P = "train"


def _wait_in_thread(ctrl, out, srv=None, reply_to=None, req_id=0, **kw):
    def run():
        try:
            if srv is None:
                out.append(ctrl.get_meta(P, "t", **kw))
            else:
                with serving(srv, reply_to, req_id) as box:
                    out.append(ctrl.get_meta(P, "t", reply=box.request, **kw))
        except Exception as exc:  # noqa: BLE001 — the test asserts on it
            out.append(exc)

    before = len(ctrl.waiters)
    th = threading.Thread(target=run, daemon=True)
    th.start()
    wait_until(lambda: len(ctrl.waiters) == before + 1)
    return th


@pytest.mark.parametrize("rows", [1, 3])  # the one-row commit and the general one
def test_a_commit_gives_each_waiting_rank_its_rows(stream, rows):
    stream.create_partition(P, consumers=["t"])
    stream.client().register_task(P, "t", ["x"], batch_size=rows, dp_size=2)
    ctrl, srv = stream.connection.controller(), object()
    got: list[list] = [[], []]
    threads = [_wait_in_thread(ctrl, got[r], srv, f"conn{r}", 10 + r, step=0, dp_rank=r,
                               timeout=10.0) for r in (0, 1)]
    with serving(srv, "producer", 99) as box:
        put_rows(stream, keys_of("k", 2 * rows))  # the producer's request
    given = {p.req_id: (p.reply_to, meta) for p, meta in box.replies}
    box.sent()  # the server sent the replies given: it wakes the waiting threads
    for th in threads:
        th.join(10)
    assert got == [[ANSWERED], [ANSWERED]]  # their server sends nothing for them
    assert sorted(given) == [10, 11]
    keys = [k for r in (0, 1) for k in given[10 + r][1].keys]
    assert given[10][0] == "conn0" and given[11][1].dp_rank == 1
    assert sorted(keys) == keys_of("k", 2 * rows)  # each row to exactly one rank
    assert len(ctrl.waiters) == 0
    wait = stream.stats()[P]["tasks"]["t"]["get_meta_wait"]
    assert wait["count"] == 2  # the waits are measured as before


def test_without_a_server_the_waiter_returns_the_step_the_commit_formed(stream):
    stream.create_partition(P, consumers=["t"])
    stream.client().register_task(P, "t", ["x"], batch_size=2)
    ctrl, got = stream.connection.controller(), []
    th = _wait_in_thread(ctrl, got, step=0, timeout=10.0)  # embedded: no server
    with serving(object(), "producer", 1) as box:  # a server the waiter is not on
        put_rows(stream, keys_of("k", 2))
    th.join(10)
    assert box.replies == [] and sorted(got[0].keys) == keys_of("k", 2)


def test_a_cancelled_or_late_waiter_is_not_answered(stream):
    stream.create_partition(P, consumers=["t"])
    stream.client().register_task(P, "t", ["x"], batch_size=1, dp_size=2)
    ctrl = stream.connection.controller()
    _, state = ctrl.book.task(P, "t")
    ctrl.cancel("gone")
    cancelled = Waiter(state, (0, 0, 0, "gone", ""), 0.0, float("inf"), None)
    late = Waiter(state, (0, 1, 0, "", ""), 0.0, 0.0, None)  # its deadline passed
    with ctrl.lock:
        ctrl.waiters.add(P, cancelled)
        ctrl.waiters.add(P, late)
    put_rows(stream, keys_of("k", 2))
    assert cancelled.meta is None and late.meta is None
    assert not ctrl.book.task(P, "t")[1].steps  # no step was formed for them


class Failing(Sampler):
    def sample(self, candidates: Candidates, batch_size: int) -> Selection:
        if candidates.count:
            raise ValueError("sampler bug")
        return Selection.wait({})


def test_a_sampler_error_reaches_the_waiter_not_the_producer(stream):
    stream.create_partition(P, consumers=["t"])
    stream.client().register_task(P, "t", ["x"], batch_size=1, sampler=Failing())
    ctrl, got = stream.connection.controller(), []
    srv = object()
    th = _wait_in_thread(ctrl, got, srv, "conn", 5, step=0, timeout=10.0)
    with serving(srv, "producer", 6) as box:
        stream.writer(P).put(["k"], {"x": torch.zeros(1, 4)})  # succeeds
    box.sent()
    th.join(10)
    assert box.replies == []
    assert isinstance(got[0], ValueError) and "sampler bug" in str(got[0])
    assert stream.kv.list(partition=P)[0]["key"] == "k"


def test_a_waiter_that_times_out_leaves_no_registration(stream):
    stream.create_partition(P, consumers=["t"])
    stream.client().register_task(P, "t", ["x"], batch_size=1)
    ctrl = stream.connection.controller()
    with pytest.raises(WaitTimeout):
        ctrl.get_meta(P, "t", 0, timeout=0.05)
    assert len(ctrl.waiters) == 0
    put_rows(stream, keys_of("k", 1))  # nothing to answer
    assert ctrl.get_meta(P, "t", 0, timeout=1.0).keys == ["k0"]


def test_a_get_meta_inside_another_handler_does_not_answer_that_handlers_caller(stream):
    """The reply handle a waiter holds is its own request's: the dispatcher hands a
    request's handle only to the method it calls (its table's ``replies``), so a get_meta
    called from inside another method's handler waits and returns its rows like a
    direct call."""
    stream.create_partition(P, consumers=["t"])
    stream.client().register_task(P, "t", ["x"], batch_size=1)
    ctrl, srv, got = stream.connection.controller(), object(), []

    class Outer:  # a handler of another method, which calls get_meta
        RPC_TABLE = Methods({"kv_batch_get"})

        def kv_batch_get(self):
            return ctrl.get_meta(P, "t", 0, timeout=10.0)

    def outer():  # a request of that method, run as a server runs it
        with serving(srv, "outer-conn", 1) as box:
            got.append(Dispatcher(Outer())("kv_batch_get", {}, box.request))

    th = threading.Thread(target=outer, daemon=True)
    th.start()
    wait_until(lambda: len(ctrl.waiters) == 1)
    with serving(srv, "producer", 2) as box:
        put_rows(stream, keys_of("k", 1))
    box.sent()
    th.join(10)
    assert box.replies == [] and got[0].keys == ["k0"]


def test_a_commit_that_forms_no_step_does_not_wake_the_waiters_to_look_again(stream):
    """The commit already tried every waiter: waking them would only repeat each try
    under the lock (twice the work of each commit that does not fill a batch)."""
    stream.create_partition(P, consumers=["t"])
    stream.client().register_task(P, "t", ["x"], batch_size=4)
    ctrl, got = stream.connection.controller(), []
    th = _wait_in_thread(ctrl, got, step=0, timeout=10.0)
    notify_all, wakes = ctrl.lock.notify_all, []

    def counted() -> None:
        wakes.append(threading.current_thread().name)
        notify_all()

    ctrl.lock.notify_all = counted  # every wake of the waiting thread goes through it
    for i in range(3):  # not a batch yet
        put_rows(stream, [f"k{i}"])
    assert wakes == []
    put_rows(stream, ["k3"])  # a batch: the commit forms it, the waiter returns it
    th.join(10)
    assert sorted(got[0].keys) == ["k0", "k1", "k2", "k3"] and len(wakes) == 1
