"""A replica resumes at the first step *it* has not acked (found by the GRPO example:
replica 1 re-read, or was refused with LeaseError, a step it had acked itself while
its peer had not yet)."""

from __future__ import annotations

import tq_stream as tq
from tests.conftest import keys_of, put_rows

P = "train"


def test_first_unfinished_per_replica(stream):
    put_rows(stream, keys_of("k", 4))
    c = stream.client()
    c.register_task(P, "t", ["x"], batch_size=2, replicas=2)
    c.ack(c.get_meta(P, "t", 0, replica=1))  # replica 1 done with step 0, replica 0 not
    assert c.first_unfinished(P, "t", replica=1)["step"] == 1
    assert c.first_unfinished(P, "t", replica=0)["step"] == 0
    assert c.first_unfinished(P, "t")["step"] == 0  # no replica: the rank as a whole


def test_a_restored_replica_does_not_read_its_acked_step_again(stream):
    """Both replicas stop holding step 0 unacked and are restored from their state
    dicts: each acks step 0 first, and neither trains it again, whatever the order."""
    put_rows(stream, keys_of("k", 6))
    stream.close_partition(P)

    def loader(replica: int) -> tq.StreamingDataLoader:
        return tq.StreamingDataLoader(tq.StreamingDataset(
            stream, P, "t", ["x"], batch_size=2, replicas=2, replica=replica, timeout=2.0))

    states = []
    for r in (0, 1):
        old = loader(r)
        first = next(iter(old))
        assert tq.batch_meta(first).step == 0
        states.append(old.state_dict())  # step 0 yielded (trained), not acked
        del old, first
    restored = [loader(r) for r in (0, 1)]
    for r in (1, 0):  # replica 1 restores first: replica 0 has not acked step 0 yet
        restored[r].load_state_dict(states[r])
    got1 = [tq.batch_meta(b).step for b in restored[1]]
    got0 = [tq.batch_meta(b).step for b in restored[0]]
    assert got1 == got0 == [1, 2]
