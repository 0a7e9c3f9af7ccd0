"""Reading a nested field by its parent name (issue 20 item 16), shared by the embedded
test (tests/api/test_nested_parent_read.py) and the local-mode one."""

from __future__ import annotations

import torch
from tensordict import TensorDict

import tq_stream as tq


def put_obs(stream: tq.Stream, part: str, n: int = 8, start: int = 0) -> list[str]:
    """``n`` rows of ``{"obs": {"image", "state", "meta": {"step"}}, "r"}``; state = row."""
    i = torch.arange(start, start + n)
    td = TensorDict({"obs": TensorDict({"image": i.float()[:, None, None].expand(n, 2, 2),
                                        "state": i,
                                        "meta": TensorDict({"step": i * 10}, [n])}, [n]),
                     "r": i.float()}, [n])
    keys = [f"k{j}" for j in i.tolist()]
    stream.writer(part).put(keys, td)
    return keys


def check_obs(batch: TensorDict) -> list[int]:
    """``batch`` holds the whole ``obs`` subtree and nothing else; returns its rows."""
    assert set(batch.keys()) == {"obs"}
    obs = batch["obs"]
    assert isinstance(obs, TensorDict)
    assert set(obs.keys()) == {"image", "state", "meta"}
    state = obs["state"].tolist()
    assert obs["image"][:, 0, 0].tolist() == [float(s) for s in state]
    assert obs["meta", "step"].tolist() == [s * 10 for s in state]
    return state


def loader_reads_the_subtree(stream: tq.Stream, part: str, num_workers: int = 0,
                             **loader: object) -> list[int]:
    put_obs(stream, part, 16)
    stream.close_partition(part)
    ds = tq.StreamingDataset(stream, part, "t", ["obs"], batch_size=4, timeout=20)
    seen: list[int] = []
    for batch in tq.StreamingDataLoader(ds, num_workers=num_workers, **loader):
        seen += check_obs(batch)
    return sorted(seen)
