"""The VLM GRPO rollout data of workload ``vlm``, made the same way in every process.

``Shape`` fixes the sizes; ``groups(shape)`` makes every prompt group from a seed, so a
producer process, a consumer process checking what it read and the parent counting the
raw bytes all see the same rows without shipping them. A group is one prompt (a
``[3, H, W]`` uint8 image, H and W uniform in ``px``, and its prompt tokens) and
``responses`` rollouts of it (token ids, per-token log-probs, one reward each).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shape:
    """Sizes of one VLM run; ``full()`` is issue 23's, ``quick()`` a smoke test."""

    prompts: int = 64
    responses: int = 8
    px: tuple[int, int] = (100, 400)  # H and W uniform in [lo, hi]
    prompt_tokens: tuple[int, int] = (64, 512)
    response_tokens: tuple[int, int] = (100, 1000)
    pace_s: float = 0.05  # one group written every pace_s (rollouts arriving)
    seed: int = 23

    @staticmethod
    def full() -> Shape:
        return Shape()

    @staticmethod
    def quick() -> Shape:
        return Shape(prompts=6, responses=4, px=(16, 48), prompt_tokens=(8, 32),
                     response_tokens=(8, 64), pace_s=0.01)

    @property
    def rows(self) -> int:
        return self.prompts * self.responses


@dataclass(frozen=True)
class Group:
    """One prompt and its responses."""

    uid: str
    image: torch.Tensor  # uint8 [3, H, W]
    prompt_ids: torch.Tensor  # int64 [P]
    response_ids: list[torch.Tensor]  # int64 [L_j]
    logprobs: list[torch.Tensor]  # float32 [L_j]
    rewards: torch.Tensor  # float32 [responses]

    @property
    def keys(self) -> list[str]:
        return [row_key(self.uid, j) for j in range(len(self.response_ids))]


def row_key(uid: str, j: int) -> str:
    return f"{uid}-r{j}"


def uid_of(key: str) -> str:
    """The prompt uid of a response row's key."""
    return key.rsplit("-r", 1)[0]


def group(shape: Shape, g: int) -> Group:
    """Prompt group ``g`` of ``shape`` (deterministic)."""
    gen = torch.Generator().manual_seed(shape.seed * 100_003 + g)

    def between(lo_hi: tuple[int, int]) -> int:
        return int(torch.randint(lo_hi[0], lo_hi[1] + 1, (1,), generator=gen))

    h, w = between(shape.px), between(shape.px)
    image = torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=gen)
    prompt = torch.randint(1, 150_000, (between(shape.prompt_tokens),), generator=gen)
    lengths = [between(shape.response_tokens) for _ in range(shape.responses)]
    ids = [torch.randint(1, 150_000, (n,), generator=gen) for n in lengths]
    logp = [-torch.rand(n, generator=gen) for n in lengths]
    rewards = torch.rand(shape.responses, generator=gen)
    return Group(f"p{g:04d}", image, prompt, ids, logp, rewards)


def groups(shape: Shape) -> list[Group]:
    return [group(shape, g) for g in range(shape.prompts)]


def raw_bytes(shape: Shape) -> dict[str, int]:
    """Bytes of the distinct data: each image and prompt once, every response row."""
    out = {"images": 0, "prompt tokens": 0, "responses": 0}
    for grp in groups(shape):
        out["images"] += grp.image.numel()
        out["prompt tokens"] += grp.prompt_ids.numel() * 8
        out["responses"] += sum(t.numel() * 12 for t in grp.response_ids) + grp.rewards.numel() * 4
    return out


def image_shapes(shape: Shape) -> dict[str, tuple[int, ...]]:
    """uid -> the image shape its group must read back with (a consumer's check)."""
    return {grp.uid: tuple(grp.image.shape) for grp in groups(shape)}
