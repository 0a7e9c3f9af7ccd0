"""Who may read a share: a share claimed by a live session never goes to another live
session; a dead one's (lease expired, or its session cancelled) goes to whoever asks
next, and first to a restarted worker of the same ``consumer`` name. Embedded mode;
tests/integration/controller/test_claims_local.py replays these across processes (issue 20,
items 3, 5 and 8)."""

from __future__ import annotations

import gc
import threading
import time

import pytest

import tq_stream as tq
from tests.conftest import keys_of, put_rows
from tq_stream.errors import ConfigError, LeaseError, ReplicaClash

P = "train"


def die(client: tq.Client) -> None:
    """The client's process "died": its heartbeat stops renewing its leases."""
    for hold in client._holds.values():
        hold.close()


# item 3: TP/PP peers -------------------------------------------------------------------
def test_replicas_without_replica_are_refused_naming_the_argument(stream):
    with pytest.raises(ConfigError, match=r"replica must be given .*replicas=2.*got None"):
        tq.StreamingDataset(stream, P, "t", ["x"], batch_size=2, replicas=2)
    put_rows(stream, keys_of("k", 4))
    c = stream.client()
    c.register_task(P, "t", ["x"], batch_size=2, replicas=2)
    with pytest.raises(ConfigError, match=r"replica must be given .*replicas=2"):
        c.get_meta(P, "t", 0)
    assert stream.stats()[P]["tasks"]["t"]["claimed"] == 0  # refused before any claim
    solo = tq.StreamingDataset(stream, P, "solo", ["x"], batch_size=2)  # replicas=1
    assert solo.replica == 0


def test_two_live_sessions_claiming_one_replica_are_refused(stream):
    put_rows(stream, keys_of("k", 4))
    a, b = stream.client(), stream.client()
    a.register_task(P, "t", ["x"], batch_size=2, replicas=2)
    held = a.get_meta(P, "t", 0, replica=0)
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"replica=0 .*rank 0 .*step 0 .*live session"):
        b.get_meta(P, "t", 0, replica=0, timeout=0.3)
    assert time.monotonic() - t0 < 5.0
    assert b.get_meta(P, "t", 0, replica=1).keys == held.keys  # its own replica: fine
    assert a.get_meta(P, "t", 0, replica=0).keys == held.keys  # the holder itself: fine
    assert a.ack(held) == 0
    with pytest.raises(LeaseError, match=r"replica 0 of rank 0 .*acked .*replica="):
        b.get_meta(P, "t", 0, replica=0, timeout=0.3)  # acked by that replica: not again


def test_a_duplicate_replica_waiting_is_refused_once_the_holder_acks(stream):
    """The second peer of one replica waits while the first trains, and is refused
    (not handed the step again) when the first acks."""
    put_rows(stream, keys_of("k", 4))
    a, b = stream.client(), stream.client()
    a.register_task(P, "t", ["x"], batch_size=2, replicas=2)
    held = a.get_meta(P, "t", 0, replica=1)
    errors: list[Exception] = []

    def second() -> None:
        try:
            b.get_meta(P, "t", 0, replica=1, timeout=10.0)
        except Exception as exc:  # noqa: BLE001 — checked below
            errors.append(exc)

    th = threading.Thread(target=second)
    th.start()
    time.sleep(0.3)
    a.ack(held)
    th.join(10)
    assert not th.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], LeaseError), errors
    assert "replica=" in str(errors[0])


def test_tp_peers_that_forgot_replicas_are_told_how_to_declare_them(stream):
    """Found by a README-only user: two TP peers of rank 0 with neither replicas= nor
    replica= raced; the one that lost got a LeaseError that named neither. Now a
    ReplicaClash (a LeaseError) that names both."""
    put_rows(stream, keys_of("k", 4))
    a, b = stream.client(), stream.client()
    a.register_task(P, "t", ["x"], batch_size=2, dp_size=2)
    a.ack(a.get_meta(P, "t", 0, dp_rank=0))
    with pytest.raises(ReplicaClash, match=r"acked by every replica.*replicas=.*replica="):
        b.get_meta(P, "t", 0, dp_rank=0, timeout=0.3)
    a.ack(a.get_meta(P, "t", 0, dp_rank=1))
    with pytest.raises(ReplicaClash,
                       match=r"acked by every rank \(each of its replicas\).*replicas=.*replica="):
        b.get_meta(P, "t", 0, dp_rank=0, timeout=0.3)


def test_a_restarted_replica_takes_its_step_back_once_the_dead_lease_lapsed(stream):
    put_rows(stream, keys_of("k", 4))
    c = stream.client()
    c.register_task(P, "t", ["x"], batch_size=2, replicas=2, lease_timeout=0.5)
    dead = stream.client()
    held = dead.get_meta(P, "t", 0, replica=1)
    die(dead)
    again = stream.client().get_meta(P, "t", 0, replica=1, timeout=10.0)  # waits ~0.5 s
    assert again.keys == held.keys and again.step == 0


def test_a_loader_iterated_again_takes_back_its_own_replica_at_once(stream):
    """A loop left by break: the next iteration (a new session) re-reads the unacked
    rest at once; the first iteration's session was cancelled when it stopped."""
    stream.create_partition(P, consumers=["t"])
    put_rows(stream, keys_of("k", 8))
    stream.close_partition(P)
    for r in (0, 1):
        ds = tq.StreamingDataset(stream, P, "t", ["x"], batch_size=2, replicas=2,
                                 replica=r, timeout=2.0)
        loader = tq.StreamingDataLoader(ds)
        seen = []
        for batch in loader:
            seen += tq.batch_meta(batch).keys
            break
        seen += [k for b in loader for k in tq.batch_meta(b).keys]
        assert sorted(seen) == keys_of("k", 8)
    assert stream.stats()[P]["rows"] == 0


# item 5: workers sharing a consumer name -----------------------------------------------
def test_live_workers_sharing_a_consumer_name_get_different_rows(stream):
    stream.create_partition(P, consumers=["reward"])
    put_rows(stream, keys_of("k", 8))
    stream.client().register_task(P, "reward", ["x"], batch_size=2)
    a = tq.Client(stream.connection, consumer="reward")
    b = tq.Client(stream.connection, consumer="reward")
    ma, mb = a.get_meta(P, "reward"), b.get_meta(P, "reward")
    assert ma.step != mb.step and not set(ma.keys) & set(mb.keys)
    assert a.ack(ma) == 2
    b.get_data(mb)  # not freed under b's feet
    assert b.ack(mb) == 2


def test_a_restarted_worker_takes_back_what_its_dead_predecessor_held(stream, clock):
    put_rows(stream, keys_of("k", 8))
    stream.client().register_task(P, "reward", ["x"], batch_size=2, lease_timeout=5.0)
    old = tq.Client(stream.connection, consumer="reward")
    held = old.get_meta(P, "reward")
    other = tq.Client(stream.connection, consumer="critic")
    theirs = other.get_meta(P, "reward")
    die(old)
    new = tq.Client(stream.connection, consumer="reward")
    early = new.get_meta(P, "reward")  # old may still be alive: not its share
    assert early.step not in (held.step, theirs.step)
    clock.advance(6)
    other.renew(theirs)  # alive: its heartbeat
    new.renew(early)
    again = new.get_meta(P, "reward")
    assert again.step == held.step and again.keys == held.keys
    assert tq.Client(stream.connection, consumer="reward").get_meta(P, "reward").step not in (
        held.step, theirs.step, early.step)


# item 8: a fresh loader after a gap ----------------------------------------------------
def test_a_fresh_loader_after_a_gap_gets_the_unfinished_step_and_ends(stream, clock):
    stream.create_partition(P, consumers=["t"])
    put_rows(stream, keys_of("k", 8))
    stream.close_partition(P)
    c = stream.client()
    c.register_task(P, "t", ["x"], batch_size=2, lease_timeout=5.0)
    dead = stream.client()
    held = dead.get_meta(P, "t", 0)
    die(dead)
    for s in (1, 2, 3):
        c.ack(c.get_meta(P, "t", s))
    assert c.first_unfinished(P, "t") == {"step": 0, "skip": [1, 2, 3]}
    clock.advance(6)
    ds = tq.StreamingDataset(stream, P, "t", ["x"], batch_size=2, lease_timeout=5.0,
                             timeout=2.0)
    got = [tq.batch_meta(b) for b in tq.StreamingDataLoader(ds)]
    assert [m.step for m in got] == [0] and got[0].keys == held.keys
    assert stream.stats()[P]["rows"] == 0


def test_a_fresh_loader_after_a_gap_goes_on_with_new_steps(stream, clock):
    put_rows(stream, keys_of("k", 8))
    c = stream.client()
    c.register_task(P, "t", ["x"], batch_size=2, lease_timeout=5.0)
    dead = stream.client()
    held = dead.get_meta(P, "t", 0)
    die(dead)
    c.ack(c.get_meta(P, "t", 1))
    clock.advance(6)
    put_rows(stream, keys_of("m", 4))
    stream.close_partition(P)
    ds = tq.StreamingDataset(stream, P, "t", ["x"], batch_size=2, lease_timeout=5.0,
                             timeout=2.0)
    got = [tq.batch_meta(b) for b in tq.StreamingDataLoader(ds)]
    assert [m.step for m in got] == [0, 2, 3, 4, 5]
    assert got[0].keys == held.keys
    assert sorted(k for m in got[1:] for k in m.keys) == keys_of("k", 4, 4) + keys_of("m", 4)


def test_expired_rows_come_back_to_the_next_pool_worker(stream, clock):
    put_rows(stream, keys_of("k", 4))
    stream.client().register_task(P, "t", ["x"], batch_size=2, lease_timeout=5.0)
    dead = tq.Client(stream.connection, consumer="w1")
    held = dead.get_meta(P, "t")
    die(dead)
    live = tq.Client(stream.connection, consumer="w2")
    nxt = live.get_meta(P, "t")
    live.ack(nxt)
    clock.advance(6)
    assert live.get_meta(P, "t", timeout=0.5).keys == held.keys  # whoever asks next


def test_a_pool_worker_at_the_end_waits_for_a_dead_workers_share(stream):
    """A closed partition: the live worker's next batch is not the end while a dead
    worker's share may come back; it gets that share once the lease expired (this is
    what Ray mode showed: the waiting worker got the end, and the rows never came)."""
    stream.create_partition(P, consumers=["t"])
    put_rows(stream, keys_of("k", 4))
    stream.close_partition(P)
    stream.client().register_task(P, "t", ["x"], batch_size=2, lease_timeout=0.5)
    dead = tq.Client(stream.connection, consumer="w1")
    held = dead.get_meta(P, "t")
    die(dead)
    live = tq.Client(stream.connection, consumer="w2")
    live.ack(live.get_meta(P, "t"))
    again = live.get_meta(P, "t", timeout=10.0)  # waits ~0.5 s, not the end
    assert not again.end and again.keys == held.keys
    live.ack(again)
    assert live.get_meta(P, "t", timeout=1.0).end
    assert stream.stats()[P]["rows"] == 0


def test_a_stale_release_does_not_drop_another_sessions_claim(stream):
    """Review: A cancelled, B took the share over, A's late release must not hand B's
    share to a third reader (one share, two live consumers)."""
    put_rows(stream, keys_of("k", 4))
    a, b, c = stream.client(), stream.client(), stream.client()
    a.register_task(P, "t", ["x"], batch_size=2)
    meta_a = a.get_meta(P, "t", 0, timeout=5)
    a.cancel()  # A stopped: its claim is no longer live
    meta_b = b.get_meta(P, "t", 0, timeout=5)
    assert meta_b.keys == meta_a.keys
    with pytest.raises(LeaseError, match="session must hold the claim it releases"):
        a.release(meta_a)
    with pytest.raises(ConfigError, match="held by another live session"):
        c.get_meta(P, "t", 0, timeout=0.3)
    b.release(meta_b)  # its own claim: released
    assert c.get_meta(P, "t", 0, timeout=5).keys == meta_b.keys


def test_a_closed_partition_ends_after_a_version_set_at_a_step(stream):
    """Review: set_version(at_step=0) and nobody reporting the step read held the end
    of a closed partition back for a predicted version (it waited forever)."""
    put_rows(stream, keys_of("k", 16))
    stream.close_partition(P)
    c = stream.client()
    c.register_task(P, "t", ["x"], batch_size=4)
    c.set_version(P, "t", 5, at_step=0)
    steps = []
    while True:
        meta = c.get_meta(P, "t", timeout=5)
        if meta.end:
            break
        steps.append(meta.step)
        c.ack(meta)
    assert steps == [0, 1, 2, 3]


def test_renewing_a_step_renews_only_the_callers_claims(stream, clock):
    """Review: renew(step=) renewed every claim on the step, so a live replica's renewal
    kept a dead peer's claim alive (its rows never came back)."""
    put_rows(stream, keys_of("k", 4))
    a, dead = stream.client(), stream.client()
    a.register_task(P, "t", ["x"], batch_size=2, replicas=2, lease_timeout=5.0)
    mine = a.get_meta(P, "t", 0, replica=0)
    theirs = dead.get_meta(P, "t", 0, replica=1)
    die(dead)
    clock.advance(4)
    a.renew(mine)  # the live replica renews its own claim
    clock.advance(2)  # past the dead peer's lease, within the renewed one
    again = stream.client().get_meta(P, "t", 0, replica=1, timeout=2.0)
    assert again.keys == mine.keys  # the dead peer's share came back
    with pytest.raises(ConfigError, match="held by another live session"):
        stream.client().get_meta(P, "t", 0, replica=0, timeout=0.3)
    with pytest.raises(LeaseError, match=r"renew .*session"):
        dead.renew(theirs)  # its claim was taken over: nothing of its own to renew


def test_a_dropped_client_stops_renewing_and_its_share_comes_back():
    """A client dropped while it holds a batch (no cancel(), no close(): a worker object
    that goes away) stops renewing like a dead process (leases.py: a Hold ends when it
    is garbage-collected), so its share comes back after lease_timeout. The heartbeat
    thread used to keep every Hold it had seen alive in a local list, renewing it for
    good: the share never came back and a closed partition never ended. Found by
    tests/api/test_model_public_api.py."""
    with tq.init(lease_timeout=0.3, config=tq.StreamConfig(timeout=5.0)) as s:
        put_rows(s, keys_of("k", 2))
        a = s.client(consumer="w")
        a.register_task(P, "t", ["x"], batch_size=2)
        held = a.get_meta(P, "t")
        time.sleep(0.2)  # it works on the batch over a few heartbeats (every 0.075 s)
        del a
        gc.collect()
        b = s.client(consumer="w")
        assert b.get_meta(P, "t", timeout=5.0).keys == held.keys
