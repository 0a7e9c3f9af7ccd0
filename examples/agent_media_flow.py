"""Media by reference: agent loop -> inference server -> trainer (the flow of verl
PR 5780, with a handle instead of a ``tq://`` URL and the images freed once used).

Run from the repository root (CPU, a few seconds)::

    python -m examples.agent_media_flow

- The agent loop (a process) stores each prompt's image once (``stream.media.put``)
  and sends the small ``MediaRef`` it gets, not the pixels, to the inference server.
- The inference server (another process, spawned: it knows the deployment only from
  the handle, ``tq.connect(ref.address)``) pins the image while it works, resolves
  it (on this host: views of the storage unit's shared memory), "generates" GROUP
  responses with rewards, releases its pin, and answers.
- The agent loop writes the responses as rows naming the image (``shared=[ref.key]``):
  the image is handed to them, and freed with the last of them.
- The trainer reads whole groups through a ``DynamicFilterSampler``: a group whose
  rewards are all equal is dropped, and its image freed with it; the others are read
  with ``shared="index"`` (each image once per batch) and acked, freeing the rest.

At the end no image, pin or row is left in the deployment.
"""

from __future__ import annotations

import json
import multiprocessing as mp

import torch

import tq_stream as tq

PROMPTS, GROUP = 16, 4  # every 4th prompt's group gets equal rewards: filtered out
PART = "agent"


def image(p: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(p)
    h, w = torch.randint(32, 97, (2,), generator=g).tolist()
    return torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g)


# ------------------------------------------------------------ the inference server
def inference_server(requests: mp.Queue, replies: mp.Queue) -> None:
    """Resolves each handle it is sent; answers with GROUP responses and rewards."""
    stream = None
    while (ref := requests.get(timeout=60)) is not None:
        if stream is None:  # the handle says where its deployment is
            stream = tq.connect(ref.address, curve_server_key=ref.curve_server_key)
        mine = stream.media.pin(ref)  # the image stays while this server uses it
        img = stream.resolve(mine)["image"]  # [3, H, W]
        brightness = float(img.float().mean()) / 255
        p = int(ref.key[1:])
        rewards = [1.0] * GROUP if p % 4 == 3 else [float(j % 2) for j in range(GROUP)]
        responses = [torch.full((3 + j,), int(brightness * 100)) for j in range(GROUP)]
        stream.release(mine)
        replies.put((ref.key, [r.tolist() for r in responses], rewards,
                     list(img.shape)))
    if stream is not None:
        stream.close()


# ------------------------------------------------------------------ the agent loop
def agent_loop(stream: tq.Stream, requests: mp.Queue, replies: mp.Queue) -> None:
    """Stores each image once, sends its handle, writes the answers as rows naming it."""
    writer = stream.writer(PART)
    for p in range(PROMPTS):
        ref = stream.media.put(PART, f"p{p}", {
            "image": tq.MultiRagged.from_list([image(p)], fixed_dims=(0,)),
            "prompt": torch.arange(8) + p})
        requests.put(ref)  # a few hundred bytes, whatever the image's size
        key, responses, rewards, shape = replies.get(timeout=60)
        assert key == ref.key and shape == list(image(p).shape)
        keys = [f"{key}_{j}" for j in range(GROUP)]
        writer.put(keys, {"response": torch.nested.nested_tensor(
                       [torch.tensor(r) for r in responses], layout=torch.jagged)},
                   tags=[{"uid": key, "reward": r} for r in rewards],
                   shared=[key] * GROUP)  # the rows take the image over
    requests.put(None)
    stream.close_partition(PART)


# --------------------------------------------------------------------- the trainer
def main() -> dict:
    stream = tq.init(mode="local", storage_units=2)
    stream.create_partition(PART, consumers=["actor"])
    requests: mp.Queue = mp.get_context("spawn").Queue()
    replies: mp.Queue = mp.get_context("spawn").Queue()
    server = mp.get_context("spawn").Process(target=inference_server,
                                             args=(requests, replies))
    agent = mp.get_context("fork").Process(target=agent_loop,
                                           args=(stream, requests, replies))
    server.start()
    agent.start()

    sampler = tq.samplers.DynamicFilterSampler(tq.samplers.GroupSampler(group_size=GROUP),
                                               on_empty="short")
    ds = tq.StreamingDataset(stream, PART, "actor", ["image", "prompt", "response"],
                             batch_size=2 * GROUP, sampler=sampler, shared="index",
                             ragged="list", timeout=60)
    weight = torch.zeros(1, requires_grad=True)  # a one-parameter "vision encoder"
    opt = torch.optim.SGD([weight], lr=0.01)
    trained, exact = [], True
    for batch in tq.StreamingDataLoader(ds):
        meta = tq.batch_meta(batch)
        feats = torch.stack([img.float().mean() / 255 for img in batch["image"]])
        per_row = feats[batch["image_index"]] * weight  # the encoder ran once per image
        loss = (per_row - 1).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        for key, i in zip(meta.keys, batch["image_index"].tolist(), strict=True):
            exact &= torch.equal(batch["image"][i], image(int(key[1:].split("_")[0])))
        trained += meta.keys
    agent.join(timeout=60)
    server.join(timeout=60)
    stats = stream.stats()[PART]
    units = stream.deployment_stats()["units"]
    stream.close()
    result = {
        "trained_groups": len({k.split("_")[0] for k in trained}),
        "trained_rows": len(trained),
        "filtered_rows": stats["tasks"]["actor"]["discarded"].get("zero_variance", 0),
        "exact": bool(exact),
        "images_left": stats["shared"]["entries"],
        "pins_left": sum(stats["media"]["pins"].values()),
        "rows_left": stats["rows"],
        "unit_rows_left": sum(u["partitions"].get(PART, {}).get("rows", 0) for u in units),
        "exit_codes": [agent.exitcode, server.exitcode],
    }
    print("RESULT " + json.dumps(result))
    return result


if __name__ == "__main__":
    main()
