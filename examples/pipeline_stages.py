"""A verl-style stage chain: rollout -> reference log-prob -> advantage -> actor update.

Run from the repository root (CPU, a few seconds)::

    python -m examples.pipeline_stages

Every stage is its own process. It asks for "the next batch for me"
(``client.get_meta(partition, task)``, no step number), reads the fields it needs,
writes new fields to the same rows with ``put_data`` and acks. A row becomes ready
for a stage as soon as the fields that stage reads exist, so the stages overlap:
the actor trains on the first groups while the rollout still generates later ones.
The partition declares all its consumers, so a row is freed only when the last of
them is done with it, whatever order the stages start in.
"""

from __future__ import annotations

import json
import multiprocessing as mp
from collections.abc import Callable

import torch
from tensordict import TensorDict

import tq_stream as tq

PROMPTS, GROUP = 32, 4  # 128 rows
PART = "rollouts"
CONSUMERS = ["ref_logp", "advantage", "actor"]


def jagged(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.nested_tensor(rows, layout=torch.jagged)


# -------------------------------------------------------------- the stages' work
def rollout(stream: tq.Stream) -> None:
    """Generates GROUP responses per prompt; writes tokens, a reward and the group id."""
    writer = stream.writer(PART)
    gen = torch.Generator().manual_seed(0)
    for p in range(PROMPTS):
        responses = [torch.randint(1, 32, (int(n),), generator=gen)
                     for n in torch.randint(3, 20, (GROUP,), generator=gen)]
        reward = torch.tensor([float(r.float().mean() > 16) for r in responses])
        writer.put([f"p{p}_{i}" for i in range(GROUP)],
                   {"response": jagged(responses), "reward": reward},
                   tags=[{"uid": f"p{p}"}] * GROUP)
    stream.close_partition(PART)  # the stages end once they drained every row


def ref_logp(td: TensorDict) -> dict[str, torch.Tensor]:
    """A frozen reference model: here, log(1/32) per token."""
    lengths = td["response"].offsets().diff().tolist()
    return {"ref_logp": jagged([torch.full((n,), -3.4657) for n in lengths])}


def advantage(td: TensorDict) -> dict[str, torch.Tensor]:
    """GRPO: the reward normalised within its group (the batch holds whole groups)."""
    reward = td["reward"].view(-1, GROUP)
    adv = (reward - reward.mean(1, keepdim=True)) / (reward.std(1, keepdim=True) + 1e-6)
    return {"advantage": adv.flatten()}


# -------------------------------------------------------------- one generic stage
def stage(stream: tq.Stream, task: str, reads: list[str],
          work: Callable[[TensorDict], dict[str, torch.Tensor]], batch_size: int,
          sampler: tq.samplers.Sampler | None, done: mp.Queue) -> None:
    """A stage worker: next batch -> read ``reads`` -> write ``work``'s fields -> ack."""
    client = stream.client(consumer=f"{task}-0")  # a restarted worker resumes its batch
    client.register_task(PART, task, reads, batch_size=batch_size, sampler=sampler)
    keys: list[str] = []
    while True:
        meta = client.get_meta(PART, task, timeout=30)  # no step: "the next batch for me"
        if meta.end:  # the partition is closed and this task has seen every row
            break
        client.put_data(meta, work(client.get_data(meta, reads)))
        client.ack(meta)
        keys += meta.keys
    done.put((task, keys))


def main() -> dict:
    stream = tq.init(mode="local", storage_units=2)
    stream.create_partition(PART, consumers=CONSUMERS)  # freed after all three acked
    ctx = mp.get_context("fork")
    done: mp.Queue = ctx.Queue()
    group = tq.samplers.GroupSampler(group_size=GROUP)  # advantage needs whole groups
    procs = [ctx.Process(target=rollout, args=(stream,)),
             ctx.Process(target=stage, args=(stream, "ref_logp", ["response"], ref_logp,
                                             16, None, done)),
             ctx.Process(target=stage, args=(stream, "advantage", ["reward"], advantage,
                                             16, group, done))]
    for p in procs:
        p.start()

    # The actor update: reads what the earlier stages wrote, in this process.
    torch.manual_seed(0)
    bias = torch.zeros(1, requires_grad=True)  # a one-parameter "policy"
    opt = torch.optim.SGD([bias], lr=0.1)
    ds = tq.StreamingDataset(stream, PART, "actor", ["response", "ref_logp", "advantage"],
                             batch_size=16, sampler=group, timeout=30)
    actor_keys: list[str] = []
    for batch in tq.StreamingDataLoader(ds):
        logp = batch["ref_logp"].values() + bias  # per-token log-probs, all rows
        per_row = torch.segment_reduce(logp, "sum", offsets=batch["ref_logp"].offsets())
        loss = -(per_row * batch["advantage"]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        actor_keys += tq.batch_meta(batch).keys

    stage_keys = dict(done.get(timeout=30) for _ in range(2))
    for p in procs:
        p.join(timeout=30)
    stats = stream.stats()[PART]
    stream.close()
    stage_keys["actor"] = actor_keys
    result = {
        "rows_per_task": {t: stats["tasks"][t]["acked"] for t in CONSUMERS},
        "duplicates": {t: len(k) - len(set(k)) for t, k in stage_keys.items()},
        "lost": {t: PROMPTS * GROUP - len(set(k)) for t, k in stage_keys.items()},
        "rows_left": stats["rows"],  # every consumer acked every row: all freed
    }
    print("RESULT " + json.dumps(result))
    return result


if __name__ == "__main__":
    main()
