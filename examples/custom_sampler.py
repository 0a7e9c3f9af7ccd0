"""A custom sampler in ~20 lines: hand out only rows whose reward is > 0, longest first.

Run from the repository root: ``python -m examples.custom_sampler``
"""

from __future__ import annotations

import numpy as np

from tq_stream.samplers import Candidates, Sampler, Selection


class PositiveRewardSampler(Sampler):
    """Rows with ``reward > 0``, longest ``seqlen`` first; the others are discarded.

    Stateless, so the inherited ``state_dict()`` is ``{}``. A sampler only reads tag
    arrays (never tensor bytes) and must stay vectorised: it runs under the controller's
    lock for every step.
    """

    def required_tags(self) -> tuple[str, ...]:
        return ("reward", "seqlen")

    def sample(self, candidates: Candidates, batch_size: int) -> Selection:
        good = candidates.tag("reward") > 0  # a NaN (missing) reward compares False
        drop = {"non_positive_reward": candidates.index[~good]}
        need = batch_size * candidates.dp_size
        if np.count_nonzero(good) < need:
            return Selection.wait(drop)  # discards apply now; wait for more rows
        rows = candidates.index[good]
        longest = np.argsort(-candidates.tag("seqlen", rows), kind="stable")[:need]
        return Selection.split(rows[longest], candidates.dp_size, drop)


def self_test() -> None:
    """The sampler on hand-made candidates: no stream needed."""
    cands = Candidates.from_arrays(
        index=np.arange(10, 16),
        tags={
            "reward": np.array([1.0, 0.0, 2.0, -1.0, 0.5, 3.0]),
            "seqlen": np.array([5, 99, 7, 99, 9, 1]),
        },
        dp_size=2,
    )
    sel = PositiveRewardSampler().sample(cands, batch_size=2)
    assert [s.tolist() for s in sel.shares] == [[14, 12], [10, 15]], sel.shares
    assert sel.discard["non_positive_reward"].tolist() == [11, 13]
    waiting = PositiveRewardSampler().sample(cands, batch_size=4)
    assert not waiting.ready and len(waiting.discard["non_positive_reward"]) == 2
    print("self-test ok:", [s.tolist() for s in sel.shares])


def end_to_end() -> None:
    """The sampler plugged into a StreamingDataset over an embedded stream."""
    import torch
    from tensordict import TensorDict

    import tq_stream as tq

    n = 16
    rewards = [float(i % 4 - 1) for i in range(n)]  # -1, 0, 1, 2, ...: half are > 0
    with tq.init() as stream:
        writer = stream.writer("train")
        writer.put(
            [f"row-{i}" for i in range(n)],
            TensorDict({"input_ids": torch.arange(n * 4).reshape(n, 4)}, [n]),
            tags=[{"reward": r, "seqlen": i} for i, r in enumerate(rewards)],
        )
        writer.close_partition()
        ds = tq.StreamingDataset(
            stream,
            partition="train",
            task="t",
            fields=["input_ids"],
            batch_size=4,
            sampler=PositiveRewardSampler(),
        )
        for batch in ds:
            print("batch of", batch.batch_size[0], "rows:", batch["input_ids"][:, 0].tolist())
        print("stats:", stream.stats())


def main() -> None:
    self_test()
    end_to_end()


if __name__ == "__main__":
    main()
