"""A cancelled session's claims end with the cancel: its shares go back (counted in
``cancelled``), its consumer names are kept for a restarted worker, and nothing
depends on how many cancelled sessions the controller remembers (``MAX_CANCELLED``).
Before, a cancelled session's claims only counted as not live while its id was in
that bounded memory; once it fell out, they were live again and their shares were
never handed to anyone else (until a lease that its heartbeat kept renewing ran out)."""

from __future__ import annotations

import tq_stream as tq
from tests.conftest import keys_of, put_rows
from tq_stream.controller.consuming import MAX_CANCELLED

P = "train"


def many_cancels(stream: tq.Stream) -> None:
    """More cancelled sessions than the controller remembers."""
    for _ in range(MAX_CANCELLED + 8):
        stream.client().cancel()


def test_a_cancelled_sessions_share_goes_back_after_many_more_cancels(stream):
    put_rows(stream, keys_of("k", 4))
    reader = stream.client()
    reader.register_task(P, "t", ["x"], batch_size=2)
    held = reader.get_meta(P, "t", 0)
    reader.cancel()  # its loader stopped; the process (and its heartbeat) lives on
    task = stream.stats()[P]["tasks"]["t"]
    assert task["cancelled"] == 2 and task["claimed"] == 0 and task["leases"] == []
    many_cancels(stream)
    again = stream.client().get_meta(P, "t", 0, timeout=1.0)
    assert again.keys == held.keys


def test_a_restarted_worker_gets_its_cancelled_predecessors_share_back(stream):
    put_rows(stream, keys_of("k", 8))
    stream.client().register_task(P, "reward", ["x"], batch_size=2)
    old = tq.Client(stream.connection, consumer="reward")
    held = old.get_meta(P, "reward")
    tq.Client(stream.connection, consumer="critic").get_meta(P, "reward")  # another live share
    old.cancel()
    many_cancels(stream)
    new = tq.Client(stream.connection, consumer="reward")
    assert new.get_meta(P, "reward", timeout=1.0).step == held.step  # its name first
