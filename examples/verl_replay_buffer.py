"""verl's ReplayBuffer policy done by tq_stream's samplers instead of a polling loop.

verl 0.9.1's ``ReplayBuffer`` lists every key of every partition (``tq.kv_list()``)
every ``poll_interval`` seconds and decides in Python which prompt groups are
complete, too stale, or without reward signal (DAPO). With tq_stream the same
policy is a sampler the controller runs when rows arrive, and the trainer simply
waits on a loader:

=====================================  ==============================================
verl ReplayBuffer                      tq_stream
=====================================  ==============================================
prompt ``status`` finished = all n     ``GroupSampler(group_size=n, group_tag="uid")``:
sessions put                           a group is handed out once its n rows exist
off-policy ``drop`` (async)            ``StalenessSampler(max_staleness=k - 1,
                                       version_tag="global_steps")`` + ``set_version``
off-policy ``wait`` (async)            ``Writer.reserve`` / ``admission_limit``: producers
                                       pause instead of the trainer waiting
DAPO ``filter_groups_metric``          ``DynamicFilterSampler(reward_tag="reward")``:
                                       zero-variance groups are discarded
``partition_id="val"`` then "train"    ``PartitionSampler(order=["val", "train"])``
``refill_fn(k)``                       ``stats()["train"]["tasks"][...]["discarded"]``
                                       tells the launcher how many groups to refill
=====================================  ==============================================

Keys and tags are verl's (``{uid}_{session}_{index}``; ``status``, ``global_steps``,
``min_global_steps``, ...); the rollout side adds two tags, ``uid`` (the group) and
``reward`` (the DAPO metric). Rows are freed by an explicit clear after the step
(correct whether or not the partition declares its consumers).

Run from the repository root: ``python -m examples.verl_replay_buffer``
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import torch
from tensordict import TensorDict

import tq_stream as tq
import tq_stream.compat
from tq_stream.compat import transfer_queue
from tq_stream.samplers import (
    DynamicFilterSampler,
    GroupSampler,
    PartitionSampler,
    Sampler,
    StalenessSampler,
)

FIELDS = ["responses", "rm_scores"]


def train_sampler(n: int, max_off_policy: int | None, dapo: bool) -> Sampler:
    """verl's training-partition policy: complete groups, fresh enough, with signal."""
    policy: Sampler = GroupSampler(group_size=n, group_tag="uid")
    if dapo:
        policy = DynamicFilterSampler(policy, reward_tag="reward")
    if max_off_policy is not None:  # verl drops spans > threshold: staleness >= threshold
        policy = StalenessSampler(policy, max_staleness=max_off_policy - 1,
                                  version_tag="global_steps")
    return policy


def put_session(partition: str, uid: str, session: int, step: int, reward: float,
                length: int) -> None:
    """What verl's AgentLoopWorkerTQ writes for one session (+ the uid/reward tags),
    through the same ``transfer_queue`` call (``tq_stream.compat``)."""
    scores = torch.zeros(1, length)
    scores[0, -1] = reward
    fields = TensorDict({"responses": torch.arange(length).unsqueeze(0),
                         "rm_scores": scores}, batch_size=[1])
    tag = {"status": "success", "response_len": length, "global_steps": step,
           "min_global_steps": step, "max_global_steps": step, "uid": uid,
           "reward": reward}
    transfer_queue.kv_batch_put(keys=[f"{uid}_{session}_0"], partition_id=partition,
                                fields=fields, tags=[tag])


def loader(stream: tq.Stream, n: int, groups_per_step: int, max_off_policy: int | None = None,
           dapo: bool = True, with_val: bool = False, timeout: float = 30.0
           ) -> Iterator[TensorDict]:
    """Batches of ``groups_per_step`` complete groups; "val" first when ``with_val``."""
    policy = train_sampler(n, max_off_policy, dapo)
    sampler: Any = policy
    partition: Any = "train"
    if with_val:
        sampler = PartitionSampler(order=["val", "train"],
                                   samplers={"val": GroupSampler(group_size=n, group_tag="uid"),
                                             "train": policy})
        partition = None
    ds = tq.StreamingDataset(stream, partition, "actor", FIELDS,
                             batch_size=groups_per_step * n, sampler=sampler, timeout=timeout)
    return iter(tq.StreamingDataLoader(ds))


def demo() -> dict[str, Any]:
    """Two steps: validation, then training with a stale group and a no-signal group
    the samplers drop, while a producer thread writes sessions."""
    n = 4
    transfer_queue.init({"tq_stream": {"mode": "embedded"}})  # what verl's driver does
    stream = tq_stream.compat.stream()
    groups = {"stale": (0, [1.0, 0.0, 1.0, 0.0]), "flat": (2, [1.0] * n),
              "a": (2, [1.0, 0.0, 0.0, 1.0]), "b": (2, [0.0, 1.0, 1.0, 1.0]),
              "v1": (2, [1.0] * n)}
    for s in range(n):
        put_session("val", "v1", s, 2, groups["v1"][1][s], 3 + s)
    stream.close_partition("val")

    def produce() -> None:
        for uid in ("stale", "flat", "a", "b"):
            step, rewards = groups[uid]
            for s in range(n):
                put_session("train", uid, s, step, rewards[s], 2 + s)

    it = loader(stream, n, groups_per_step=1, max_off_policy=2, dapo=True, with_val=True)
    val = next(it)  # validation first (its group is kept: no DAPO on "val")
    stream.set_version("train", "actor", 2)  # the trainer is at global step 2
    producer = threading.Thread(target=produce)  # rollouts arrive while the trainer waits
    producer.start()
    seen = [sorted(set(tq.batch_meta(val).tags[i]["uid"] for i in range(len(val))))]
    for _ in range(2):
        batch = next(it)
        meta = tq.batch_meta(batch)
        seen.append(sorted({t["uid"] for t in meta.tags}))
        stream.kv.clear(list(meta.keys), partition=meta.partition)  # after the step
    producer.join()
    stats = stream.stats()["train"]["tasks"]["actor"]
    transfer_queue.close()
    return {"groups": seen, "discarded": stats.get("discarded", {})}


if __name__ == "__main__":
    out = demo()
    print(out)
    assert out["groups"] == [["v1"], ["a"], ["b"]], out
