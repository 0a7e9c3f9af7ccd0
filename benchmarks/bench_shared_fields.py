"""Storage of a VLM GRPO batch: each prompt's image stored once and named by its rows
(``put_shared`` + ``put(..., shared=)``) against the image copied into every row.

64 prompts x 8 responses, one uint8 ``[3, H, W]`` image per prompt (H, W in 100..400),
a 64-token prompt and a ragged response per row. For each deployment mode (embedded,
local with 2 storage units) it prints the bytes the units hold for the rows' fields
(``deployment_stats()``: per partition, bytes allocated per field; arenas grow by
doubling), the bytes of the values put, and the put and read times. Run from the repository root:
``python -m benchmarks.bench_shared_fields [--modes embedded local]``.
"""

from __future__ import annotations

import argparse
import time

import torch

import tq_stream as tq

PROMPTS, RESPONSES = 64, 8


def workload(seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(100, 401, (PROMPTS, 2), generator=g).tolist()
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g)
              for h, w in sizes]
    prompts = torch.randint(0, 32000, (PROMPTS, 64), generator=g)
    lengths = torch.randint(50, 500, (PROMPTS * RESPONSES,), generator=g).tolist()
    responses = [torch.randint(0, 32000, (n,), generator=g) for n in lengths]
    return images, prompts, responses


def stored(stream: tq.Stream, partition: str) -> int:
    return sum(sum(u["partitions"].get(partition, {}).get("fields", {}).values())
               for u in stream.deployment_stats()["units"])


def shared_layout(stream: tq.Stream, data: tuple) -> tuple[float, float]:
    images, prompts, responses = data
    p = "shared"
    w = stream.writer(p)
    uids = [f"p{i}" for i in range(PROMPTS)]
    t0 = time.perf_counter()
    w.put_shared(uids, {"image": tq.MultiRagged.from_list(images, fixed_dims=(0,)),
                        "prompt": prompts})
    keys = [f"p{i}_{j}" for i in range(PROMPTS) for j in range(RESPONSES)]
    w.put(keys, {"response": torch.nested.nested_tensor(responses, layout=torch.jagged)},
          tags=[{"uid": k.split("_")[0]} for k in keys],
          shared=[k.split("_")[0] for k in keys])
    t1 = time.perf_counter()
    stream.kv.get_batch(keys, fields=["image", "prompt", "response"], partition=p,
                        ragged="list")
    return t1 - t0, time.perf_counter() - t1


def copied_layout(stream: tq.Stream, data: tuple) -> tuple[float, float]:
    images, prompts, responses = data
    p = "copied"
    keys = [f"p{i}_{j}" for i in range(PROMPTS) for j in range(RESPONSES)]
    rows = [i for i in range(PROMPTS) for _ in range(RESPONSES)]
    t0 = time.perf_counter()
    stream.writer(p).put(keys, {
        "image": tq.MultiRagged.from_list([images[i] for i in rows], fixed_dims=(0,)),
        "prompt": prompts[rows],
        "response": torch.nested.nested_tensor(responses, layout=torch.jagged)},
        tags=[{"uid": k.split("_")[0]} for k in keys])
    t1 = time.perf_counter()
    stream.kv.get_batch(keys, fields=["image", "prompt", "response"], partition=p,
                        ragged="list")
    return t1 - t0, time.perf_counter() - t1


def raw_bytes(data: tuple, copies: int) -> int:
    """Bytes of the values put: the images ``copies`` times, prompts as often, responses."""
    images, prompts, responses = data
    return copies * (sum(i.numel() for i in images) + prompts.numel() * 8) + \
        sum(r.numel() * 8 for r in responses)


def run(mode: str) -> list[str]:
    data = workload()
    kwargs = {"mode": "local", "storage_units": 2} if mode == "local" else {}
    out = []
    with tq.init(**kwargs) as stream:
        for name, layout in (("image copied into its 8 rows", copied_layout),
                             ("image shared (put_shared)", shared_layout)):
            put_s, get_s = layout(stream, data)
            part = "copied" if layout is copied_layout else "shared"
            raw = raw_bytes(data, RESPONSES if part == "copied" else 1)
            out.append(f"| {mode} | {name} | {stored(stream, part) / 1e6:.1f} MB | "
                       f"{raw / 1e6:.1f} MB | {put_s * 1e3:.0f} ms | {get_s * 1e3:.0f} ms |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--modes", nargs="+", default=["embedded", "local"])
    args = ap.parse_args()
    print("| mode | layout | units allocated | bytes put | put | read 512 rows |")
    print("|---|---|---|---|---|---|")
    for mode in args.modes:
        for line in run(mode):
            print(line)


if __name__ == "__main__":
    main()
