"""GRPO with torchrun: a rollout producer, an old-log-prob stage and 4 trainer ranks.

Run from the repository root (CPU, gloo, well under a minute)::

    torchrun --standalone --nproc-per-node 4 examples/grpo_torchrun.py
    python -m examples.grpo_torchrun          # the same, started with mp.spawn

Layout: 4 ranks = 2 data-parallel ranks x 2 replicas (think tensor-parallel peers, which
must see identical batches). Rank 0 starts a local-mode deployment and broadcasts its
address; it also forks the rollout producer and the old-log-prob stage. Rows flow:

    producer --(prompt, response, advantage; tags uid/version/seqlen)--> "train"
    old_logp stage (low-level client, pool mode) --(old_logp)--> same rows
    trainer ranks (StreamingDataLoader) read all four fields, run PPO minibatches

The run has two phases: phase 1 trains CKPT_STEP steps, checkpoints (model, optimizer,
every loader's state_dict, stream.save) and shuts everything down, as a crash would;
phase 2 restores the deployment from the checkpoint and finishes. At the end rank 0
prints rows per task and checks that every row was trained exactly once.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tq_stream as tq

PROMPTS, GROUP = 64, 4  # 64 prompts x 4 responses = 256 rows
DP, REPLICAS = 2, 2
BATCH = 16  # rows per DP rank per step (4 groups): 32 rows per step, 8 steps in all
CKPT_STEP = 4  # phase 1 stops after this many optimizer steps
NUM_MINIBATCHES, PPO_EPOCHS = 2, 2
VOCAB, HIDDEN = 32, 16
PART = "train"
T0 = time.perf_counter()


class Policy(torch.nn.Module):
    """A tiny causal model: next-token logits from the previous token plus the prompt."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, VOCAB)

    def token_logp(self, prompt: torch.Tensor, response: torch.Tensor) -> torch.Tensor:
        """Per-token log-probs of ``response`` (both jagged [rows, *]); padded [rows, T]."""
        ctx = self.emb(prompt.to_padded_tensor(0)).sum(1) / _lengths(prompt)[:, None]
        resp = response.to_padded_tensor(0)
        prev = F.pad(resp[:, :-1], (1, 0))  # token 0 acts as begin-of-response
        logits = self.out(self.emb(prev) + ctx[:, None, :])
        return logits.log_softmax(-1).gather(-1, resp[..., None]).squeeze(-1)


def _lengths(jagged: torch.Tensor) -> torch.Tensor:
    return jagged.offsets().diff()


def _mask(jagged: torch.Tensor) -> torch.Tensor:
    lengths = _lengths(jagged)
    return torch.arange(int(lengths.max()))[None, :] < lengths[:, None]


def _jagged(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.nested_tensor(rows, layout=torch.jagged)


# ---------------------------------------------------------------- rollout producer
def rollout(stream: tq.Stream, first: int, version: mp.Value, stop: mp.Event,
            written: mp.Value) -> None:
    """Writes one GRPO group per prompt, from prompt ``first`` on, until told to stop."""
    writer = stream.writer(PART)
    gen = torch.Generator().manual_seed(first)
    for p in range(first, PROMPTS):
        while not stop.is_set():  # paced: never more than 1 policy version ahead
            try:
                writer.reserve(GROUP, timeout=1.0)
                break
            except tq.errors.WaitTimeout:
                continue  # the trainer is behind: look at `stop` again
        if stop.is_set():
            return
        prompt = torch.randint(1, VOCAB, (int(torch.randint(4, 12, (1,), generator=gen)),),
                               generator=gen)
        responses = [torch.randint(1, VOCAB, (int(n),), generator=gen)
                     for n in torch.randint(4, 24, (GROUP,), generator=gen)]
        reward = torch.tensor([float((r % 2 == 0).float().mean()) for r in responses])
        advantage = (reward - reward.mean()) / (reward.std() + 1e-6)  # GRPO: within a group
        keys = [f"p{p}_r{i}" for i in range(GROUP)]
        writer.put(keys, {"prompt": _jagged([prompt] * GROUP), "response": _jagged(responses),
                          "advantage": advantage},
                   tags=[{"uid": f"p{p}", "version": version.value, "seqlen": len(prompt) + len(r)}
                         for r in responses])
        written.value = p + 1
    stream.close_partition(PART)  # no more rows: loaders end after the last batch


# ---------------------------------------------------------------- old-log-prob stage
def old_logp_stage(stream: tq.Stream, worker: int, stop: mp.Event, rows: mp.Value) -> None:
    """One worker of a pool: takes the next batch (no step numbers), writes a field back."""
    client = stream.client(consumer=f"old_logp-{worker}")
    client.register_task(PART, "old_logp", ["prompt", "response"], batch_size=BATCH)
    torch.manual_seed(0)
    policy = Policy()  # a copy of the rollout policy (weight sync is out of scope here)
    while not stop.is_set():
        try:
            meta = client.get_meta(PART, "old_logp", timeout=1.0)  # the next batch for me
        except tq.errors.WaitTimeout:
            continue  # nothing ready yet: look at `stop` again
        if meta is None or meta.end:
            return
        td = client.get_data(meta)
        with torch.no_grad():
            logp = policy.token_logp(td["prompt"], td["response"])
        rows_logp = [r[:n] for r, n in zip(logp, _lengths(td["response"]).tolist(), strict=True)]
        client.put_data(meta, {"old_logp": _jagged(rows_logp)})  # a new field, same rows
        client.ack(meta)  # the trainer's task sees the rows once old_logp is there
        with rows.get_lock():
            rows.value += len(meta)


# ---------------------------------------------------------------- trainer ranks
def ppo_step(policy: Policy, opt: torch.optim.Optimizer, batch, dp_group) -> float:
    """PPO epochs over one batch; gradients averaged over the DP group (manual DDP).

    The number of minibatches is fixed (not their size): SeqlenBalancedSampler balances
    tokens, so DP ranks may hold different row counts, and every rank must run the same
    number of all-reduces.
    """
    n, last = batch.batch_size[0], 0.0
    gen = torch.Generator().manual_seed(tq.batch_meta(batch).step)  # a new shuffle per step
    for _ in range(PPO_EPOCHS):
        for idx in torch.tensor_split(torch.randperm(n, generator=gen), NUM_MINIBATCHES):
            mb = tq.select_rows(batch, idx)
            mask = _mask(mb["response"])
            logp = policy.token_logp(mb["prompt"], mb["response"])
            ratio = (logp - mb["old_logp"].to_padded_tensor(0)).exp()
            adv = mb["advantage"][:, None]
            surr = torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
            loss = -(surr * mask).sum() / mask.sum()
            opt.zero_grad()
            loss.backward()
            for p in policy.parameters():  # what DDP does: average grads over DP ranks
                dist.all_reduce(p.grad, group=dp_group)
                p.grad /= DP
            opt.step()
            last = loss.item()
    return last


def train(rank: int, stream: tq.Stream, ckpt: str, phase: int, dp_group) -> list[str]:
    """Trains until the end (phase 2) or CKPT_STEP steps (phase 1); returns keys trained."""
    dp_rank, replica = divmod(rank, REPLICAS)
    torch.manual_seed(0)  # same initial weights on every rank
    policy = Policy()
    opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
    # The bound holds when a batch reaches this loop (steps fetched ahead are formed for
    # the version of their turn). This small run writes every prompt within its first
    # versions, so a loose bound keeps all of them; async_offpolicy.py shows discards.
    sampler = tq.samplers.StalenessSampler(
        tq.samplers.SeqlenBalancedSampler(tq.samplers.GroupSampler(group_size=GROUP),
                                          cost_tag="seqlen"), max_staleness=16)
    ds = tq.StreamingDataset(stream, PART, "actor",
                             ["prompt", "response", "old_logp", "advantage"],
                             batch_size=BATCH, sampler=sampler, dp_rank=dp_rank, dp_size=DP,
                             replicas=REPLICAS, replica=replica, timeout=60)
    loader = tq.StreamingDataLoader(ds, num_workers=2, multiprocessing_context="fork")
    version = 0
    if phase == 2:  # resume: weights, optimizer, where this loader stood
        state = torch.load(f"{ckpt}/rank{rank}.pt")
        policy.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        loader.load_state_dict(state["loader"])
        version = state["version"]
    loader.set_version(version)  # before the first batch: producers' reserve() uses it
    trained: list[str] = []
    for batch in loader:  # acks the previous batch when it asks for the next
        loss = ppo_step(policy, opt, batch, dp_group)
        trained += tq.batch_meta(batch).keys
        version += 1
        loader.set_version(version)  # staleness is measured against this
        if rank == 0:
            _publish_version(version)
            print(f"phase {phase} step {version}: rows {len(batch)} loss {loss:+.4f} "
                  f"({time.perf_counter() - T0:.1f} s)", flush=True)
        if phase == 1 and version == CKPT_STEP:
            torch.save({"model": policy.state_dict(), "opt": opt.state_dict(),
                        "loader": loader.state_dict(), "version": version},
                       f"{ckpt}/rank{rank}.pt")
            break  # the last batch stays unacked; the restored loader acks it first
    if phase == 2:
        weights = torch.cat([p.detach().flatten() for p in policy.parameters()])
        peers = [torch.zeros_like(weights) for _ in range(dist.get_world_size())]
        dist.all_gather(peers, weights)
        assert all(torch.equal(peers[0], w) for w in peers), "ranks diverged"
    return trained


_SHARED: dict[str, mp.Value] = {}


def _publish_version(v: int) -> None:
    """Rank 0 tells the producer its policy version (a stand-in for weight sync)."""
    _SHARED["version"].value = v


# ---------------------------------------------------------------- one phase
def run_phase(rank: int, phase: int, ckpt: str) -> tuple[list[str], dict]:
    """Rank 0 starts (phase 1) or restores (phase 2) the deployment and the helpers."""
    ctx = mp.get_context("fork")
    procs, stats = [], {}
    if rank == 0:
        restore = f"{ckpt}/stream" if phase == 2 else None
        stream = tq.init(mode="local", storage_units=2, restore=restore)
        if phase == 1:  # declared consumers: a row is freed once both are done with it
            stream.create_partition(PART, consumers=["old_logp", "actor"])
        progress = json.loads(Path(f"{ckpt}/progress.json").read_text()) if phase == 2 \
            else {"prompts": 0, "version": 0}
        _SHARED["version"] = ctx.Value("i", progress["version"])
        stop, written, stage_rows = ctx.Event(), ctx.Value("i", progress["prompts"]), \
            ctx.Value("i", 0)
        procs = [ctx.Process(target=rollout, args=(stream, progress["prompts"],
                                                  _SHARED["version"], stop, written))]
        procs += [ctx.Process(target=old_logp_stage, args=(stream, w, stop, stage_rows))
                  for w in range(2)]
        for p in procs:
            p.start()
        address = [stream.address]
    else:
        address = [None]
    dist.broadcast_object_list(address, src=0)  # every rank joins rank 0's deployment
    if rank != 0:
        stream = tq.connect(address[0])
    groups = [dist.new_group([d * REPLICAS + r for d in range(DP)]) for r in range(REPLICAS)]
    trained = train(rank, stream, ckpt, phase, groups[rank % REPLICAS])
    dist.barrier()  # every rank saved its loader state (phase 1) or finished (phase 2)
    if rank == 0:
        stop.set()  # producer and stage stop at a batch boundary
        for p in procs:
            p.join(timeout=30)
        if phase == 1:  # a snapshot that matches the producer's progress
            stream.save(f"{ckpt}/stream")
            Path(f"{ckpt}/progress.json").write_text(
                json.dumps({"prompts": written.value, "version": CKPT_STEP}))
        stats = stream.stats()[PART]
        stats["stage_rows"] = stage_rows.value
    dist.barrier()
    stream.close()  # rank 0's close ends the deployment (phase 1: our "crash")
    return trained, stats


def main(rank: int, world: int) -> dict:
    assert world == DP * REPLICAS, f"run with {DP * REPLICAS} processes, got {world}"
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ckpt = [tempfile.mkdtemp(prefix="grpo_ckpt_") if rank == 0 else None]
    dist.broadcast_object_list(ckpt, src=0)
    trained1, stats1 = run_phase(rank, 1, ckpt[0])
    trained2, stats2 = run_phase(rank, 2, ckpt[0])
    per_rank = [None] * world
    dist.all_gather_object(per_rank, trained1 + trained2)
    dist.destroy_process_group()
    if rank != 0:
        return {}
    shutil.rmtree(ckpt[0])
    replica0 = [keys for r, keys in enumerate(per_rank) if r % REPLICAS == 0]
    everything = [k for keys in replica0 for k in keys]
    tasks = stats2["tasks"]
    result = {
        "rows_per_task": {t: tasks[t]["acked"] for t in sorted(tasks)},
        "stage_rows": stats1["stage_rows"] + stats2["stage_rows"],
        "trained": len(everything),
        "duplicates": len(everything) - len(set(everything)),
        "lost": PROMPTS * GROUP - len(set(everything)),
        "replicas_identical": all(per_rank[r] == per_rank[r - r % REPLICAS]
                                  for r in range(world)),
        "discarded": tasks["actor"].get("discarded", {}),
    }
    print("RESULT " + json.dumps(result), flush=True)
    return result


def _spawned(rank: int, world: int, port: int) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    main(rank, world)


if __name__ == "__main__":
    if "RANK" in os.environ:  # launched by torchrun
        main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    else:  # fallback: start the 4 ranks ourselves
        # As torchrun does: one OpenMP thread per rank. Rank 0 forks its helpers after
        # it has trained (phase 2), and a forked child of a multi-threaded OpenMP
        # parent can hang in its first parallel op.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import socket

        import torch.multiprocessing as tmp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            free_port = s.getsockname()[1]
        tmp.spawn(_spawned, args=(DP * REPLICAS, free_port), nprocs=DP * REPLICAS)
        sys.exit(0)
