"""One regression test per trap of the delivery issue, in embedded mode
(tests/integration/controller/test_delivery_local.py replays them across processes)."""

from __future__ import annotations

import gc
import threading
import warnings

import numpy as np
import pytest

import tq_stream as tq
from tests.conftest import keys_of, put_rows
from tq_stream.errors import ConfigError, LeaseError, WaitTimeout
from tq_stream.samplers import Candidates, Sampler, Selection

P = "train"


# 1. no silent loss when a task registers late -----------------------------------------
def test_a_task_registered_late_gets_every_row(stream):
    stream.create_partition(P, consumers=["old_logp", "update_actor"])
    put_rows(stream, keys_of("k", 4))
    c = stream.client()
    c.register_task(P, "old_logp", ["x"], batch_size=4)
    c.ack(c.get_meta(P, "old_logp", 0))
    assert stream.stats()[P]["held"] == {"old_logp": 0, "update_actor": 4}
    c.register_task(P, "update_actor", ["x"], batch_size=4)  # after the ack
    meta = c.get_meta(P, "update_actor", 0, timeout=1.0)
    assert sorted(meta.keys) == keys_of("k", 4)
    c.ack(meta)
    assert stream.stats()[P]["rows"] == 0  # every declared consumer acked: freed


def test_undeclared_partitions_keep_rows_until_cleared(stream):
    put_rows(stream, keys_of("k", 2))
    c = stream.client()
    c.register_task(P, "a", ["x"], batch_size=2)
    c.ack(c.get_meta(P, "a", 0))
    assert stream.stats()[P]["rows"] == 2 and stream.stats()[P]["held"] == {"undeclared": 2}
    c.register_task(P, "b", ["x"], batch_size=2)
    assert sorted(c.get_meta(P, "b", 0).keys) == keys_of("k", 2)
    assert stream.kv.clear(keys_of("k", 2), partition=P) == 2
    assert stream.stats()[P]["rows"] == 0


def test_undeclared_task_is_refused_naming_the_consumers(stream):
    stream.create_partition(P, consumers=["old_logp", "update_actor"])
    with pytest.raises(ConfigError, match=r"declared consumers \['old_logp', "
                                          r"'update_actor'\].*got 'critic'"):
        stream.client().register_task(P, "critic", ["x"], batch_size=1)
    with pytest.raises(ConfigError, match="declared once"):
        stream.create_partition(P, consumers=["other"])
    with pytest.raises(ConfigError, match="consumers must be a non-empty list"):
        stream.create_partition("q", consumers="old_logp")


# 2. leases live as long as their consumer -----------------------------------------------
def test_a_slow_step_keeps_its_lease(stream):
    """A step longer than lease_timeout: the heartbeat renews the lease, so the rows are
    neither handed out again nor is the next iteration's ack refused."""
    stream.create_partition(P, consumers=["actor"])
    put_rows(stream, keys_of("k", 4))
    stream.close_partition(P)
    ds = tq.StreamingDataset(stream, P, "actor", ["x"], batch_size=2, lease_timeout=0.2,
                             timeout=5.0)
    loader = tq.StreamingDataLoader(ds)
    seen = []
    for batch in loader:
        seen += tq.batch_meta(batch).keys
        threading.Event().wait(0.6)  # three lease timeouts of "training"
    assert sorted(seen) == keys_of("k", 4)  # each row once
    st = stream.stats()[P]["tasks"]["actor"]
    assert st["expired"] == 0 and st["redelivered"] == 0 and st["renewed"] > 0


def test_a_dead_consumers_rows_come_back(stream, clock):
    put_rows(stream, keys_of("k", 2))
    c = stream.client()
    c.register_task(P, "t", ["x"], batch_size=2, lease_timeout=5.0)
    dead = tq.Client(stream.connection)
    held = dead.get_meta(P, "t", None)
    for hold in dead._holds.values():
        hold.close()  # its process "died": the heartbeat stops renewing
    clock.advance(6)
    again = c.get_meta(P, "t", None, timeout=0.1)
    assert again.keys == held.keys and again.step == held.step
    assert stream.stats()[P]["tasks"]["t"]["expired"] == 2  # rows


def test_a_replica_acking_twice_counts_once(stream):
    stream.create_partition(P, consumers=["t"])
    put_rows(stream, keys_of("k", 2))
    c = stream.client()
    c.register_task(P, "t", ["x"], batch_size=2, replicas=2)
    m = c.get_meta(P, "t", 0, replica=0)
    assert c.ack(m) == 0 and c.ack(m) == 0
    assert stream.stats()[P]["rows"] == 2  # still waiting for replica 1
    assert c.ack(c.get_meta(P, "t", 0, replica=1)) == 2


def test_an_ack_sent_again_after_its_step_finished_is_a_no_op(stream):
    """A loader whose ack was interrupted (the reply lost) sends it again; by then every
    rank had acked the step and it is gone: nothing to do, not a LeaseError."""
    put_rows(stream, keys_of("k", 4))
    c = stream.client()
    c.register_task(P, "t", ["x"], batch_size=2)
    m = c.get_meta(P, "t", 0)
    assert c.ack(m) == 2 and c.ack(m) == 0
    assert stream.stats()[P]["tasks"]["t"]["acked"] == 2
    never = c.get_meta(P, "t", 1)
    with pytest.raises(LeaseError, match="step 5 of task 't' is not open"):
        stream.connection.controller().ack(  # a step never formed
            partition=P, task="t", step=5, dp_rank=0, index=never.index,
            generation=never.generation)


def test_replicas_stay_identical_when_a_lease_expires_after_one_acked(stream, clock):
    put_rows(stream, keys_of("k", 8))
    c = stream.client()
    c.register_task(P, "t", ["x"], batch_size=2, replicas=2, lease_timeout=5.0)
    first = c.get_meta(P, "t", 0, replica=0)
    c.ack(first)
    dead = tq.Client(stream.connection)
    dead.get_meta(P, "t", 0, replica=1)  # replica 1 dies holding step 0
    for hold in dead._holds.values():
        hold.close()  # no heartbeat any more
    clock.advance(6)
    assert c.get_meta(P, "t", 0, replica=1).keys == first.keys


# 3. redelivery without knowing step numbers --------------------------------------------
def test_a_fresh_loader_resumes_at_the_first_unfinished_step(stream):
    put_rows(stream, keys_of("k", 8))
    stream.close_partition(P)

    def loader():
        return tq.StreamingDataLoader(tq.StreamingDataset(stream, P, "t", ["x"],
                                                          batch_size=2, timeout=2.0))

    old = loader()
    it = iter(old)
    seen = [tq.batch_meta(next(it)).keys, tq.batch_meta(next(it)).keys]  # step 0 acked
    saved = old.state_dict()
    seen.append(tq.batch_meta(next(it)).keys)  # acks step 1 after the save
    del it, old  # "crash" holding step 2; a fresh loader takes over at once
    fresh = loader()
    rest = [tq.batch_meta(b).keys for b in fresh]
    assert rest[0] == seen[2]  # leased, not acked: delivered again
    assert sorted(k for b in seen + rest[1:] for k in b) == keys_of("k", 8)
    restored = loader()
    restored.load_state_dict(saved)  # an older state: acked since, so nothing comes
    assert list(restored) == []
    assert stream.stats()[P]["tasks"]["t"]["first_unacked"] == [4]  # the end step


def test_next_batch_for_me_pool(stream, clock):
    """Stage workers each take the next batch: never the same rows; a restarted worker
    (same consumer name) resumes where the dead one stopped, once its lease expired
    (before, the predecessor may be alive: issue 20 item 5)."""
    put_rows(stream, keys_of("k", 8))
    stream.client().register_task(P, "stage", ["x"], batch_size=2, lease_timeout=5.0)
    a, b = stream.client("w0"), stream.client("w1")
    ma, mb = a.get_meta(P, "stage"), b.get_meta(P, "stage")
    assert not set(ma.keys) & set(mb.keys)
    for hold in a._holds.values():
        hold.close()  # a's process "died": its heartbeat stops
    restarted = stream.client("w0")
    early = restarted.get_meta(P, "stage")
    assert not set(early.keys) & (set(ma.keys) | set(mb.keys))
    clock.advance(6)
    b.renew(mb)
    restarted.renew(early)
    assert restarted.get_meta(P, "stage").keys == ma.keys
    b.ack(mb)
    assert not set(b.get_meta(P, "stage").keys) & (set(ma.keys) | set(mb.keys))


def test_release_then_timeout_message_is_consistent(stream):
    put_rows(stream, keys_of("k", 4))
    c = stream.client()
    c.register_task(P, "t", ["x"], batch_size=2, dp_size=2)
    c.release(c.get_meta(P, "t", 0, dp_rank=0))
    with pytest.raises(WaitTimeout, match="0 rows ready, 4 needed"):
        c.get_meta(P, "t", 1, dp_rank=0, timeout=0.05)
    assert c.get_meta(P, "t", 0, dp_rank=0, timeout=0.05).step == 0


# 4. samplers wait for the tags they read -------------------------------------------------
def test_dynamic_filter_waits_for_a_reward_set_later(stream):
    stream.create_partition(P, consumers=["actor"])
    keys = keys_of("k", 4)
    put_rows(stream, keys, tags=[{"uid": "g0"}] * 2 + [{"uid": "g1"}] * 2)
    sampler = tq.samplers.DynamicFilterSampler(tq.samplers.GroupSampler(2), reward_tag="reward")
    c = stream.client()
    c.register_task(P, "actor", ["x"], batch_size=2, sampler=sampler)
    with pytest.raises(WaitTimeout, match=r"tag\(s\) \['reward'\]"):
        c.get_meta(P, "actor", 0, timeout=0.05)
    assert stream.stats()[P]["tasks"]["actor"]["discarded"] == {}
    stream.set_tags(P, keys, [{"reward": r} for r in (1.0, 0.0, 1.0, 1.0)])  # g1 all equal
    meta = c.get_meta(P, "actor", 0, timeout=1.0)
    assert sorted(meta.keys) == ["k0", "k1"]
    assert stream.stats()[P]["tasks"]["actor"]["discarded"] == {"zero_variance": 2}


class PositiveReward(Sampler):
    def required_tags(self):
        return ("reward",)

    def sample(self, candidates: Candidates, batch_size: int) -> Selection:
        good = candidates.tag("reward") > 0
        if np.count_nonzero(good) < batch_size * candidates.dp_size:
            return Selection.wait({"non_positive_reward": candidates.index[~good]})
        return Selection.split(candidates.index[good][: batch_size * candidates.dp_size],
                               candidates.dp_size)


def test_readme_sampler_runs_when_the_trainer_starts_first(stream):
    ds = tq.StreamingDataset(stream, P, "t", ["x"], batch_size=1, sampler=PositiveReward(),
                             timeout=2.0)
    got = []
    th = threading.Thread(target=lambda: got.extend(tq.batch_meta(b).keys for b in
                                                    tq.StreamingDataLoader(ds)))
    th.start()
    put_rows(stream, ["a", "b"], tags=[{"reward": 1}, {"reward": -1}])
    stream.close_partition(P)
    th.join(5)
    assert got == [("a",)]


def test_tags_no_candidate_has_read_as_missing():
    cands = Candidates.from_arrays(np.arange(3), {})
    assert np.isnan(cands.tag("reward")).all()


# 6. errors that help ----------------------------------------------------------------------
def test_timeout_counts_complete_groups(stream):
    put_rows(stream, keys_of("k", 4), tags=[{"uid": "g0"}] * 4)
    c = stream.client()
    c.register_task(P, "t", ["x"], batch_size=8, sampler=tq.samplers.GroupSampler(4))
    with pytest.raises(WaitTimeout, match=r"timeout=0.05 s.*1 complete group of 4 ready "
                                          r"\(4 rows\), 2 needed"):
        c.get_meta(P, "t", 0, timeout=0.05)


def test_unknown_field_is_named(stream):
    put_rows(stream, ["a"])
    c = stream.client()
    c.register_task(P, "t", ["rewrad"], batch_size=1)
    with pytest.raises(WaitTimeout, match=r"\[.rewrad.\] were never written.*fields: \[.x.\]"):
        c.get_meta(P, "t", 0, timeout=0.05)


def test_a_misspelt_partition_is_named_with_the_partitions_written_to(stream):
    # A new user's typo waited the whole timeout and said only "0 rows ready".
    put_rows(stream, ["a"])
    ds = tq.StreamingDataset(stream, "trian", "t", ["x"], batch_size=1, timeout=0.05)
    with pytest.raises(WaitTimeout, match=r"no row was ever written to partition 'trian' "
                                          r"\(partitions written to: \['train'\]\)"):
        next(iter(ds))


def test_group_batch_mismatch_is_rejected_when_the_dataset_is_built(stream):
    with pytest.raises(ConfigError, match="multiple of group_size=4.*batch_size=6"):
        tq.StreamingDataset(stream, P, "t", ["x"], batch_size=6,
                            sampler=tq.samplers.GroupSampler(group_size=4))


def test_no_exception_ignored_on_close_or_collection(stream):
    put_rows(stream, keys_of("k", 4))
    ds = tq.StreamingDataset(stream, P, "t", ["x"], batch_size=1, timeout=2.0)
    it = iter(tq.StreamingDataLoader(ds))
    next(it)
    raw = iter(tq.StreamingDataset(stream, P, "u", ["x"], batch_size=1, timeout=2.0))
    next(raw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hooked = []
        import sys
        old = sys.unraisablehook
        sys.unraisablehook = hooked.append
        try:
            stream.close()
            del it, raw
            gc.collect()
        finally:
            sys.unraisablehook = old
    assert hooked == []


def test_lease_error_names_where_to_resume(stream):
    put_rows(stream, keys_of("k", 2))
    c = stream.client()
    c.register_task(P, "t", ["x"], batch_size=1)
    c.ack(c.get_meta(P, "t", 0))
    with pytest.raises(LeaseError, match="resumes at step 1"):
        c.get_meta(P, "t", 0)


def test_set_version_before_the_task_registers(stream):
    ds = tq.StreamingDataset(stream, P, "t", ["x"], batch_size=1)
    loader = tq.StreamingDataLoader(ds)
    loader.set_version(7)
    put_rows(stream, ["a"])
    next(iter(loader))
    assert stream.stats()[P]["tasks"]["t"]["version"] == 7


def test_ack_and_release_of_none_are_config_errors(stream):
    c = stream.client()
    with pytest.raises(ConfigError, match="BatchMeta from get_meta, got None"):
        c.ack(None)
    with pytest.raises(ConfigError, match="BatchMeta from get_meta, got None"):
        c.release(None)

