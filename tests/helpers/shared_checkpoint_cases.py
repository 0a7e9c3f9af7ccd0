"""Checkpoints of shared entries, for the embedded tests and their local-mode variants.

``save_while_groups_stream`` saves while a producer writes groups (``put_shared`` of a
group's image, then rows naming it), restores every checkpoint and checks it is
consistent: every restored row reads the image written for its group, no reserved
entry key is listed as a row, and every restored entry's image is there.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

import tq_stream as tq

P = "v"
GROUP = 4


def image(g: int) -> torch.Tensor:
    """Group ``g``'s image: its pixels name the group."""
    return torch.full((3, 8 + g % 5, 8), g % 251, dtype=torch.uint8)


def image_col(g: int) -> tq.MultiRagged:
    """Group ``g``'s image as a one-row column of a multi-ragged field."""
    return tq.MultiRagged.from_list([image(g)], fixed_dims=(0,))


def group_of(key: str) -> int:
    return int(key[1:].split("_")[0])


def save_while_groups_stream(stream: tq.Stream, folder: str,
                             restore: Callable[[str], tq.Stream], saves: int = 8) -> int:
    """Save ``saves`` checkpoints while groups stream in; returns the rows checked."""
    stop = threading.Event()
    errors: list[BaseException] = []
    done = [0]

    def produce() -> None:
        w = stream.writer(P)
        g = 0
        try:
            while not stop.is_set():
                u = f"g{g}"
                w.put_shared(u, {"image": image_col(g)})
                w.put([f"{u}_{j}" for j in range(GROUP)], {"response": torch.ones(GROUP, 3)},
                      shared=[u] * GROUP)
                g += 1
                done[0] = g
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    thread = threading.Thread(target=produce)
    thread.start()
    paths = []
    try:
        deadline = time.monotonic() + 30
        while done[0] < 2:  # the partition exists and groups flow
            assert time.monotonic() < deadline and not errors, errors
            time.sleep(0.01)
        for s in range(saves):
            paths.append(f"{folder}/ckpt{s}")
            stream.save(paths[-1])
    finally:
        stop.set()
        thread.join(30)
    assert not errors, errors
    checked = 0
    for path in paths:
        with restore(path) as restored:
            rows = restored.kv.list(partition=P)
            keys = [r["key"] for r in rows]
            assert not [k for k in keys if k.startswith("\x00")], f"{path}: entry keys listed"
            assert all(set(r["fields"]) == {"image", "response"} for r in rows), \
                f"{path}: rows restored without their fields"
            got = restored.kv.get_batch(keys, ["image"], partition=P, ragged="list")["image"]
            for k, x in zip(keys, got, strict=True):
                assert torch.equal(x, image(group_of(k))), f"{path}: wrong image for {k}"
            shared = restored.stats()[P]["shared"]
            assert shared["refs"] == len(keys), f"{path}: rows naming no entry"
            groups = {group_of(k) for k in keys}
            assert shared["entries"] >= len(groups)
            # an entry no restored row names yet was committed at the save: a row may
            # name it now and reads its image
            last = max(groups, default=-1) + 1
            if shared["entries"] > len(groups):
                restored.writer(P).put([f"g{last}_x"], {"response": torch.ones(1, 3)},
                                       shared=[f"g{last}"])
                x = restored.kv.get(f"g{last}_x", partition=P)["image"]
                assert torch.equal(x, image(last))
            checked += len(keys)
    return checked
