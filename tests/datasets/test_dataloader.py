"""StreamingDataLoader: prefetch, acks, minibatches, resume, end of stream, replicas."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import tq_stream as tq
from tests.conftest import group_tags, keys_of, nested, put_rows, ragged_rows
from tq_stream.errors import ConfigError, StateError

P = "train"


def loader(stream, task="actor", fields=("x",), batch_size=2, **kw) -> tq.StreamingDataLoader:
    kw.setdefault("timeout", 3.0)
    return tq.StreamingDataLoader(tq.StreamingDataset(stream, P, task, list(fields),
                                                      batch_size, **kw))


def task_stats(stream, task="actor") -> dict:
    return stream.stats()[P]["tasks"][task]


def wait_for(cond, seconds=3.0) -> bool:
    deadline = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_prefetch_and_ack_on_next_request(stream):
    put_rows(stream, keys_of("k", 12))
    ld = loader(stream, prefetch=2)
    it = iter(ld)
    first = next(it)
    assert len(tq.batch_meta(first)) == 2
    # the background thread leases the next `prefetch` steps while the first trains
    assert wait_for(lambda: task_stats(stream)["claimed"] == 2 * (1 + 2))
    assert task_stats(stream)["acked"] == 0  # not acked until the next batch is asked for
    second = next(it)
    assert task_stats(stream)["acked"] == 2
    assert not set(tq.batch_meta(first).keys) & set(tq.batch_meta(second).keys)
    it.close()  # not a break: `second` is not known to be trained, so it is given back
    assert task_stats(stream)["claimed"] == 0  # prefetched steps handed back, and `second`
    assert tq.batch_meta(next(iter(ld))).keys == tq.batch_meta(second).keys


def test_batches_carry_fields_values_and_meta(stream):
    keys = keys_of("k", 4)
    rows = ragged_rows(4)
    stream.writer(P).put(keys, {"x": torch.arange(4.0), "r": nested(rows), "s": list("abcd")},
                         tags=[{"i": i} for i in range(4)])
    stream.close_partition(P)
    got = {}
    for batch in loader(stream, fields=("x", "r", "s")):
        meta = tq.batch_meta(batch)
        for pos, key in enumerate(meta.keys):
            i = keys.index(key)
            assert batch["x"][pos].item() == i and meta.tags[pos] == {"i": i}
            assert torch.equal(batch["r"].unbind()[pos], rows[i])
            assert batch.get("s").tolist()[pos] == "abcd"[i]
            got[key] = meta.step
    assert sorted(got) == keys


def test_minibatches_over_epochs_with_ragged_fields(stream):
    keys = keys_of("k", 6)
    rows = ragged_rows(6)
    stream.writer(P).put(keys, {"x": torch.arange(6.0), "r": nested(rows)})
    ld = loader(stream, fields=("x", "r"), batch_size=6)
    batch = next(iter(ld))
    meta = tq.batch_meta(batch)
    seen = []
    for mb in ld.minibatches(batch, minibatch_size=4, epochs=3, shuffle=True, seed=1):
        mmeta = tq.batch_meta(mb)
        assert len(mb["x"]) == len(mmeta) <= 4
        for pos, key in enumerate(mmeta.keys):
            i = keys.index(key)
            assert mb["x"][pos].item() == i
            assert torch.equal(mb["r"].unbind()[pos], rows[i])
        seen.append(mmeta.keys)
    epochs = [sum(seen[e * 2:(e + 1) * 2], ()) for e in range(3)]
    assert all(sorted(e) == sorted(meta.keys) for e in epochs)
    assert len({e for e in epochs}) > 1  # shuffled differently per epoch
    plain = [tq.batch_meta(mb).keys for mb in ld.minibatches(batch, 5)]
    assert plain == [meta.keys[:5], meta.keys[5:]]


def test_state_dict_resumes_without_skips_or_repeats(stream):
    keys = keys_of("k", 20)
    stream.create_partition(P, consumers=["actor"])
    put_rows(stream, keys)
    stream.close_partition(P)
    first, seen = loader(stream, prefetch=3), []
    for i, batch in enumerate(first):
        seen += tq.batch_meta(batch).keys
        if i == 2:
            break
    state = first.state_dict()
    resumed = loader(stream, prefetch=3)
    resumed.load_state_dict(state)
    for batch in resumed:
        seen += tq.batch_meta(batch).keys
    assert sorted(seen) == sorted(keys)
    assert task_stats(stream)["acked"] == 20 and stream.stats()[P]["rows"] == 0


def test_same_loader_iterated_again_continues(stream):
    keys = keys_of("k", 8)
    put_rows(stream, keys)
    stream.close_partition(P)
    ld, seen = loader(stream), []
    for batch in ld:
        seen += tq.batch_meta(batch).keys
        break
    for batch in ld:
        seen += tq.batch_meta(batch).keys
    assert sorted(seen) == sorted(keys)


def run_ranks(stream, n_ranks, replicas=1, **kw) -> dict[tuple[int, int], list]:
    """Each (rank, replica) iterates its own loader in a thread; returns their batches."""
    out: dict[tuple[int, int], list] = {}
    errors: list[BaseException] = []

    def consume(rank, replica):
        try:
            ld = loader(stream, dp_rank=rank, dp_size=n_ranks, replicas=replicas,
                        replica=replica, **kw)
            out[(rank, replica)] = [tq.batch_meta(b).keys for b in ld]
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=consume, args=(r, k))
               for r in range(n_ranks) for k in range(replicas)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    if errors:
        raise errors[0]
    return out


@pytest.mark.parametrize("drop_last", [False, True])
def test_end_of_stream_two_ranks(stream, drop_last):
    keys = keys_of("k", 11)  # 2 full steps of 2 x 2 rows, 3 rows left
    stream.create_partition(P, consumers=["actor"])
    put_rows(stream, keys)
    stream.close_partition(P)
    got = run_ranks(stream, 2, batch_size=2, drop_last=drop_last)
    sizes = {r: [len(b) for b in batches] for r, batches in got.items()}
    if drop_last:
        assert sizes == {(0, 0): [2, 2], (1, 0): [2, 2]}
        assert task_stats(stream)["discarded"] == {"tail": 3}
    else:
        assert sizes == {(0, 0): [2, 2, 2], (1, 0): [2, 2, 1]}  # a short last step
        assert task_stats(stream)["discarded"] == {}
    delivered = [k for batches in got.values() for b in batches for k in b]
    assert len(delivered) == len(set(delivered)) == (8 if drop_last else 11)
    assert stream.stats()[P]["rows"] == 0


def test_end_of_stream_one_leftover_row_for_two_ranks(stream):
    put_rows(stream, keys_of("k", 5))
    stream.close_partition(P)
    got = run_ranks(stream, 2, batch_size=2)
    assert {r: len(b) for r, b in got.items()} == {(0, 0): 1, (1, 0): 1}
    assert task_stats(stream)["discarded"] == {"tail": 1}  # never an empty batch on one rank


def test_replicas_get_identical_batches_and_free_after_both(stream):
    stream.create_partition(P, consumers=["actor"])
    put_rows(stream, keys_of("k", 8))
    stream.close_partition(P)
    got = run_ranks(stream, 2, replicas=2, batch_size=2)
    assert got[(0, 0)] == got[(0, 1)] and got[(1, 0)] == got[(1, 1)]
    assert not {k for b in got[(0, 0)] for k in b} & {k for b in got[(1, 0)] for k in b}
    assert task_stats(stream)["acked"] == 8 and stream.stats()[P]["rows"] == 0


def test_replica_rows_freed_only_after_both_ack(stream):
    stream.create_partition(P, consumers=["actor"])
    put_rows(stream, keys_of("k", 4))
    a = iter(loader(stream, batch_size=2, replicas=2, replica=0, prefetch=1))
    b = iter(loader(stream, batch_size=2, replicas=2, replica=1, prefetch=1))
    assert tq.batch_meta(next(a)).keys == tq.batch_meta(next(b)).keys
    next(a)  # replica a acks step 0
    assert task_stats(stream)["acked"] == 0 and stream.stats()[P]["rows"] == 4
    next(b)  # replica b acks step 0
    assert task_stats(stream)["acked"] == 2 and stream.stats()[P]["rows"] == 2
    a.close()
    b.close()


def test_group_sampler_keeps_groups_whole(stream):
    keys = keys_of("k", 24)
    put_rows(stream, keys, tags=group_tags(keys, 4))
    stream.close_partition(P)
    got = run_ranks(stream, 2, batch_size=4, sampler=tq.samplers.GroupSampler(group_size=4))
    for batches in got.values():
        for b in batches:
            assert len({int(k[1:]) // 4 for k in b}) == 1 and len(b) == 4
    assert sum(len(b) for bs in got.values() for b in bs) == 24


def test_embedded_stream_refuses_worker_processes(stream):
    ds = tq.StreamingDataset(stream, P, "t", ["x"], 1)
    with pytest.raises(ConfigError, match="num_workers must be 0 with an embedded stream"):
        tq.StreamingDataLoader(ds, num_workers=2)


def train_with_one_failure(ld, fail_at=2) -> list[int]:
    """The README's recovery recipe: a step raises once (a CUDA OOM), the loop catches
    it and iterates the same loader again. Returns the steps trained, in order."""
    trained, failed = [], False
    while True:
        try:
            for batch in ld:
                step = tq.batch_meta(batch).step
                if step == fail_at and not failed:
                    failed = True
                    raise RuntimeError("CUDA out of memory (simulated)")
                trained.append(step)
            return trained
        except RuntimeError:
            continue


def test_a_step_that_raises_gets_its_batch_again(stream):
    """Issue 20 item 1: the failed step was acked when the loader was iterated again,
    so it was never trained (steps [0, 1, 3, ...])."""
    stream.create_partition(P, consumers=["actor"])
    put_rows(stream, keys_of("k", 16))
    stream.close_partition(P)
    assert train_with_one_failure(loader(stream)) == list(range(8))
    assert task_stats(stream)["acked"] == 16 and stream.stats()[P]["rows"] == 0


def test_after_a_raise_the_state_points_at_the_failed_step(stream):
    put_rows(stream, keys_of("k", 8))
    ld = loader(stream)
    with pytest.raises(ValueError):
        for batch in ld:
            if tq.batch_meta(batch).step == 1:
                raise ValueError("step failed")
    assert ld.state_dict()["step"] == 1 and ld.state_dict()["yielded"] == []
    assert task_stats(stream)["acked"] == 2  # step 0 only


def test_a_break_still_acks_and_release_gives_the_batch_back(stream):
    put_rows(stream, keys_of("k", 8))
    stream.close_partition(P)
    ld = loader(stream)
    for _ in ld:
        break  # step 0 is done
    for batch in ld:
        assert tq.batch_meta(batch).step == 1
        ld.release()  # not done: the next iteration starts with it
        break
    assert [tq.batch_meta(b).step for b in ld] == [1, 2, 3]
    assert task_stats(stream)["acked"] == 8


def test_a_break_acks_its_batch_as_the_loop_is_left(stream):
    """New-user replay: a trainer breaks after 3 steps and its process exits; a fresh
    loader in the next process trained step 2 again (the ack waited for an iteration
    that never came, and the lease expired). The ack happens at the break now."""
    put_rows(stream, keys_of("k", 8))
    stream.close_partition(P)
    ld = loader(stream)
    for i, _ in enumerate(ld):
        if i == 2:
            break
    assert task_stats(stream)["acked"] == 6  # step 3, fetched ahead, is not acked
    del ld  # the process exits: nothing is left to iterate again or to ack
    assert [tq.batch_meta(b).step for b in loader(stream)] == [3]


def test_release_inside_a_loop_that_goes_on_is_refused(stream):
    put_rows(stream, keys_of("k", 8))
    stream.close_partition(P)
    ld = loader(stream)
    with pytest.raises(tq.errors.StateError, match="release"):
        for _ in ld:
            ld.release()
    assert [tq.batch_meta(b).step for b in ld][:1] == [0]


def _closed_stream_of_8(stream: tq.Stream) -> tq.StreamingDataLoader:
    stream.create_partition("p8", consumers=["t"])
    stream.writer("p8").put([f"k{i}" for i in range(8)], {"x": torch.arange(8.0)})
    stream.close_partition("p8")
    return tq.StreamingDataLoader(tq.StreamingDataset(stream, "p8", "t", ["x"], batch_size=2))


def test_a_loop_ended_by_islice_is_neither_acked_nor_given_back_silently(stream):
    """Review of issue 20 item 1: islice ending the loop trained its last batch twice."""
    import itertools

    loader, seen = _closed_stream_of_8(stream), []
    for b in itertools.islice(loader, 2):
        seen.append(tq.batch_meta(b).step)
    with pytest.raises(StateError, match=r"loader.ack\(\) if they were"):
        next(iter(loader))
    loader.ack()  # they were trained
    seen += [tq.batch_meta(b).step for b in loader]
    assert seen == [0, 1, 2, 3]
    assert stream.stats()["p8"]["tasks"]["t"]["acked"] == 8


def test_a_held_iterator_replaced_asks_before_the_next_iteration(stream):
    loader, seen = _closed_stream_of_8(stream), []
    it = iter(loader)
    seen += [tq.batch_meta(next(it)).step, tq.batch_meta(next(it)).step]
    with pytest.raises(StateError, match="is unknown"):
        iter(loader)
    loader.release()  # step 1 was not trained: it comes again
    seen += [tq.batch_meta(b).step for b in loader]
    assert seen == [0, 1, 1, 2, 3]
    assert stream.stats()["p8"]["tasks"]["t"]["acked"] == 8
